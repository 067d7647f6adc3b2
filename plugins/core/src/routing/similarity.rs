//! Cheap, bounded comparison of a primary answer with its shadow's.
//!
//! Only a prefix of each answer's text is kept ([`TextPrefix`], capped in bytes), extracted from the
//! response as it streams ([`ResponseText`]) or from a complete body ([`response_text`]); the score
//! is the token-set Jaccard similarity of the two prefixes ([`jaccard_per_mille`]), an integer so it
//! can go straight into an Envoy histogram.

use super::hash::{splitmix64, Fnv1a};
use crate::api::ApiKind;
use crate::scan::{first_time, RawStr, Scanner};
use crate::sse::{SseEvent, SseFramer, DEFAULT_MAX_EVENT_BYTES};
use serde_json::Value;

/// The first `cap` bytes of a text assembled from pieces (streamed deltas), cut on a character
/// boundary. Never holds more than `cap` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextPrefix {
    text: String,
    cap: usize,
    truncated: bool,
}

impl TextPrefix {
    pub fn new(cap: usize) -> Self {
        Self { text: String::with_capacity(cap.min(4096)), cap, truncated: false }
    }

    /// Append `piece`, or as much of it as fits (ending on a character boundary).
    pub fn push(&mut self, piece: &str) {
        if piece.is_empty() || self.truncated {
            if !piece.is_empty() {
                self.truncated = true;
            }
            return;
        }
        let room = self.cap.saturating_sub(self.text.len());
        if piece.len() <= room {
            self.text.push_str(piece);
            return;
        }
        let mut end = room;
        while end > 0 && !piece.is_char_boundary(end) {
            end -= 1;
        }
        self.text.push_str(piece.get(..end).unwrap_or_default());
        self.truncated = true;
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Some text was dropped because the cap was reached.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub fn into_string(self) -> String {
        self.text
    }
}

/// Sorted, deduplicated 64-bit hashes of the words of `s`: maximal runs of alphanumeric characters
/// (Unicode), lowercased. Hashing (FNV-1a + SplitMix64) keeps this allocation-light; two distinct
/// words collide with probability ≈ 2⁻⁶⁴.
fn word_set(s: &str) -> Vec<u64> {
    let mut out = Vec::with_capacity(s.len() / 5 + 1);
    let mut h = Fnv1a::new();
    let mut in_word = false;
    for c in s.chars() {
        if c.is_alphanumeric() {
            if c.is_ascii() {
                h = h.write(&[c.to_ascii_lowercase() as u8]);
            } else {
                let mut buf = [0u8; 4];
                for l in c.to_lowercase() {
                    h = h.write(l.encode_utf8(&mut buf).as_bytes());
                }
            }
            in_word = true;
        } else if in_word {
            out.push(splitmix64(h.finish()));
            h = Fnv1a::new();
            in_word = false;
        }
    }
    if in_word {
        out.push(splitmix64(h.finish()));
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Token-set Jaccard similarity `|A ∩ B| / |A ∪ B|` of the lowercased alphanumeric words of two
/// texts, in per-mille (0–1000, rounded to nearest). Both without words → 1000; one without → 0.
pub fn jaccard_per_mille(a: &str, b: &str) -> u64 {
    let (a, b) = (word_set(a), word_set(b));
    if a.is_empty() && b.is_empty() {
        return 1000;
    }
    let (mut i, mut j, mut inter) = (0usize, 0usize, 0u64);
    while let (Some(x), Some(y)) = (a.get(i), b.get(j)) {
        match x.cmp(y) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = (a.len() as u64 + b.len() as u64).saturating_sub(inter);
    if union == 0 {
        return 1000;
    }
    (inter * 1000 + union / 2) / union
}

/// Content text of a response, fed chunk by chunk, keeping at most `cap` bytes of text.
///
/// What counts as text: chat `choices[0].delta.content` / `message.content` (string or text parts),
/// completions `choices[0].text`, Responses `response.output_text.delta` / `output[].content[]`
/// `output_text` parts, Anthropic `text_delta` / `content[]` `text` blocks. Tool calls, reasoning
/// and refusals are not text. Separate content blocks are joined with `\n`.
///
/// Memory is bounded: the SSE framer's per-event cap, the text cap, and — for a non-streamed JSON
/// body, which must be parsed whole — a body cap ([`DEFAULT_MAX_EVENT_BYTES`] by default); a bigger
/// body yields no text (and [`Self::overflowed`]). Once the text is full, further input is ignored.
#[derive(Debug, Clone)]
pub struct ResponseText {
    kind: ApiKind,
    framer: SseFramer,
    mode: Mode,
    body_cap: usize,
    text: TextPrefix,
    /// Content block of the last piece (Anthropic `index`, Responses output/content index).
    last_block: Option<(u64, u64)>,
    overflowed: bool,
}

#[derive(Debug, Clone)]
enum Mode {
    Undecided,
    Sse,
    Json(Vec<u8>),
}

impl ResponseText {
    pub fn new(kind: ApiKind, cap: usize) -> Self {
        Self::with_body_cap(kind, cap, DEFAULT_MAX_EVENT_BYTES)
    }

    /// As [`Self::new`], collecting at most `body_cap` bytes of a non-streamed JSON body.
    pub fn with_body_cap(kind: ApiKind, cap: usize, body_cap: usize) -> Self {
        Self {
            kind,
            framer: SseFramer::new(DEFAULT_MAX_EVENT_BYTES),
            mode: Mode::Undecided,
            body_cap,
            text: TextPrefix::new(cap),
            last_block: None,
            overflowed: false,
        }
    }

    /// Feed one body chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.text.truncated() {
            return;
        }
        if matches!(self.mode, Mode::Undecided) {
            match chunk.iter().find(|b| !b.is_ascii_whitespace()) {
                None => return,
                Some(b'{') => self.mode = Mode::Json(Vec::new()),
                Some(_) => self.mode = Mode::Sse,
            }
        }
        match &mut self.mode {
            Mode::Json(buf) => {
                if self.overflowed || buf.len().saturating_add(chunk.len()) > self.body_cap {
                    self.overflowed = true;
                    buf.clear();
                    return;
                }
                buf.extend_from_slice(chunk);
            }
            Mode::Sse => {
                let mut framer = std::mem::take(&mut self.framer);
                framer.push(chunk, &mut |ev| self.on_event(&ev));
                self.framer = framer;
            }
            Mode::Undecided => {}
        }
    }

    /// End of the body: parse a collected JSON body, dispatch an unterminated last SSE event.
    pub fn finish(&mut self) {
        match std::mem::replace(&mut self.mode, Mode::Undecided) {
            Mode::Json(buf) => {
                if !self.overflowed {
                    if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                        self.on_body(&v);
                    }
                }
            }
            Mode::Sse => {
                let mut framer = std::mem::take(&mut self.framer);
                framer.finish(&mut |ev| self.on_event(&ev));
                self.framer = framer;
            }
            Mode::Undecided => {}
        }
    }

    pub fn text(&self) -> &TextPrefix {
        &self.text
    }

    pub fn into_text(self) -> TextPrefix {
        self.text
    }

    /// A JSON body was larger than the body cap (no text was taken from it).
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    fn piece(&mut self, block: Option<(u64, u64)>, text: &str) {
        if text.is_empty() {
            return;
        }
        if block.is_some() && self.last_block.is_some() && block != self.last_block {
            self.text.push("\n");
        }
        if block.is_some() {
            self.last_block = block;
        }
        self.text.push(text);
    }

    fn on_event(&mut self, ev: &SseEvent) {
        if self.text.truncated() || ev.data.trim() == "[DONE]" {
            return;
        }
        if matches!(self.kind, ApiKind::ChatCompletions | ApiKind::Completions) {
            if let Some(pieces) = openai_first_choice_text(&ev.data) {
                for t in pieces.into_iter().flatten() {
                    self.piece(None, &t.text());
                }
                return;
            }
        }
        // From the bytes, as core reads all its JSON: one serde_json reader type in each .wasm.
        let Ok(v) = serde_json::from_slice::<Value>(ev.data.as_bytes()) else { return };
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => {
                if let Some(choice) = first_choice(&v) {
                    if let Some(content) = choice.get("delta").and_then(|d| d.get("content")) {
                        self.content_value(content);
                    }
                    if let Some(t) = choice.get("text").and_then(Value::as_str) {
                        self.piece(None, t);
                    }
                }
            }
            ApiKind::Responses => {
                let ty = v.get("type").and_then(Value::as_str).or(ev.event.as_deref());
                if ty == Some("response.output_text.delta") {
                    if let Some(d) = v.get("delta").and_then(Value::as_str) {
                        let block = (u64_or_0(&v, "output_index"), u64_or_0(&v, "content_index"));
                        self.piece(Some(block), d);
                    }
                }
            }
            ApiKind::AnthropicMessages => {
                let ty = v.get("type").and_then(Value::as_str).or(ev.event.as_deref());
                if ty == Some("content_block_delta") {
                    let delta = v.get("delta");
                    if delta.and_then(|d| d.get("type")).and_then(Value::as_str) == Some("text_delta") {
                        if let Some(t) = delta.and_then(|d| d.get("text")).and_then(Value::as_str) {
                            self.piece(Some((u64_or_0(&v, "index"), 0)), t);
                        }
                    }
                }
            }
        }
    }

    /// Chat `content`: a string, or an array of parts whose `text` strings count.
    fn content_value(&mut self, content: &Value) {
        match content {
            Value::String(s) => self.piece(None, s),
            Value::Array(parts) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        self.piece(None, t);
                    }
                }
            }
            _ => {}
        }
    }

    fn on_body(&mut self, v: &Value) {
        match self.kind {
            ApiKind::ChatCompletions | ApiKind::Completions => {
                if let Some(choice) = first_choice(v) {
                    if let Some(content) = choice.get("message").and_then(|m| m.get("content")) {
                        self.content_value(content);
                    }
                    if let Some(t) = choice.get("text").and_then(Value::as_str) {
                        self.piece(None, t);
                    }
                }
            }
            ApiKind::Responses => {
                let items = v.get("output").and_then(Value::as_array).into_iter().flatten();
                for (oi, item) in items.enumerate() {
                    let parts = item.get("content").and_then(Value::as_array).into_iter().flatten();
                    for (ci, part) in parts.enumerate() {
                        if part.get("type").and_then(Value::as_str) == Some("output_text") {
                            if let Some(t) = part.get("text").and_then(Value::as_str) {
                                self.piece(Some((oi as u64, ci as u64)), t);
                            }
                        }
                    }
                }
            }
            ApiKind::AnthropicMessages => {
                let blocks = v.get("content").and_then(Value::as_array).into_iter().flatten();
                for (bi, block) in blocks.enumerate() {
                    if block.get("type").and_then(Value::as_str) == Some("text") {
                        if let Some(t) = block.get("text").and_then(Value::as_str) {
                            self.piece(Some((bi as u64, 0)), t);
                        }
                    }
                }
            }
        }
    }
}

/// The choice with `index` 0 (or without an index) of `choices`.
/// An OpenAI chunk's text as [`ResponseText`] reads it from a tree — the first choice whose
/// `index` is absent or 0: its `delta.content`, then its `text` — read by core's scanner instead
/// (a tree per event was most of a shadow comparison's cost). `None` when the scanner is not sure
/// (invalid or unusual JSON, a repeated key, content parts, an odd `index` or `delta`): the tree
/// decides. Whatever it answers, the tree would have answered the same (tests below).
fn openai_first_choice_text(data: &str) -> Option<[Option<RawStr<'_>>; 2]> {
    let mut found: Option<[Option<RawStr<'_>>; 2]> = None;
    let mut sc = Scanner::new(data);
    let mut seen = 0u32;
    sc.object(|sc, key| {
        if !key.is("choices") {
            return sc.value().map(|_| ());
        }
        first_time(&mut seen, 1)?;
        if sc.null() {
            return Some(());
        }
        sc.array(|sc| {
            let (first, pieces) = choice_text(sc)?;
            if found.is_none() && first {
                found = Some(pieces);
            }
            Some(())
        })
    })?;
    sc.at_end().then_some(found.unwrap_or_default())
}

/// One element of `choices`: whether it is a first choice (`index` absent or 0), and its
/// `delta.content` and `text` strings.
fn choice_text<'a>(sc: &mut Scanner<'a>) -> Option<(bool, [Option<RawStr<'a>>; 2])> {
    let (mut first, mut content, mut text, mut seen) = (true, None, None, 0u32);
    sc.object(|sc, key| {
        if key.is("index") {
            first_time(&mut seen, 1)?;
            let raw = sc.value()?;
            // A plain integer; a float, a negative or anything else is the tree's to judge.
            first = match raw {
                b"0" => true,
                [b'1'..=b'9', rest @ ..] if rest.iter().all(u8::is_ascii_digit) => false,
                _ => return None,
            };
        } else if key.is("delta") {
            first_time(&mut seen, 2)?;
            if !sc.null() {
                let mut delta_seen = 0u32;
                sc.object(|sc, key| {
                    if key.is("content") {
                        first_time(&mut delta_seen, 1)?;
                        content = sc.opt_string().ok()?;
                        Some(())
                    } else {
                        sc.value().map(|_| ())
                    }
                })?;
            }
        } else if key.is("text") {
            first_time(&mut seen, 4)?;
            text = sc.opt_string().ok()?;
        } else {
            sc.value()?;
        }
        Some(())
    })?;
    Some((first, [content, text]))
}

fn first_choice(v: &Value) -> Option<&Value> {
    v.get("choices")?.as_array()?.iter().find(|c| c.get("index").is_none_or(|i| i.as_u64() == Some(0)))
}

fn u64_or_0(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// The content text (first `cap` bytes, cut on a character boundary) of a complete response body,
/// streamed (SSE) or not (JSON); see [`ResponseText`] for what counts as text. A JSON body is parsed
/// whatever its size (it is already in memory).
pub fn response_text(kind: ApiKind, body: &[u8], cap: usize) -> String {
    let mut r = ResponseText::with_body_cap(kind, cap, body.len());
    r.push(body);
    r.finish();
    r.into_text().into_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_sets_lowercase_and_split_on_non_alphanumerics() {
        assert_eq!(word_set("Hello, hello WORLD!"), word_set("world hello"));
        assert_eq!(word_set("").len(), 0);
        assert_eq!(word_set("  ... ").len(), 0);
        assert_eq!(word_set("Über über ÜBER").len(), 1);
        assert_eq!(word_set("a-b a_b").len(), 2);
    }

    /// The text a tree of `data` gives (the general path of `ResponseText::on_event`).
    fn tree_text(kind: ApiKind, data: &str) -> String {
        let mut tree = ResponseText::new(kind, 1 << 20);
        let Ok(v) = serde_json::from_slice::<Value>(data.as_bytes()) else { return String::new() };
        if let Some(choice) = first_choice(&v) {
            if let Some(content) = choice.get("delta").and_then(|d| d.get("content")) {
                tree.content_value(content);
            }
            if let Some(t) = choice.get("text").and_then(Value::as_str) {
                tree.piece(None, t);
            }
        }
        tree.into_text().as_str().to_owned()
    }

    /// The scanner's reading of an OpenAI chunk is the tree's, wherever it answers; it leaves the
    /// unusual shapes to the tree.
    #[test]
    fn openai_chunks_read_by_the_scanner_as_the_tree_reads_them() {
        let answered = [
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}],"usage":null}"#,
            r#"{"choices":[{"delta":{"content":"no index"}}]}"#,
            r#"{"choices":[{"index":1,"delta":{"content":"second"}},{"index":0,"delta":{"content":"first"}}]}"#,
            r#"{"choices":[{"index":2,"text":"x"},{"text":"absent index"},{"index":0,"text":"later zero"}]}"#,
            r#"{"choices":[{"index":0,"text":"done","finish_reason":"stop"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"both"},"text":" and text"}]}"#,
            r#"{"choices":[{"delta":{"content":"esc \"q\" \u00e9\n"},"index":0}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":null,"tool_calls":[{"id":"t"}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{}}]}"#,
            r#"{"choices":[{"index":0,"delta":null,"text":null}]}"#,
            r#"{"choices":[]}"#,
            r#"{"choices":null,"usage":{"prompt_tokens":3}}"#,
            r#"{"object":"chat.completion.chunk"}"#,
            r#"  {"choices":[{"index":0,"delta":{"content":"spaced"}}]}  "#,
            r#"{"choices":[{"index":3,"delta":{"content":"only other"}}]}"#,
        ];
        for data in answered {
            let fast = openai_first_choice_text(data).unwrap_or_else(|| panic!("the scanner gave up on {data}"));
            let mut text = ResponseText::new(ApiKind::ChatCompletions, 1 << 20);
            for t in fast.into_iter().flatten() {
                text.piece(None, &t.text());
            }
            assert_eq!(text.into_text().as_str(), tree_text(ApiKind::ChatCompletions, data), "{data}");
        }
        let left_to_the_tree = [
            r#"{"choices":[{"index":0,"delta":{"content":[{"type":"text","text":"parts"}]}}]}"#,
            r#"{"choices":[{"index":0.0,"delta":{"content":"float index"}}]}"#,
            r#"{"choices":[{"index":null,"delta":{"content":"null index"}}]}"#,
            r#"{"choices":[{"index":0,"index":1,"delta":{"content":"repeated"}}]}"#,
            r#"{"choices":[{"index":0,"delta":"not an object"}]}"#,
            r#"{"choices":["not an object"]}"#,
            r#"{"choices":{"index":0}}"#,
            r#"{"choices":[{"index":0,"text":7}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"cut"#,
            r#"[{"choices":[]}]"#,
            r#"{"choices":[],"choices":[{"text":"second"}]}"#,
        ];
        for data in left_to_the_tree {
            assert!(openai_first_choice_text(data).is_none(), "{data}");
        }
        // And through the framer: a stream read whole gives the tree's text of every event.
        let events = answered.iter().map(|d| format!("data: {}\n\n", d.trim())).collect::<String>();
        let mut stream = ResponseText::new(ApiKind::ChatCompletions, 1 << 20);
        stream.push(events.as_bytes());
        stream.finish();
        let want: String = answered.iter().map(|d| tree_text(ApiKind::ChatCompletions, d)).collect();
        assert_eq!(stream.into_text().as_str(), want);
    }

    fn choice_json() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let index = prop::sample::select(vec!["", r#""index":0,"#, r#""index":1,"#, r#""index":0.0,"#, r#""index":null,"#, r#""index":"0","#]);
        let content = prop::sample::select(vec![
            "",
            r#""delta":{"content":"a b"},"#,
            r#""delta":{"content":null},"#,
            r#""delta":{"content":[{"text":"part"}]},"#,
            r#""delta":{"role":"assistant","content":"é\"x"},"#,
            r#""delta":null,"#,
            r#""delta":"s","#,
        ]);
        let text = prop::sample::select(vec!["", r#""text":"t","#, r#""text":null,"#, r#""text":7,"#]);
        (index, content, text, any::<bool>()).prop_map(|(i, c, t, swap)| {
            let members = if swap { format!("{t}{c}{i}") } else { format!("{i}{c}{t}") };
            format!("{{{members}\"finish_reason\":null}}")
        })
    }

    proptest::proptest! {
        /// Any mix of choices: where the scanner answers, it answers as the tree does.
        #[test]
        fn the_scanner_never_disagrees_with_the_tree(choices in proptest::collection::vec(choice_json(), 0..4)) {
            let data = format!(r#"{{"id":"x","choices":[{}],"usage":null}}"#, choices.join(","));
            if let Some(fast) = openai_first_choice_text(&data) {
                let mut text = ResponseText::new(ApiKind::ChatCompletions, 1 << 20);
                for t in fast.into_iter().flatten() {
                    text.piece(None, &t.text());
                }
                let got = text.into_text().as_str().to_owned();
                proptest::prop_assert_eq!(got, tree_text(ApiKind::ChatCompletions, &data), "{}", data);
            }
        }
    }
}
