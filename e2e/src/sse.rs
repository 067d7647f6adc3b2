//! A plain server-sent-events reader for test assertions (not the streaming framer sluice
//! ships — that lives in sluice-core): splits a whole body into events.

/// One dispatched event; comments are dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines joined with `\n`.
    pub data: String,
}

impl Event {
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.data).ok()
    }
}

/// Parses `text` per the SSE rules: lines end in LF, CRLF or CR; a blank line dispatches; lines
/// starting with `:` are comments; one optional space after the colon is stripped.
pub fn parse(text: &str) -> Vec<Event> {
    let mut events = Vec::new();
    let mut event = None;
    let mut data: Option<String> = None;
    let normalized = text.replace("\r\n", "\n").replace('\r', "\n");
    for line in normalized.split('\n') {
        if line.is_empty() {
            if let Some(d) = data.take() {
                events.push(Event { event: event.take(), data: d });
            }
            event = None;
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "event" => event = Some(value.to_string()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            _ => {}
        }
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mixed_line_ends_comments_and_multiline_data() {
        let text = ": keep-alive\r\n\r\nevent: ping\rdata: {}\r\rdata: a\ndata: b\n\ndata: [DONE]\n\n";
        let events = parse(text);
        assert_eq!(
            events,
            vec![
                Event { event: Some("ping".into()), data: "{}".into() },
                Event { event: None, data: "a\nb".into() },
                Event { event: None, data: "[DONE]".into() },
            ]
        );
    }
}
