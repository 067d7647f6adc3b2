//! One response observed once for every policy that reads it.
//!
//! llm-metrics, tenant-budget, model-router (when it compares a shadow) and latency-guard each need
//! what a streamed response says — content events, usage, the end — and each used to frame and
//! scan every event itself. A host that runs several of them on one stream in one VM gives them one
//! [`SharedResponse`] instead: each policy holds an [`Observer::Shared`] reader of it, the first
//! reader to see a chunk frames and scans it, and every other reader takes what that chunk added.
//!
//! Readers are told apart by how many bytes they have caught up to. A reader at the front (it has
//! seen everything pushed so far) pushes the chunk it is given; a reader behind takes the
//! difference without reading its chunk (its chunk is bytes the front already pushed, possibly
//! several chunks merged by the proxy's buffering, or with another policy's edit on top). That holds
//! as long as the readers are given the response in the order the proxy passes it through them,
//! each seeing every chunk — true of filters on one stream, and of the sections of one filter.
//! Hosts without several readers (tests, the playground) use [`Observer::Own`].

use crate::api::ApiKind;
use crate::response::{ChunkOutcome, ResponseSummary, StreamObserver, ValidatedJson};
use std::cell::RefCell;
use std::rc::Rc;

/// What the shared observer has counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Totals {
    content_events: u64,
    estimated_tokens: u64,
    usage_reports: u64,
    done: bool,
}

impl Totals {
    fn add(&mut self, o: ChunkOutcome) {
        self.content_events = self.content_events.saturating_add(u64::from(o.content_events));
        self.estimated_tokens = self.estimated_tokens.saturating_add(u64::from(o.estimated_tokens));
        self.usage_reports = self.usage_reports.saturating_add(u64::from(o.usage_seen));
        self.done |= o.done;
    }

    /// What was counted after `earlier`, as one chunk's outcome.
    fn since(&self, earlier: &Totals) -> ChunkOutcome {
        let narrow = |now: u64, then: u64| u32::try_from(now.saturating_sub(then)).unwrap_or(u32::MAX);
        ChunkOutcome {
            content_events: narrow(self.content_events, earlier.content_events),
            estimated_tokens: narrow(self.estimated_tokens, earlier.estimated_tokens),
            usage_seen: self.usage_reports > earlier.usage_reports,
            done: self.done && !earlier.done,
        }
    }
}

/// One response's observer, shared by the readers of one stream. It parses the API kind of its
/// first reader; a reader of another kind keeps its own.
#[derive(Debug)]
pub struct SharedResponse {
    observer: StreamObserver,
    /// Bytes pushed so far.
    bytes: u64,
    totals: Totals,
    finished: bool,
}

/// A stream's place for a shared observer, made before anyone knows the API kind (a policy in
/// front announces it at the request), filled by the first reader.
pub type SharedSlot = Rc<RefCell<Option<SharedResponse>>>;

/// An empty [`SharedSlot`].
pub fn shared_slot() -> SharedSlot {
    Rc::new(RefCell::new(None))
}

/// One policy's reader of a [`SharedResponse`].
#[derive(Debug, Clone)]
pub struct Reader {
    shared: SharedSlot,
    bytes: u64,
    seen: Totals,
}

impl Reader {
    fn at_front(&self) -> bool {
        self.shared.try_borrow().is_ok_and(|s| s.as_ref().is_some_and(|s| s.bytes == self.bytes))
    }
}

/// Takes what the shared observer counted since a reader last looked (`bytes`, `seen`).
fn catch_up(shared: &SharedResponse, bytes: &mut u64, seen: &mut Totals) -> ChunkOutcome {
    let out = shared.totals.since(seen);
    *seen = shared.totals;
    *bytes = shared.bytes;
    out
}

/// A policy's view of its response stream: its own observer, or a reader of a shared one.
#[derive(Debug, Clone)]
pub enum Observer {
    Own(Box<StreamObserver>),
    Shared(Reader),
}

impl Observer {
    pub fn own(kind: ApiKind) -> Observer {
        Observer::Own(Box::new(StreamObserver::new(kind)))
    }

    /// A reader of the stream's shared observer for `kind`, from where it is now (a stream's readers
    /// join at its response headers); the first reader makes the observer. A reader of another kind
    /// than the observer's gets its own.
    pub fn join(shared: &SharedSlot, kind: ApiKind) -> Observer {
        let Ok(mut slot) = shared.try_borrow_mut() else { return Observer::own(kind) };
        let s = slot.get_or_insert_with(|| SharedResponse { observer: StreamObserver::new(kind), bytes: 0, totals: Totals::default(), finished: false });
        if s.observer.kind() != kind {
            return Observer::own(kind);
        }
        Observer::Shared(Reader { shared: Rc::clone(shared), bytes: s.bytes, seen: s.totals })
    }

    /// Whether [`Self::push`] reads the chunk it is given; when not, a caller that needs the bytes
    /// for nothing else need not fetch them (an empty slice will do).
    pub fn reads_chunk(&self) -> bool {
        match self {
            Observer::Own(_) => true,
            Observer::Shared(r) => r.at_front(),
        }
    }

    /// One response chunk: what it (or, for a reader behind, the chunks it stands for) carried.
    pub fn push(&mut self, chunk: &[u8]) -> ChunkOutcome {
        match self {
            Observer::Own(o) => o.push(chunk),
            Observer::Shared(Reader { shared, bytes, seen }) => {
                let Ok(mut slot) = shared.try_borrow_mut() else { return ChunkOutcome::default() };
                let Some(shared) = slot.as_mut() else { return ChunkOutcome::default() };
                if shared.bytes == *bytes {
                    let out = shared.observer.push(chunk);
                    shared.bytes = shared.bytes.saturating_add(chunk.len() as u64);
                    shared.totals.add(out);
                }
                catch_up(shared, bytes, seen)
            }
        }
    }

    /// The end of the stream (once for all readers: the first to end it dispatches a final event
    /// that lacked its blank line).
    pub fn finish(&mut self) -> ChunkOutcome {
        match self {
            Observer::Own(o) => o.finish(),
            Observer::Shared(Reader { shared, bytes, seen }) => {
                let Ok(mut slot) = shared.try_borrow_mut() else { return ChunkOutcome::default() };
                let Some(shared) = slot.as_mut() else { return ChunkOutcome::default() };
                if !shared.finished {
                    shared.finished = true;
                    let out = shared.observer.finish();
                    shared.totals.add(out);
                }
                catch_up(shared, bytes, seen)
            }
        }
    }

    /// Keep the data of the events each push finds to be valid JSON, for a policy that rewrites them
    /// ([`StreamObserver::keep_validated`]; a shared observer keeps it for every reader).
    pub fn keep_validated(&mut self) {
        match self {
            Observer::Own(o) => o.keep_validated(),
            Observer::Shared(r) => {
                if let Ok(mut slot) = r.shared.try_borrow_mut() {
                    if let Some(s) = slot.as_mut() {
                        s.observer.keep_validated();
                    }
                }
            }
        }
    }

    /// `f` with the event data the observer's last push found to be valid JSON (`None` if not
    /// kept or not at hand). For a reader behind, that push was the front reader's of the same
    /// chunk, or of the last of several merged ones: the texts hold either way, some may be missing.
    pub fn with_validated<R>(&self, f: impl FnOnce(Option<&ValidatedJson>) -> R) -> R {
        match self {
            Observer::Own(o) => f(o.validated()),
            Observer::Shared(r) => match r.shared.try_borrow() {
                Ok(slot) => f(slot.as_ref().and_then(|s| s.observer.validated())),
                Err(_) => f(None),
            },
        }
    }

    /// Summary of the response so far (a shared one's is every reader's).
    pub fn summary(&self) -> ResponseSummary {
        match self {
            Observer::Own(o) => o.summary(),
            Observer::Shared(r) => r.shared.try_borrow().ok().and_then(|s| s.as_ref().map(|s| s.observer.summary())).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str) -> String {
        format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]}}\n\n")
    }

    const USAGE_AND_DONE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\ndata: [DONE]\n\n";

    #[test]
    fn readers_in_pipeline_order_each_see_every_chunk_once() {
        let shared = shared_slot();
        let (mut front, mut behind) = (Observer::join(&shared, ApiKind::ChatCompletions), Observer::join(&shared, ApiKind::ChatCompletions));
        let mut own = Observer::own(ApiKind::ChatCompletions);
        for text in [chunk("a"), chunk("bb"), USAGE_AND_DONE.to_string()] {
            assert!(front.reads_chunk());
            let want = own.push(text.as_bytes());
            assert_eq!(front.push(text.as_bytes()), want);
            assert!(!behind.reads_chunk(), "the front pushed this chunk");
            // What the reader behind is handed does not matter: another policy may have edited it.
            assert_eq!(behind.push(b"edited"), want);
        }
        assert_eq!(front.finish(), own.finish());
        assert_eq!(behind.finish(), ChunkOutcome::default());
        assert_eq!(front.summary(), own.summary());
        assert_eq!(behind.summary(), own.summary());
        assert!(own.summary().usage_reported && own.summary().done);
    }

    #[test]
    fn a_reader_handed_merged_chunks_late_counts_them_all_then() {
        let shared = shared_slot();
        let (mut front, mut held) = (Observer::join(&shared, ApiKind::ChatCompletions), Observer::join(&shared, ApiKind::ChatCompletions));
        assert_eq!(front.push(chunk("a").as_bytes()).content_events, 1);
        assert_eq!(front.push(chunk("b").as_bytes()).content_events, 1);
        // A proxy that held the response hands the second reader both chunks as one.
        let merged = format!("{}{}", chunk("a"), chunk("b"));
        let late = held.push(merged.as_bytes());
        assert_eq!((late.content_events, late.estimated_tokens), (2, 2));
        assert_eq!(held.push(b"").content_events, 0);
    }

    #[test]
    fn a_front_that_stops_reading_leaves_the_next_reader_in_front() {
        let shared = shared_slot();
        let (mut first, mut second) = (Observer::join(&shared, ApiKind::ChatCompletions), Observer::join(&shared, ApiKind::ChatCompletions));
        first.push(chunk("a").as_bytes());
        second.push(chunk("a").as_bytes());
        drop(first);
        assert!(second.reads_chunk());
        assert_eq!(second.push(chunk("b").as_bytes()).content_events, 1);
        assert_eq!(second.summary().content_chunks, 2);
    }

    #[test]
    fn a_reader_of_another_kind_observes_on_its_own() {
        let shared = shared_slot();
        let mut chat = Observer::join(&shared, ApiKind::ChatCompletions);
        let mut anthropic = Observer::join(&shared, ApiKind::AnthropicMessages);
        assert!(matches!(anthropic, Observer::Own(_)));
        chat.push(chunk("a").as_bytes());
        assert!(anthropic.reads_chunk());
        assert_eq!(anthropic.push(chunk("a").as_bytes()).content_events, 0, "an OpenAI chunk carries no Anthropic content");
    }

    #[test]
    fn a_reader_joining_later_starts_where_the_stream_is() {
        let shared = shared_slot();
        let mut first = Observer::join(&shared, ApiKind::ChatCompletions);
        first.push(chunk("a").as_bytes());
        let mut late = Observer::join(&shared, ApiKind::ChatCompletions);
        assert!(late.reads_chunk());
        assert_eq!(first.push(chunk("b").as_bytes()).content_events, 1);
        assert_eq!(late.push(b"").content_events, 1, "only what came after it joined");
    }
}
