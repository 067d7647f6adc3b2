//! Test support: runs the built mock binary on port 0 and talks raw HTTP/1.1 to it, keeping the
//! decoded HTTP chunks and their arrival times so tests can check framing and timing.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The mock server as a child process, killed on drop.
pub struct Mock {
    child: Child,
    pub addr: SocketAddr,
}

impl Mock {
    pub fn start(args: &[&str]) -> Mock {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-mock-server"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn mock");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().strip_prefix("listening on ").expect("listening line").parse().unwrap();
        Mock { child, addr }
    }

    pub fn conn(&self) -> Conn {
        Conn::connect(self.addr)
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// Decoded HTTP chunks with the time each was fully received (chunked responses only).
    pub chunks: Vec<(Instant, Vec<u8>)>,
    /// False when the connection closed before the end of the body.
    pub complete: bool,
    pub sent_at: Instant,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    /// SSE events as (event name, data), comments dropped; accepts LF or CRLF line ends.
    pub fn events(&self) -> Vec<(Option<String>, String)> {
        let text = self.text().replace("\r\n", "\n");
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .filter_map(|e| {
                let mut name = None;
                let mut data = None;
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = Some(n.to_string());
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = Some(d.to_string());
                    }
                }
                data.map(|d| (name, d))
            })
            .collect()
    }
    pub fn event_json(&self) -> Vec<serde_json::Value> {
        self.events().iter().filter(|(_, d)| d != "[DONE]").map(|(_, d)| serde_json::from_str(d).unwrap()).collect()
    }
}

/// One client connection, reusable for several requests.
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Conn {
    pub fn connect(addr: SocketAddr) -> Conn {
        let writer = TcpStream::connect(addr).unwrap();
        writer.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn { reader: BufReader::new(writer.try_clone().unwrap()), writer }
    }

    pub fn send_raw(&mut self, raw: &[u8]) -> Instant {
        let at = Instant::now();
        self.writer.write_all(raw).unwrap();
        at
    }

    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
        let mut raw = format!("{method} {path} HTTP/1.1\r\nhost: mock\r\ncontent-length: {}\r\n", body.len());
        for (n, v) in headers {
            raw.push_str(&format!("{n}: {v}\r\n"));
        }
        raw.push_str("\r\n");
        raw.push_str(body);
        let sent_at = self.send_raw(raw.as_bytes());
        self.read_response(sent_at)
    }

    pub fn post(&mut self, path: &str, headers: &[(&str, &str)], body: &serde_json::Value) -> Resp {
        self.request("POST", path, headers, &body.to_string())
    }

    fn line(&mut self) -> Option<String> {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(l.trim_end_matches(['\r', '\n']).to_string()),
        }
    }

    pub fn read_response(&mut self, sent_at: Instant) -> Resp {
        let status_line = self.line().expect("status line");
        let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let l = self.line().expect("header line");
            if l.is_empty() {
                break;
            }
            let (n, v) = l.split_once(':').unwrap();
            headers.push((n.to_ascii_lowercase(), v.trim().to_string()));
        }
        let mut resp = Resp { status, headers, body: vec![], chunks: vec![], complete: false, sent_at };
        if resp.header("transfer-encoding") == Some("chunked") {
            loop {
                let Some(size) = self.line() else { return resp };
                let size = usize::from_str_radix(&size, 16).unwrap();
                if size == 0 {
                    assert_eq!(self.line().as_deref(), Some(""));
                    resp.complete = true;
                    return resp;
                }
                let mut data = vec![0; size + 2];
                if self.reader.read_exact(&mut data).is_err() {
                    return resp;
                }
                data.truncate(size);
                resp.body.extend_from_slice(&data);
                resp.chunks.push((Instant::now(), data));
            }
        }
        let len: usize = resp.header("content-length").map_or(0, |v| v.parse().unwrap());
        resp.body = vec![0; len];
        resp.complete = self.reader.read_exact(&mut resp.body).is_ok();
        resp
    }

    /// Reads whatever bytes have arrived, at most `buf.len()` (blocks until at least one).
    pub fn read_some(&mut self, buf: &mut [u8]) -> usize {
        self.reader.read(buf).unwrap()
    }

    /// True once the server has closed the connection (EOF on read).
    pub fn is_closed(&mut self) -> bool {
        matches!(self.reader.fill_buf(), Ok(b) if b.is_empty())
    }
}

pub fn chat_body(stream: bool, include_usage: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "llama-3-70b",
        "stream": stream,
        "stream_options": {"include_usage": include_usage},
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}],
    })
}
