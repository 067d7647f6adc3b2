//! Command line of the mock LLM server: parse flags, bind, print the bound address, serve.

use sluice_mock_server::{Config, Server};
use std::io::Write;
use std::time::Duration;

const USAGE: &str = "\
usage: sluice-mock-server [options]
  --listen ADDR          address to listen on (default 127.0.0.1:8000; port 0 picks a free port)
  --model-name NAME      model reported in answers (default: echo the request's model)
  --ttft-ms N            default delay before the first content token (default 0)
  --itl-ms N             default delay between content tokens (default 0)
  --tokens N             default number of content tokens (default 16)
  --served-by NAME       default value of the x-mock-served-by response header (default mock)
  --max-connections N    connections served at once (default 1024)
  --idle-timeout-s N     close kept-alive connections idle this long (default 300)
Per-request x-mock-* headers override these; see the crate README.";

fn parse_args(args: &[String]) -> Result<(String, Config), String> {
    let mut listen = "127.0.0.1:8000".to_string();
    let mut config = Config::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        // Accept both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let mut value = || inline.clone().or_else(|| it.next().cloned()).ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|_| format!("{flag}: not a non-negative integer: {v:?}"));
        match flag {
            "--listen" => listen = value()?,
            "--model-name" => config.defaults.model_name = Some(value()?),
            "--ttft-ms" => config.defaults.ttft = Duration::from_millis(num(value()?)?),
            "--itl-ms" => config.defaults.itl = Duration::from_millis(num(value()?)?),
            "--tokens" => config.defaults.tokens = num(value()?)?,
            "--served-by" => config.defaults.served_by = value()?,
            "--max-connections" => config.max_connections = usize::try_from(num(value()?)?).unwrap_or(usize::MAX),
            "--idle-timeout-s" => config.idle_timeout = Duration::from_secs(num(value()?)?),
            _ => return Err(format!("unknown argument {arg:?}")),
        }
    }
    Ok((listen, config))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (listen, config) = match parse_args(&args) {
        Ok(parsed) => parsed,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("sluice-mock-server: {msg}");
            }
            eprintln!("{USAGE}");
            std::process::exit(if msg.is_empty() { 0 } else { 2 });
        }
    };
    let server = Server::bind(&listen, config).map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    // Tests read this line to learn the port, so it goes out (flushed) before serving.
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {}", server.local_addr()?)?;
    out.flush()?;
    drop(out);
    server.run()?;
    Ok(())
}
