//! What reached the mock at the transport level, before any answer: every connection accepted and
//! every request head read, whether or not a body followed. The per-request ledger
//! ([`crate::ledger`]) only holds requests that were read whole and answered; a gateway that sends a
//! request's headers and then resets the stream (or closes the connection) leaves no ledger record,
//! but leaves a head here, with `body: "incomplete"`. Read back with `GET /mock/connections` and
//! `GET /mock/heads`, so a test can prove that a refused request reached the upstream not at all,
//! not even as headers.
//!
//! Bounded: the last [`CAPACITY`] connections and heads are kept, older ones dropped.

use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Connections and heads kept (each); older ones are dropped.
pub const CAPACITY: usize = 100_000;

/// What became of a request's body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyState {
    /// The head announced no body (or `content-length: 0`).
    None,
    /// The head announced a body, which is still being read.
    Receiving,
    /// The announced body arrived whole.
    Complete,
    /// The connection closed, reset or timed out before the announced body was complete.
    Incomplete,
    /// The body's framing was broken (answered 4xx, connection closed).
    Bad,
}

impl BodyState {
    /// The wire name: `none`, `receiving`, `complete`, `incomplete`, `bad`.
    pub fn name(self) -> &'static str {
        match self {
            BodyState::None => "none",
            BodyState::Receiving => "receiving",
            BodyState::Complete => "complete",
            BodyState::Incomplete => "incomplete",
            BodyState::Bad => "bad",
        }
    }
}

/// One accepted connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// 1, 2, … in accept order (not reset by `/mock/reset`).
    pub id: u64,
    pub peer: String,
    /// Milliseconds since the Unix epoch.
    pub opened_ms: u64,
    /// Request heads read on it.
    pub heads: u64,
    pub closed: bool,
    /// Refused for `--max-connections` (answered 503 and closed without reading).
    pub refused: bool,
}

/// One request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadRecord {
    /// 1, 2, … in arrival order (not reset by `/mock/reset`).
    pub seq: u64,
    /// The [`Connection::id`] it came on.
    pub connection: u64,
    pub method: String,
    pub path: String,
    /// The `x-request-id` header, if any.
    pub request_id: Option<String>,
    /// Milliseconds since the Unix epoch, when the head was read.
    pub at_ms: u64,
    pub body: BodyState,
    /// Every header line as read (names lower-cased, values trimmed), in order, duplicates kept:
    /// what proves which headers a gateway forwarded and which it removed.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Default)]
struct Logs {
    next_connection: u64,
    next_head: u64,
    /// Connections accepted since start (or the last reset).
    accepted: u64,
    connections: VecDeque<Connection>,
    heads: VecDeque<HeadRecord>,
}

/// The connection and head logs.
#[derive(Debug, Default)]
pub struct Traffic {
    logs: Mutex<Logs>,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The entry with `id` in a deque whose entries carry increasing ids (`id_of`), in O(1).
fn find<T>(items: &mut VecDeque<T>, id: u64, id_of: impl Fn(&T) -> u64) -> Option<&mut T> {
    let first = id_of(items.front()?);
    let index = usize::try_from(id.checked_sub(first)?).ok()?;
    items.get_mut(index).filter(|item| id_of(item) == id)
}

impl Traffic {
    fn logs(&self) -> std::sync::MutexGuard<'_, Logs> {
        // A poisoned lock only means another thread panicked mid-update; the logs stay valid.
        self.logs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a connection just accepted; returns its id.
    pub fn connection_opened(&self, peer: &str, refused: bool) -> u64 {
        let mut logs = self.logs();
        logs.next_connection += 1;
        logs.accepted += 1;
        let id = logs.next_connection;
        if logs.connections.len() >= CAPACITY {
            logs.connections.pop_front();
        }
        logs.connections.push_back(Connection { id, peer: peer.to_string(), opened_ms: now_ms(), heads: 0, closed: refused, refused });
        id
    }

    pub fn connection_closed(&self, id: u64) {
        if let Some(c) = find(&mut self.logs().connections, id, |c| c.id) {
            c.closed = true;
        }
    }

    /// Records a request head read on connection `connection` with its header lines; returns its
    /// sequence number.
    pub fn head(&self, connection: u64, method: &str, path: &str, headers: &[(String, String)], body: BodyState) -> u64 {
        let request_id = headers.iter().find(|(n, _)| n == "x-request-id").map(|(_, v)| v.as_str());
        let mut logs = self.logs();
        logs.next_head += 1;
        let seq = logs.next_head;
        if let Some(c) = find(&mut logs.connections, connection, |c| c.id) {
            c.heads += 1;
        }
        if logs.heads.len() >= CAPACITY {
            logs.heads.pop_front();
        }
        logs.heads.push_back(HeadRecord {
            seq,
            connection,
            method: method.to_string(),
            path: path.to_string(),
            request_id: request_id.map(str::to_string),
            at_ms: now_ms(),
            body,
            headers: headers.to_vec(),
        });
        seq
    }

    /// What became of head `seq`'s body.
    pub fn body(&self, seq: u64, body: BodyState) {
        if let Some(h) = find(&mut self.logs().heads, seq, |h| h.seq) {
            h.body = body;
        }
    }

    /// Forgets every connection and head and zeroes the accepted count (ids keep growing).
    pub fn clear(&self) {
        let mut logs = self.logs();
        logs.accepted = 0;
        logs.connections.clear();
        logs.heads.clear();
    }

    /// Connections accepted since start or the last reset.
    pub fn accepted(&self) -> u64 {
        self.logs().accepted
    }

    /// `{"accepted": n, "open": n, "connections": [{"id", "peer", "opened_ms", "heads", "closed",
    /// "refused"}, …]}`, oldest first; `open` counts the logged connections not closed yet.
    pub fn connections_json(&self) -> Value {
        let logs = self.logs();
        let open = logs.connections.iter().filter(|c| !c.closed).count();
        let list: Vec<Value> = logs
            .connections
            .iter()
            .map(|c| {
                json!({"id": c.id, "peer": c.peer, "opened_ms": c.opened_ms, "heads": c.heads,
                       "closed": c.closed, "refused": c.refused})
            })
            .collect();
        json!({"accepted": logs.accepted, "open": open, "connections": list})
    }

    /// `[{"seq", "connection", "method", "path", "request_id", "at_ms", "body", "headers"}, …]`,
    /// oldest first; `headers` is `[[name, value], …]` in arrival order.
    pub fn heads_json(&self) -> Value {
        let logs = self.logs();
        Value::Array(
            logs.heads
                .iter()
                .map(|h| {
                    json!({"seq": h.seq, "connection": h.connection, "method": h.method, "path": h.path,
                           "request_id": h.request_id, "at_ms": h.at_ms, "body": h.body.name(), "headers": h.headers})
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn heads_and_connections_are_updated_in_place_and_bounded() {
        let t = Traffic::default();
        let c = t.connection_opened("127.0.0.1:1", false);
        let sent = [("x-request-id".to_string(), "a".to_string()), ("x-dup".to_string(), "1".to_string()), ("x-dup".to_string(), "2".to_string())];
        let h = t.head(c, "POST", "/v1/messages", &sent, BodyState::Receiving);
        t.body(h, BodyState::Incomplete);
        t.connection_closed(c);
        let conns = t.connections_json();
        assert_eq!(conns["accepted"], 1);
        assert_eq!(conns["open"], 0);
        assert_eq!(conns["connections"][0]["heads"], 1);
        let heads = t.heads_json();
        assert_eq!(heads[0]["body"], "incomplete");
        assert_eq!(heads[0]["request_id"], "a");
        assert_eq!(heads[0]["headers"], json!([["x-request-id", "a"], ["x-dup", "1"], ["x-dup", "2"]]));
        for _ in 0..CAPACITY + 1 {
            t.head(c, "GET", "/health", &[], BodyState::None);
        }
        let heads = t.heads_json();
        let heads = heads.as_array().map(Vec::as_slice).unwrap_or_default();
        assert_eq!(heads.len(), CAPACITY);
        // The oldest went; updates still find the rest by sequence number.
        let last = heads[CAPACITY - 1]["seq"].as_u64().unwrap_or(0);
        t.body(last, BodyState::Bad);
        assert_eq!(t.heads_json()[CAPACITY - 1]["body"], "bad");
        t.body(1, BodyState::Complete); // dropped already: no effect, no panic
        t.clear();
        assert_eq!(t.accepted(), 0);
        assert_eq!(t.heads_json(), json!([]));
    }
}
