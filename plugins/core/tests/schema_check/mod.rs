//! Compares a configuration type's JSON Schema, as schemars derives it from the Rust types (what the
//! plugin's parser accepts), with the schema shipped in `policies/` and with the plugin's docs page.
//!
//! Both schemas are reduced to the same facts, per path (`orgs[].teams[].keys[].budgets[].window`:
//! `[]` steps into array items; `$ref`, `allOf`, `oneOf` and `anyOf` are followed, the branches of
//! a union merged):
//!
//! - which property names exist at the path, and whether each is required (in a union, required
//!   when every branch about objects requires it);
//! - whether the object at the path refuses unknown members (`additionalProperties: false`);
//! - the string values allowed there (`enum`, `const`: unit variants, serde tags);
//! - the JSON types allowed (the shipped schema may be stricter: `integer` where the code reads a
//!   number, no `null` where the code reads an `Option`);
//! - the default, when the code has one (a default the code has must be stated in the shipped
//!   schema, with the same value; schemars cannot show the defaults of types that do not
//!   implement `Serialize`, like `mode` or `prices`, so those are not compared).
//!
//! `not`, `if`/`then`/`else` are not part of the shape. Value ranges cannot be compared this way
//! (the code checks them when it compiles the policy, not in its types): [`boundary_disagreements`]
//! checks them differentially, with the schema validator and the plugin's parser.
//!
//! Then [`compare_docs`] checks the docs page against the code's shape. Shared by sluice-core's and
//! sluice-llm-metrics' `tests/schema_agreement.rs`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository's `policies/` directory.
pub fn policies_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies")
}

/// The repository's `docs/` directory.
pub fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Facts about one property.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prop {
    pub required: bool,
    /// JSON types allowed (`integer`, `number`, `string`, `boolean`, `array`, `object`, `null`);
    /// empty when the schema does not say (a `const`, an `enum`).
    pub types: BTreeSet<String>,
    pub default: Option<Value>,
    /// `minimum` and `maximum` (the shipped schemas state the parser's ranges; schemars only the
    /// Rust type's).
    pub minimum: Option<f64>,
    pub maximum: Option<f64>,
}

/// A schema reduced to facts per path.
#[derive(Debug, Default)]
pub struct Shape {
    /// Property path → facts. A path is its parent's path, `.`, the name; array items add `[]`.
    pub props: BTreeMap<String, Prop>,
    /// Path → string values allowed there.
    pub enums: BTreeMap<String, BTreeSet<String>>,
    /// Path of an object → whether it refuses unknown members.
    pub closed: BTreeMap<String, bool>,
}

impl Shape {
    /// Property names at every path (the last segment of each property path).
    pub fn names(&self) -> BTreeSet<String> {
        self.props.keys().map(|p| leaf(p).to_string()).collect()
    }

    /// Every path as its segments without `[]`: `orgs[].teams[].id` → `["orgs", "teams", "id"]`.
    pub fn segment_paths(&self) -> Vec<Vec<String>> {
        self.props.keys().map(|p| segments(p)).collect()
    }
}

pub fn leaf(path: &str) -> &str {
    let p = path.trim_end_matches("[]");
    p.rsplit('.').next().unwrap_or(p).trim_end_matches("[]")
}

pub fn segments(path: &str) -> Vec<String> {
    path.split('.').map(|s| s.trim_end_matches("[]").to_string()).filter(|s| !s.is_empty()).collect()
}

/// A set of schema documents (file name → document) for resolving `$ref`s, local and to a
/// sibling file (`llm-metrics.schema.json#/properties/prices`).
pub struct Documents {
    docs: BTreeMap<String, Value>,
}

impl Documents {
    /// Every `policies/*.schema.json`, plus the generated schema under `generated`.
    pub fn new(generated: (&str, Value)) -> Self {
        let mut docs = BTreeMap::new();
        for entry in std::fs::read_dir(policies_dir()).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".schema.json") {
                docs.insert(name, read_json(&path));
            }
        }
        docs.insert(generated.0.to_string(), generated.1);
        Documents { docs }
    }

    pub fn get(&self, name: &str) -> &Value {
        self.docs.get(name).unwrap_or_else(|| panic!("no schema document {name}"))
    }

    /// Reduces document `name` to its shape.
    pub fn shape(&self, name: &str) -> Shape {
        let mut shape = Shape::default();
        let root = self.get(name);
        self.walk(&mut shape, "", vec![(name.to_string(), root)], 0);
        shape
    }

    fn resolve<'a>(&'a self, doc: &str, reference: &str) -> (String, &'a Value) {
        let (file, pointer) = reference.split_once('#').unwrap_or((reference, ""));
        let file = if file.is_empty() { doc.to_string() } else { file.rsplit('/').next().unwrap_or(file).to_string() };
        let target = self.get(&file).pointer(pointer).unwrap_or_else(|| panic!("{doc}: $ref {reference:?} resolves to nothing"));
        (file, target)
    }

    /// The facts of one schema node, following `$ref`, `allOf`, `oneOf` and `anyOf`.
    fn view<'a>(&'a self, doc: &str, node: &'a Value, depth: usize) -> View<'a> {
        assert!(depth < 64, "{doc}: $ref nesting too deep (a cycle?)");
        let mut v = View::default();
        let Some(obj) = node.as_object() else { return v };
        if let Some(Value::String(r)) = obj.get("$ref") {
            let (d, target) = self.resolve(doc, r);
            v.merge_all(self.view(&d, target, depth + 1));
        }
        if let Some(Value::Object(props)) = obj.get("properties") {
            v.object = true;
            for (name, sub) in props {
                v.props.entry(name.clone()).or_default().push((doc.to_string(), sub));
            }
        }
        if let Some(Value::Array(req)) = obj.get("required") {
            v.required.extend(req.iter().filter_map(Value::as_str).map(str::to_string));
        }
        match obj.get("type") {
            Some(Value::String(t)) => v.types.extend([t.clone()]),
            Some(Value::Array(ts)) => v.types.extend(ts.iter().filter_map(Value::as_str).map(str::to_string)),
            _ => {}
        }
        if v.types.contains("object") {
            v.object = true;
        }
        if let Some(ap) = obj.get("additionalProperties") {
            v.closed = Some(ap == &Value::Bool(false));
        }
        if let Some(items) = obj.get("items") {
            v.items.push((doc.to_string(), items));
        }
        if let Some(Value::String(c)) = obj.get("const") {
            v.strings.insert(c.clone());
        }
        if let Some(Value::Array(values)) = obj.get("enum") {
            v.strings.extend(values.iter().filter_map(Value::as_str).map(str::to_string));
        }
        if let Some(d) = obj.get("default") {
            v.default = Some(d.clone());
        }
        v.minimum = obj.get("minimum").and_then(Value::as_f64).or(v.minimum);
        v.maximum = obj.get("maximum").and_then(Value::as_f64).or(v.maximum);
        if let Some(Value::Array(all)) = obj.get("allOf") {
            for sub in all {
                v.merge_all(self.view(doc, sub, depth + 1));
            }
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(Value::Array(branches)) = obj.get(key) {
                let views: Vec<View> = branches.iter().map(|b| self.view(doc, b, depth + 1)).collect();
                v.merge_union(views);
            }
        }
        v
    }

    /// Walks the schemas `nodes` (alternatives for one path, merged as a union) into `shape`.
    fn walk(&self, shape: &mut Shape, path: &str, nodes: Vec<(String, &Value)>, depth: usize) {
        assert!(depth < 32, "{path}: schema nesting too deep");
        let views: Vec<View> = nodes.iter().map(|(d, n)| self.view(d, n, 0)).collect();
        let mut v = View::default();
        v.merge_union(views);
        if !v.strings.is_empty() {
            shape.enums.entry(path.to_string()).or_default().extend(v.strings.iter().cloned());
        }
        if v.object {
            if let Some(closed) = v.closed {
                shape.closed.insert(path.to_string(), closed);
            }
        }
        for (name, subs) in &v.props {
            let p = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
            let sub_views: Vec<View> = subs.iter().map(|(d, n)| self.view(d, n, 0)).collect();
            let mut merged = View::default();
            merged.merge_union(sub_views);
            shape.props.insert(
                p.clone(),
                Prop {
                    required: v.required.contains(name),
                    types: merged.types.clone(),
                    default: merged.default.clone(),
                    minimum: merged.minimum,
                    maximum: merged.maximum,
                },
            );
            self.walk(shape, &p, subs.clone(), depth + 1);
        }
        if !v.items.is_empty() {
            self.walk(shape, &format!("{path}[]"), v.items.clone(), depth + 1);
        }
    }
}

#[derive(Default)]
struct View<'a> {
    object: bool,
    props: BTreeMap<String, Vec<(String, &'a Value)>>,
    required: BTreeSet<String>,
    closed: Option<bool>,
    items: Vec<(String, &'a Value)>,
    strings: BTreeSet<String>,
    types: BTreeSet<String>,
    default: Option<Value>,
    minimum: Option<f64>,
    maximum: Option<f64>,
}

impl<'a> View<'a> {
    /// Both apply (`$ref` with siblings, `allOf`).
    fn merge_all(&mut self, o: View<'a>) {
        self.object |= o.object;
        for (k, subs) in o.props {
            self.props.entry(k).or_default().extend(subs);
        }
        self.required.extend(o.required);
        self.closed = match (self.closed, o.closed) {
            (Some(a), Some(b)) => Some(a || b),
            (a, b) => a.or(b),
        };
        self.items.extend(o.items);
        self.strings.extend(o.strings);
        self.types.extend(o.types);
        if self.default.is_none() {
            self.default = o.default;
        }
        self.minimum = self.minimum.or(o.minimum);
        self.maximum = self.maximum.or(o.maximum);
    }

    /// One of them applies (`oneOf`, `anyOf`, or alternatives for one path). A property is
    /// required when every branch about objects (with members or `required`) requires it; the
    /// union is closed when every object branch is. A branch that is not about objects (`null`,
    /// a string variant) adds no member and requires none.
    fn merge_union(&mut self, branches: Vec<View<'a>>) {
        let about_objects: Vec<&View> = branches.iter().filter(|b| b.object || !b.required.is_empty()).collect();
        let mut req: Option<BTreeSet<String>> = None;
        for b in &about_objects {
            req = Some(match req {
                None => b.required.clone(),
                Some(r) => r.intersection(&b.required).cloned().collect(),
            });
        }
        self.required.extend(req.unwrap_or_default());
        let objects: Vec<&View> = branches.iter().filter(|b| b.object).collect();
        if !objects.is_empty() {
            self.object = true;
            let closed: Vec<bool> = objects.iter().filter_map(|b| b.closed).collect();
            if !closed.is_empty() {
                let all = closed.iter().all(|c| *c);
                self.closed = Some(self.closed.map_or(all, |c| c || all));
            }
        }
        for b in branches {
            for (k, subs) in b.props {
                self.props.entry(k).or_default().extend(subs);
            }
            self.items.extend(b.items);
            self.strings.extend(b.strings);
            self.types.extend(b.types);
            if self.default.is_none() {
                self.default = b.default;
            }
            self.minimum = self.minimum.or(b.minimum);
            self.maximum = self.maximum.or(b.maximum);
        }
    }
}

/// Does the shipped type set fit what the code accepts? The shipped schema may be stricter (an
/// `integer` where the code reads a number, no `null`), never looser.
fn types_fit(shipped: &BTreeSet<String>, code: &BTreeSet<String>) -> bool {
    shipped.iter().all(|t| code.contains(t) || (t == "integer" && code.contains("number")))
}

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_value(p, q)),
        (Value::Object(x), Value::Object(y)) => x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w))),
        _ => a == b,
    }
}

/// Every disagreement between the code's shape and the shipped schema's, one line each.
pub fn compare(code: &Shape, shipped: &Shape) -> Vec<String> {
    let mut out = Vec::new();
    for (path, c) in &code.props {
        let Some(s) = shipped.props.get(path) else {
            out.push(format!("`{path}`: the code accepts it, the shipped schema does not have it"));
            continue;
        };
        if c.required != s.required {
            out.push(format!("`{path}`: required in the {} only", if c.required { "code" } else { "shipped schema" }));
        }
        if !s.types.is_empty() && !c.types.is_empty() && !types_fit(&s.types, &c.types) {
            out.push(format!("`{path}`: shipped schema allows types {:?}, the code reads {:?}", s.types, c.types));
        }
        match (&c.default, &s.default) {
            (Some(Value::Null) | None, None) => {}
            (Some(cd), Some(sd)) if same_value(cd, sd) => {}
            // schemars can only show defaults of types that implement `Serialize`; a default of
            // another type (`mode`, `prices`) is there but unseen: only a required member has none.
            (None | Some(Value::Null), Some(_)) if !c.required => {}
            (None | Some(Value::Null), Some(sd)) => out.push(format!("`{path}`: shipped schema states default {sd}, the code requires the member")),
            (Some(cd), None) => out.push(format!("`{path}`: the code defaults to {cd}, the shipped schema states no default")),
            (Some(cd), Some(sd)) => out.push(format!("`{path}`: default {cd} in the code, {sd} in the shipped schema")),
        }
    }
    for path in shipped.props.keys() {
        if !code.props.contains_key(path) {
            out.push(format!("`{path}`: in the shipped schema, the code does not accept it"));
        }
    }
    let paths: BTreeSet<&String> = code.enums.keys().chain(shipped.enums.keys()).collect();
    for path in paths {
        let empty = BTreeSet::new();
        let c = code.enums.get(path).unwrap_or(&empty);
        let s = shipped.enums.get(path).unwrap_or(&empty);
        for v in c.difference(s) {
            out.push(format!("`{}`: the code accepts {v:?}, the shipped schema does not", show(path)));
        }
        for v in s.difference(c) {
            out.push(format!("`{}`: the shipped schema allows {v:?}, the code does not", show(path)));
        }
    }
    for (path, c) in &code.closed {
        match shipped.closed.get(path) {
            Some(s) if s == c => {}
            s => out.push(format!(
                "`{}`: unknown members {} by the code, {} by the shipped schema",
                show(path),
                if *c { "refused" } else { "allowed" },
                match s {
                    Some(true) => "refused",
                    _ => "allowed",
                }
            )),
        }
    }
    out
}

fn show(path: &str) -> &str {
    if path.is_empty() {
        "(root)"
    } else {
        path
    }
}

/// A part of a docs page: from the line that starts with `from` (a heading) up to the next heading
/// of the same or a higher level, or the whole page when `from` is `None`.
pub struct DocSection {
    pub file: &'static str,
    pub from: Option<&'static str>,
}

pub struct DocText {
    pub label: String,
    pub text: String,
}

pub fn doc_text(s: &DocSection) -> DocText {
    let path = docs_dir().join(s.file);
    let page = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let Some(from) = s.from else { return DocText { label: s.file.to_string(), text: page } };
    let level = from.chars().take_while(|c| *c == '#').count();
    let mut out = String::new();
    let mut inside = false;
    let mut fenced = false;
    for line in page.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if !fenced && line.starts_with('#') {
            let l = line.chars().take_while(|c| *c == '#').count();
            if inside && l <= level {
                break;
            }
            if line.trim_end() == from {
                inside = true;
            }
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(inside, "{}: no heading {from:?}", s.file);
    DocText { label: format!("{} § {}", s.file, from.trim_start_matches('#').trim()), text: out }
}

/// The contents of every code span (`…`) and fenced block of a text.
pub fn code_spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced: Option<String> = None;
    for line in text.lines() {
        if line.starts_with("```") {
            match fenced.take() {
                Some(block) => out.push(block),
                None => fenced = Some(String::new()),
            }
            continue;
        }
        if let Some(block) = fenced.as_mut() {
            block.push_str(line);
            block.push('\n');
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find('`') {
            let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
            let fence = "`".repeat(ticks);
            let after = &rest[start + ticks..];
            match after.find(&fence) {
                Some(end) => {
                    out.push(after[..end].to_string());
                    rest = &after[end + ticks..];
                }
                None => break,
            }
        }
    }
    out
}

/// Identifier-like words (`[A-Za-z0-9_-]+`) of the code spans of a text.
pub fn code_words(text: &str) -> BTreeSet<String> {
    code_spans(text)
        .iter()
        .flat_map(|span| {
            span.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-')).filter(|w| !w.is_empty()).map(str::to_string).collect::<Vec<_>>()
        })
        .collect()
}

/// The first-column code spans of the rows of every table whose header's first cell is `field`:
/// the fields a policy table documents, as written (`orgs[].teams[].keys[]`, `…budgets[]`,
/// `versions[].breaker.while_open.{critical,standard,sheddable}`).
pub fn table_fields(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_table = false;
    for line in text.lines() {
        let t = line.trim();
        if !t.starts_with('|') {
            in_table = false;
            continue;
        }
        let first = t.trim_start_matches('|').split('|').next().unwrap_or("").trim();
        if !in_table {
            in_table = first == "field";
            continue;
        }
        if first.starts_with("---") {
            continue;
        }
        out.extend(code_spans(first));
    }
    out
}

/// `versions[].breaker.while_open.{critical,standard}` → its paths as segments, without `[]` and
/// leading `…`.
pub fn expand_doc_path(written: &str) -> Vec<Vec<String>> {
    let w = written.trim().trim_start_matches('…').trim_start_matches("...").trim_start_matches('.');
    let mut paths: Vec<Vec<String>> = vec![Vec::new()];
    // Split on dots outside braces.
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in w.chars() {
        match c {
            '{' => {
                depth += 1;
                cur.push(c)
            }
            '}' => {
                depth -= 1;
                cur.push(c)
            }
            '.' if depth == 0 => parts.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    parts.push(cur);
    for part in parts {
        let part = part.replace("[]", "");
        let alternatives: Vec<String> = match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
            Some(inner) => inner.split(',').map(|s| s.trim().to_string()).collect(),
            None => vec![part],
        };
        paths = paths
            .into_iter()
            .flat_map(|p| {
                alternatives.iter().map(move |a| {
                    let mut q = p.clone();
                    q.push(a.clone());
                    q
                })
            })
            .collect();
    }
    paths
}

/// The blocks of a text — each table row, each fenced block, each paragraph or list item — as
/// the words of their code spans.
pub fn blocks(text: &str) -> Vec<BTreeSet<String>> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut fenced = false;
    let flush = |current: &mut String, out: &mut Vec<BTreeSet<String>>| {
        if !current.trim().is_empty() {
            out.push(code_words(current));
        }
        current.clear();
    };
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") {
            if fenced {
                current.push_str(line);
                current.push('\n');
                flush(&mut current, &mut out);
            } else {
                flush(&mut current, &mut out);
                current.push_str(line);
                current.push('\n');
            }
            fenced = !fenced;
            continue;
        }
        if fenced {
            current.push_str(line);
            current.push('\n');
            continue;
        }
        let list_item = t.starts_with("- ") || t.split_once(". ").is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if t.is_empty() || t.starts_with('|') || t.starts_with('#') || list_item {
            flush(&mut current, &mut out);
        }
        current.push_str(line);
        current.push('\n');
        if t.starts_with('|') || t.starts_with('#') {
            flush(&mut current, &mut out);
        }
    }
    flush(&mut current, &mut out);
    out
}

/// Every disagreement between the code's shape and the docs:
///
/// - every property name at every path must appear in the docs sections as a word of a code span
///   (`name`, `"name": …`, `a.b.name`) — a nested one in the same block (table row, paragraph,
///   list item) as its parent's name (`models[].shadow.version.route`: `route` beside `version`);
/// - every allowed string value must appear as such a word, in a block that names its property;
/// - every field a `| field |` table documents must be a path of the code (a suffix of one:
///   `keys[].max_output_tokens`), and every top-level property must head a row of such a table;
/// - every member of a JSON object written in a code span of the sections must be a property
///   name of the code.
pub fn compare_docs(code: &Shape, sections: &[DocSection]) -> Vec<String> {
    let texts: Vec<DocText> = sections.iter().map(doc_text).collect();
    let labels: Vec<&str> = texts.iter().map(|t| t.label.as_str()).collect();
    let all: String = texts.iter().map(|t| t.text.as_str()).collect::<Vec<_>>().join("\n");
    let words = code_words(&all);
    let blocks = blocks(&all);
    let together = |a: &str, b: &str| blocks.iter().any(|w| w.contains(a) && w.contains(b));
    let mut out = Vec::new();
    for path in code.props.keys() {
        let segs = segments(path);
        let name = leaf(path);
        match segs.len().checked_sub(2).and_then(|i| segs.get(i)) {
            None if !words.contains(name) => out.push(format!("`{path}`: accepted by the code, `{name}` not documented in {labels:?}")),
            Some(parent) if !together(parent, name) => {
                out.push(format!("`{path}`: accepted by the code, `{name}` not documented beside `{parent}` in {labels:?}"))
            }
            _ => {}
        }
    }
    for (path, values) in &code.enums {
        let name = leaf(path);
        for v in values {
            if !together(name, v) {
                out.push(format!("`{}`: the code accepts {v:?}, not documented beside `{name}` in {labels:?}", show(path)));
            }
        }
    }
    let code_paths = code.segment_paths();
    let fields = table_fields(&all);
    for written in &fields {
        for doc_path in expand_doc_path(written) {
            let fits = code_paths.iter().any(|p| p.len() >= doc_path.len() && p[p.len() - doc_path.len()..] == doc_path[..]);
            if !fits {
                out.push(format!("docs field `{written}` ({}): not a field the code accepts", doc_path.join(".")));
            }
        }
    }
    let heads: BTreeSet<String> = fields.iter().flat_map(|w| expand_doc_path(w)).filter_map(|p| p.first().cloned()).collect();
    for path in code.props.keys().filter(|p| !p.contains('.') && !p.contains('[')) {
        if !heads.contains(path) {
            out.push(format!("`{path}`: top-level field without a row in the docs' field table ({labels:?})"));
        }
    }
    let names = code.names();
    for span in code_spans(&all) {
        let Ok(value) = serde_json::from_str::<Value>(span.trim()) else { continue };
        let mut keys = BTreeSet::new();
        collect_keys(&value, &mut keys);
        for k in keys {
            if !names.contains(&k) {
                out.push(format!("docs example {}: member `{k}` is not a field the code accepts", span.trim()));
            }
        }
    }
    out
}

fn collect_keys(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                out.insert(k.clone());
                collect_keys(v, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|v| collect_keys(v, out)),
        _ => {}
    }
}

/// A validator of `policies/<name>` that resolves references to its sibling schemas from the
/// directory (and fetches nothing).
pub fn validator(schema_file: &str) -> jsonschema::Validator {
    struct Sibling;
    impl jsonschema::Retrieve for Sibling {
        fn retrieve(&self, uri: &jsonschema::Uri<String>) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
            let s = uri.as_str();
            let name = s.strip_prefix("https://sluice.dev/schemas/").ok_or_else(|| format!("unexpected reference {s}"))?;
            Ok(read_json(&policies_dir().join(name)))
        }
    }
    let schema = read_json(&policies_dir().join(schema_file));
    jsonschema::options().with_retriever(Sibling).build(&schema).unwrap_or_else(|e| panic!("{schema_file} is not a valid JSON Schema: {e}"))
}

/// Schema violations of `instance`, one line each.
pub fn violations(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator.iter_errors(instance).map(|e| format!("{}: {e}", e.instance_path())).collect()
}

/// The shipped example configurations of a plugin: `policies/<plugin>.*.json` other than the schema.
pub fn examples(plugin: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(policies_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(&format!("{plugin}.")) && name.ends_with(".json") && !name.ends_with(".schema.json")
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no example of {plugin} in policies/");
    out
}

/// Fails with every line of `problems`, under `what`.
pub fn assert_none(what: &str, problems: &[String]) {
    assert!(problems.is_empty(), "{what}: {} disagreement(s):\n  {}", problems.len(), problems.join("\n  "));
}

/// A numeric member of an example the boundary check varies: present (replaced) or absent with a
/// default in the schema (added).
struct Target {
    /// JSON pointer of the member's parent and its name.
    parent: String,
    name: String,
    path: String,
    prop: Prop,
}

fn numeric_targets(shipped: &Shape, value: &Value, pointer: &str, path: &str, out: &mut Vec<Target>) {
    match value {
        Value::Object(m) => {
            for (k, v) in m {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                let ptr = format!("{pointer}/{}", k.replace('~', "~0").replace('/', "~1"));
                if v.is_number() {
                    if let Some(prop) = shipped.props.get(&p) {
                        out.push(Target { parent: pointer.to_string(), name: k.clone(), path: p.clone(), prop: prop.clone() });
                    }
                }
                numeric_targets(shipped, v, &ptr, &p, out);
            }
            // Members the example leaves out but whose default is a number: tried too.
            let prefix = if path.is_empty() { String::new() } else { format!("{path}.") };
            for (p, prop) in &shipped.props {
                let Some(name) = p.strip_prefix(&prefix) else { continue };
                if name.contains('.') || name.contains('[') || m.contains_key(name) {
                    continue;
                }
                if prop.default.as_ref().is_some_and(Value::is_number) && (prop.minimum.is_some() || prop.maximum.is_some()) {
                    out.push(Target { parent: pointer.to_string(), name: name.to_string(), path: p.clone(), prop: prop.clone() });
                }
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                numeric_targets(shipped, v, &format!("{pointer}/{i}"), &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

/// Differential check of value ranges: for every numeric member of `example` (and every numeric
/// member with a default it leaves out) whose shipped schema states a `minimum` or `maximum`, the
/// example with that member at each bound and just past it must be accepted by the schema exactly
/// when `load` (the plugin's parser) accepts it. `cross_field` lists the paths where a value
/// within the schema's range may still be refused because of another member (a rule the schema's
/// description states); disagreements there are not reported when the schema accepts and the
/// parser refuses.
pub fn boundary_disagreements(
    shipped: &Shape,
    validator: &jsonschema::Validator,
    example: &Value,
    load: &dyn Fn(&[u8]) -> Result<(), String>,
    cross_field: &[&str],
) -> Vec<String> {
    // An example the schema or the parser already refuses is reported by the examples test.
    if !validator.is_valid(example) || load(&serde_json::to_vec(example).unwrap()).is_err() {
        return Vec::new();
    }
    let mut targets = Vec::new();
    numeric_targets(shipped, example, "", "", &mut targets);
    let mut out = Vec::new();
    for t in targets {
        let integer = t.prop.types.contains("integer");
        let mut candidates: Vec<Value> = Vec::new();
        for (bound, step) in [(t.prop.minimum, -1.0), (t.prop.maximum, 1.0)] {
            let Some(b) = bound else { continue };
            if integer {
                candidates.push(Value::from(b as i64));
                candidates.push(Value::from(b as i64 + step as i64));
            } else {
                candidates.push(Value::from(b));
                candidates.push(Value::from(b + step * 0.001));
            }
        }
        for c in candidates {
            let mut doc = example.clone();
            let Some(Value::Object(parent)) = doc.pointer_mut(&t.parent) else { continue };
            parent.insert(t.name.clone(), c.clone());
            let schema_ok = validator.is_valid(&doc);
            let loaded = load(&serde_json::to_vec(&doc).unwrap());
            if schema_ok == loaded.is_ok() || (schema_ok && cross_field.contains(&t.path.as_str())) {
                continue;
            }
            out.push(match loaded {
                Ok(()) => format!("`{}` = {c}: the plugin accepts it, the schema refuses it", t.path),
                Err(e) => format!("`{}` = {c}: the schema accepts it, the plugin refuses it ({e})", t.path),
            });
        }
    }
    out
}
