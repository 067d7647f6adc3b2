//! The members of a request body a [`super::Plan`] reads: from its tree ([`Body::of_value`], the
//! server's) or straight from its JSON text in one pass ([`Body::parse`], the simulator's: a tree
//! per request, every member and message an allocation, was a quarter of its modelled upstream's
//! instructions). The two read the same: the text is checked as the tree's parser checks it
//! (strings' UTF-8, numbers' range, depth), the last of a repeated member counts, and prompt
//! tokens follow [`super::prompt_tokens`]'s rule (tests hold them equal).

use super::{prompt_tokens, Api};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;

/// The body's `model` member.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Model {
    /// Absent or null.
    #[default]
    Unset,
    Name(String),
    /// Anything but a string or null.
    Invalid,
}

/// A token limit member (`max_tokens`, …).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Limit {
    /// Absent or null.
    #[default]
    Unset,
    Tokens(u64),
    /// Anything but a non-negative integer or null.
    Invalid,
}

/// What a plan reads from a request body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Body {
    /// The body is a JSON object (a body that is not JSON is none); nothing else is set otherwise.
    pub object: bool,
    pub model: Model,
    /// `stream` is `true`.
    pub stream: bool,
    /// `stream_options.include_usage` is `true`.
    pub include_usage: bool,
    pub max_completion_tokens: Limit,
    pub max_tokens: Limit,
    pub max_output_tokens: Limit,
    /// Prompt tokens by the API's rule (0 without an API).
    pub prompt_tokens: u64,
}

impl Body {
    /// The members of `body`'s tree, the prompt counted as for `api`.
    pub fn of_value(api: Option<Api>, body: &Value) -> Body {
        if !body.is_object() {
            return Body::default();
        }
        let model = match body.get("model") {
            None | Some(Value::Null) => Model::Unset,
            Some(Value::String(m)) => Model::Name(m.clone()),
            Some(_) => Model::Invalid,
        };
        let limit = |field: &str| match body.get(field) {
            None | Some(Value::Null) => Limit::Unset,
            Some(v) => v.as_u64().map_or(Limit::Invalid, Limit::Tokens),
        };
        Body {
            object: true,
            model,
            stream: body.get("stream") == Some(&Value::Bool(true)),
            include_usage: body.pointer("/stream_options/include_usage") == Some(&Value::Bool(true)),
            max_completion_tokens: limit("max_completion_tokens"),
            max_tokens: limit("max_tokens"),
            max_output_tokens: limit("max_output_tokens"),
            prompt_tokens: api.map_or(0, |api| prompt_tokens(api, body)),
        }
    }

    /// The members of the JSON text `json`, the prompt counted as for `api`: what
    /// [`Body::of_value`] reads from its tree (a text that is not JSON: as a `null` tree).
    pub fn parse(api: Option<Api>, json: &[u8]) -> Body {
        let mut de = serde_json::Deserializer::from_slice(json);
        match de.deserialize_any(Top { api }).and_then(|body| de.end().map(|()| body)) {
            Ok(Some(body)) => body,
            _ => Body::default(),
        }
    }
}

/// One unit of text's prompt tokens, as [`prompt_tokens`] counts them.
fn unit(chars: u64) -> u64 {
    chars.div_ceil(4) + 4
}

fn chars(s: &str) -> u64 {
    s.chars().count() as u64
}

/// The top-level members a plan reads, by index.
const TOP: [&str; 11] =
    ["model", "stream", "stream_options", "max_completion_tokens", "max_tokens", "max_output_tokens", "messages", "prompt", "instructions", "input", "system"];

/// The body: its members when it is an object.
struct Top {
    api: Option<Api>,
}

impl<'de> Visitor<'de> for Top {
    type Value = Option<Body>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Body>, A::Error> {
        let mut body = Body { object: true, ..Body::default() };
        let api = self.api;
        let is = |apis: &[Api]| api.is_some_and(|a| apis.contains(&a));
        // Each part of the prompt from its member's last occurrence, as a tree keeps it.
        let [mut messages, mut prompt, mut instructions, mut input, mut system] = [0u64; 5];
        while let Some(key) = map.next_key_seed(Key(&TOP))? {
            match key {
                Some(0) => body.model = map.next_value_seed(ModelSeed)?,
                Some(1) => body.stream = map.next_value_seed(Read(Role::True))? == 1,
                Some(2) => body.include_usage = map.next_value_seed(Read(Role::IncludeUsage))? == 1,
                Some(3) => body.max_completion_tokens = map.next_value_seed(LimitSeed)?,
                Some(4) => body.max_tokens = map.next_value_seed(LimitSeed)?,
                Some(5) => body.max_output_tokens = map.next_value_seed(LimitSeed)?,
                Some(6) if is(&[Api::Chat, Api::Messages]) => messages = map.next_value_seed(Read(Role::Messages))?,
                Some(7) if is(&[Api::Completions]) => prompt = map.next_value_seed(Read(Role::Prompt))?,
                Some(8) if is(&[Api::Responses]) => instructions = map.next_value_seed(Read(Role::Instructions))?,
                Some(9) if is(&[Api::Responses]) => input = map.next_value_seed(Read(Role::Input))?,
                Some(10) if is(&[Api::Messages]) => system = map.next_value_seed(Read(Role::System))?,
                _ => {
                    map.next_value_seed(Read(Role::Skip))?;
                }
            }
        }
        // Only the API's members were read; the others stayed 0.
        body.prompt_tokens = messages + prompt + instructions + input + system;
        Ok(Some(body))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<Body>, A::Error> {
        skip_seq(seq).map(|_| None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Option<Body>, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Option<Body>, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Option<Body>, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Option<Body>, E> {
        Ok(None)
    }

    fn visit_str<E>(self, _: &str) -> Result<Option<Body>, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<Body>, E> {
        Ok(None)
    }
}

/// A member's key as its index in the names wanted (`None`: not wanted), compared where the
/// parser holds it.
struct Key<'k>(&'k [&'k str]);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Option<usize>, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E>(self, key: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|k| *k == key))
    }
}

/// The rest of an array, checked and dropped.
fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<u64, A::Error> {
    while seq.next_element_seed(Read(Role::Skip))?.is_some() {}
    Ok(0)
}

/// The rest of an object, checked and dropped.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<u64, A::Error> {
    while map.next_key_seed(Key(&[]))?.is_some() {
        map.next_value_seed(Read(Role::Skip))?;
    }
    Ok(0)
}

/// The `model` member.
struct ModelSeed;

impl<'de> DeserializeSeed<'de> for ModelSeed {
    type Value = Model;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Model, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ModelSeed {
    type Value = Model;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E>(self, m: &str) -> Result<Model, E> {
        Ok(Model::Name(m.to_string()))
    }

    fn visit_unit<E>(self) -> Result<Model, E> {
        Ok(Model::Unset)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Model, E> {
        Ok(Model::Invalid)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Model, E> {
        Ok(Model::Invalid)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Model, E> {
        Ok(Model::Invalid)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Model, E> {
        Ok(Model::Invalid)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Model, A::Error> {
        skip_seq(seq).map(|_| Model::Invalid)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Model, A::Error> {
        skip_map(map).map(|_| Model::Invalid)
    }
}

/// A token limit member.
struct LimitSeed;

impl<'de> DeserializeSeed<'de> for LimitSeed {
    type Value = Limit;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Limit, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LimitSeed {
    type Value = Limit;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_u64<E>(self, n: u64) -> Result<Limit, E> {
        Ok(Limit::Tokens(n))
    }

    /// A tree's number from an `i64` is its `u64` when it is not negative.
    fn visit_i64<E>(self, n: i64) -> Result<Limit, E> {
        Ok(u64::try_from(n).map_or(Limit::Invalid, Limit::Tokens))
    }

    fn visit_unit<E>(self) -> Result<Limit, E> {
        Ok(Limit::Unset)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Limit, E> {
        Ok(Limit::Invalid)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Limit, E> {
        Ok(Limit::Invalid)
    }

    fn visit_str<E>(self, _: &str) -> Result<Limit, E> {
        Ok(Limit::Invalid)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Limit, A::Error> {
        skip_seq(seq).map(|_| Limit::Invalid)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Limit, A::Error> {
        skip_map(map).map(|_| Limit::Invalid)
    }
}

/// What a value is read for; each gives a count ([`prompt_tokens`]'s rule, or 1 for a flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Nothing: checked only.
    Skip,
    /// `true` gives 1.
    True,
    /// `stream_options`: 1 when its `include_usage` is `true`.
    IncludeUsage,
    /// A text unit's characters: a string's, or its parts' when an array.
    Text,
    /// A part of an array: a string's characters, or an object's `text` string's.
    Part,
    /// A string's characters (a part's `text`).
    Chars,
    /// `messages`: a unit per element (its `content`'s text); nothing when not an array.
    Messages,
    /// An element of `messages`: its `content`'s text characters.
    Message,
    /// Completions' `prompt`: a unit per element when an array, else one unit of its text.
    Prompt,
    /// Responses' `instructions`: a unit when a string.
    Instructions,
    /// Responses' `input`: a unit per item (its `content`'s text, else its `output`'s) when an
    /// array, else one unit of its text.
    Input,
    /// An item of `input`: its `content`'s text characters, else its `output`'s.
    Item,
    /// Anthropic's `system`: one unit of its text.
    System,
}

impl Role {
    /// The count of a value that is neither a string, an array nor an object (text of none).
    fn scalar(self) -> u64 {
        match self {
            Role::Prompt | Role::Input | Role::System => unit(0),
            _ => 0,
        }
    }
}

/// A value read for its role.
struct Read(Role);

impl<'de> DeserializeSeed<'de> for Read {
    type Value = u64;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<u64, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Read {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<u64, E> {
        Ok(if self.0 == Role::True { u64::from(b) } else { self.0.scalar() })
    }

    fn visit_i64<E>(self, _: i64) -> Result<u64, E> {
        Ok(self.0.scalar())
    }

    fn visit_u64<E>(self, _: u64) -> Result<u64, E> {
        Ok(self.0.scalar())
    }

    fn visit_f64<E>(self, _: f64) -> Result<u64, E> {
        Ok(self.0.scalar())
    }

    fn visit_unit<E>(self) -> Result<u64, E> {
        Ok(self.0.scalar())
    }

    fn visit_str<E>(self, s: &str) -> Result<u64, E> {
        Ok(match self.0 {
            Role::Text | Role::Part | Role::Chars => chars(s),
            Role::Prompt | Role::Input | Role::System | Role::Instructions => unit(chars(s)),
            Role::Skip | Role::True | Role::IncludeUsage | Role::Messages | Role::Message | Role::Item => 0,
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
        let (element, per_element_unit) = match self.0 {
            Role::Text => (Role::Part, false),
            Role::Messages => (Role::Message, true),
            Role::Prompt => (Role::Text, true),
            Role::Input => (Role::Item, true),
            // One unit of the array's text.
            Role::System => {
                let mut total = 0;
                while let Some(n) = seq.next_element_seed(Read(Role::Part))? {
                    total += n;
                }
                return Ok(unit(total));
            }
            Role::Skip | Role::True | Role::IncludeUsage | Role::Part | Role::Chars | Role::Message | Role::Instructions | Role::Item => {
                return skip_seq(seq);
            }
        };
        let mut total = 0;
        while let Some(n) = seq.next_element_seed(Read(element))? {
            total += if per_element_unit { unit(n) } else { n };
        }
        Ok(total)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        // The members that count, the last of each.
        let (wanted, as_role): (&[&str], Role) = match self.0 {
            Role::IncludeUsage => (&["include_usage"], Role::True),
            Role::Part => (&["text"], Role::Chars),
            Role::Message => (&["content"], Role::Text),
            Role::Item => (&["content", "output"], Role::Text),
            // An object's text is none: one unit of nothing.
            Role::Prompt | Role::Input | Role::System => return skip_map(map).map(|_| unit(0)),
            Role::Skip | Role::True | Role::Text | Role::Chars | Role::Messages | Role::Instructions => return skip_map(map),
        };
        let mut found: [Option<u64>; 2] = [None, None];
        while let Some(key) = map.next_key_seed(Key(wanted))? {
            match key.and_then(|i| found.get_mut(i)) {
                Some(slot) => *slot = Some(map.next_value_seed(Read(as_role))?),
                None => {
                    map.next_value_seed(Read(Role::Skip))?;
                }
            }
        }
        // An item's `content`, else its `output`; the others have one member.
        Ok(found[0].or(found[1]).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    const APIS: [Option<Api>; 5] = [None, Some(Api::Chat), Some(Api::Completions), Some(Api::Responses), Some(Api::Messages)];

    /// The text and the tree read the same, for every API.
    fn assert_same(json: &[u8]) {
        let tree: Value = serde_json::from_slice(json).unwrap_or(Value::Null);
        for api in APIS {
            assert_eq!(Body::parse(api, json), Body::of_value(api, &tree), "{api:?} {}", String::from_utf8_lossy(json));
        }
    }

    #[test]
    fn bodies_read_from_text_are_read_from_the_tree() {
        let bodies: &[&str] = &[
            r#"{"model":"llama-3-70b","messages":[{"role":"user","content":"Hello there"}],"stream":true,"max_tokens":64,"user":"acme-u1"}"#,
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":7,"max_tokens":9}"#,
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true,"include_usage":false}}"#,
            r#"{"stream_options":{"include_usage":true},"stream_options":[true]}"#,
            r#"{"stream_options":{"include_usage":1},"stream":1}"#,
            r#"{"model":null,"max_tokens":null,"max_output_tokens":-1,"max_completion_tokens":1.0}"#,
            r#"{"model":7}"#,
            r#"{"model":["a"],"max_tokens":"3"}"#,
            r#"{"model":{"a":1},"max_tokens":{"n":3},"max_output_tokens":[3]}"#,
            r#"{"model":"first","model":"second","stream":true,"stream":false}"#,
            r#"{"mod\u0065l":"escaped \"key\" \u00e9\ud83d\ude00","max_tokens":18446744073709551615}"#,
            r#"{"max_tokens":18446744073709551616}"#,
            r#"{"max_tokens":-0}"#,
            r#"{"max_tokens":1e400}"#,
            r#"{"messages":[{"content":[{"type":"text","text":"Hel"},{"type":"text","text":"lo"},"raw",7,{"text":5},{"text":"a","text":"bcdé"}]},"not an object",null,{"content":null},{},{"content":"x","content":"yyyyyyyyy"}]}"#,
            r#"{"messages":"not an array","system":"You are terse."}"#,
            r#"{"system":[{"text":"a b c d e"},"fgh"],"messages":[{"content":"Hello"}],"messages":[{"content":"Hello again, world"}]}"#,
            r#"{"system":null}"#,
            r#"{"system":{"text":"ignored"}}"#,
            r#"{"prompt":"Hello"}"#,
            r#"{"prompt":["Hello","",["par","ts"],null,{"text":"x"}]}"#,
            r#"{"prompt":null}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":42}"#,
            r#"{"instructions":"Be brief","input":"Hello"}"#,
            r#"{"instructions":["not","a string"],"input":[{"content":"abc"},{"output":"defgh"},{"content":null,"output":"zzzzzzzzz"},{"output":"o","content":"cc"},"str",{},{"content":[{"text":"pp"}]}]}"#,
            r#"{"input":null,"instructions":7}"#,
            r#"{"input":{"content":"x"}}"#,
            r#"{"a":[[[[{"b":[1,2,{"c":null}]}]]]],"model":"deep"}"#,
            r#"  {"model" : "spaced" , "stream" : true }  "#,
            "[1,2,3]",
            "\"text\"",
            "42",
            "null",
            "true",
            "",
            "{",
            r#"{"model":"m"} trailing"#,
            r#"{"model":"m",}"#,
            r#"{"model":"unterminated}"#,
            r#"{"messages":[{"content":"bad escape \x"}]}"#,
            r#"{"other":1e999,"model":"m"}"#,
            r#"{"other":"\ud800","model":"lone surrogate"}"#,
        ];
        for body in bodies {
            assert_same(body.as_bytes());
        }
        // Invalid UTF-8 inside a member nobody reads: a tree refuses the whole text.
        assert_same(b"{\"model\":\"m\",\"other\":\"\xff\xfe\"}");
        assert_same(b"{\"model\":\"m\xc3\"}");
        // Deeper than the parser allows, in a member nobody reads.
        let deep = format!("{{\"model\":\"m\",\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert_same(deep.as_bytes());
        let ok = format!("{{\"model\":\"m\",\"x\":{}{}}}", "[".repeat(100), "]".repeat(100));
        assert_same(ok.as_bytes());
        assert!(Body::parse(None, ok.as_bytes()).object);
    }

    /// Random bodies: members the plan reads and others, every kind of value, repeated keys,
    /// escapes; each read from its text and from its tree.
    #[test]
    fn random_bodies_read_from_text_are_read_from_the_tree() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..4000 {
            let mut out = String::new();
            write_value(&mut next, &mut out, 0, true);
            assert_same(out.as_bytes());
        }
    }

    const KEYS: [&str; 20] = [
        "model",
        "stream",
        "stream_options",
        "include_usage",
        "max_completion_tokens",
        "max_tokens",
        "max_output_tokens",
        "messages",
        "prompt",
        "instructions",
        "input",
        "system",
        "content",
        "output",
        "text",
        "role",
        "user",
        "mod\\u0065l",
        "te\\u0078t",
        "other",
    ];
    const STRINGS: [&str; 8] = ["", "a", "Hello there", "é😀 ünïcode", "esc \\\"q\\\" \\\\ \\n \\u00e9", "\\ud83d\\ude00", "m", "tok0 tok1 "];
    const SCALARS: [&str; 14] =
        ["null", "true", "false", "0", "7", "-3", "-0", "1.5", "1e3", "18446744073709551615", "18446744073709551616", "64", "1e999", "-1e999"];

    fn write_value(next: &mut impl FnMut(u64) -> u64, out: &mut String, depth: u32, object: bool) {
        let kind = if object { 0 } else { next(if depth > 4 { 2 } else { 5 }) + 1 };
        match kind {
            0 | 4 => {
                out.push('{');
                for i in 0..next(6) {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push('"');
                    out.push_str(KEYS[next(KEYS.len() as u64) as usize]);
                    out.push_str("\":");
                    write_value(next, out, depth + 1, false);
                }
                out.push('}');
            }
            1 => out.push_str(SCALARS[next(SCALARS.len() as u64) as usize]),
            2 => {
                out.push('"');
                out.push_str(STRINGS[next(STRINGS.len() as u64) as usize]);
                out.push('"');
            }
            _ => {
                out.push('[');
                for i in 0..next(5) {
                    if i > 0 {
                        out.push(',');
                    }
                    write_value(next, out, depth + 1, false);
                }
                out.push(']');
            }
        }
    }

    /// Each API counts its own members of the prompt.
    #[test]
    fn prompts_are_counted_per_api() {
        let body = br#"{"messages":[{"content":"Hello"}],"prompt":["abcde"],"input":[{"output":"xyz"}],"instructions":"ab","system":"s"}"#;
        let counts: Vec<u64> = APIS.iter().map(|api| Body::parse(*api, body).prompt_tokens).collect();
        assert_eq!(counts, [0, 6, 6, 5 + 5, 5 + 6]);
    }
}
