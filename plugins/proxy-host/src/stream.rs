//! What a filter instance knows of its current stream while one of its callbacks runs: the body
//! chunk already read and the host time (so the sections of one filter ask once), and which shared response
//! observer ([`sluice_core::observation`]) the stream's readers in this VM use.
//!
//! The instance keeps a [`Slot`] per stream and lends it for each callback ([`enter`] … [`leave`]);
//! lending nests, so a callback the proxy runs inside another (a resumed stream) sees its own.

use proxy_wasm::types::BufferType;
use sluice_core::api::ApiKind;
use sluice_core::contract::OBSERVATION_PROPERTY;
use sluice_core::observation::{shared_slot, Observer, SharedSlot};
use std::cell::RefCell;
use std::collections::HashMap;

/// Where the stream's shared observer is, once asked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Shared {
    #[default]
    Unresolved,
    /// In this VM's registry under this key (the creating instance's context id).
    At(u32),
    /// Another VM's, or none can be made: this instance's readers observe alone.
    Alone,
}

/// One filter instance's per-stream state.
#[derive(Debug, Default)]
pub struct Slot {
    context_id: u32,
    shared: Shared,
    /// This instance made the stream's shared observer (and forgets it at the stream's end).
    created: bool,
    /// The filter runs several sections: they share the body chunk read and, with no filter in
    /// front having announced one, a response observer of their own.
    several: bool,
    /// The current callback's body chunk, as read.
    body: Option<(BufferType, usize, Vec<u8>)>,
    /// The host time read in the current callback: one event is one instant for every section.
    now_ns: Option<u64>,
}

impl Slot {
    /// The slot of a filter instance running `sections` sections on stream `context_id`.
    pub fn new(context_id: u32, sections: usize) -> Slot {
        Slot { context_id, shared: Shared::Unresolved, created: false, several: sections > 1, body: None, now_ns: None }
    }

    /// The stream ended: its shared observer takes no new readers (the ones holding it keep it).
    pub fn end(&mut self) {
        if std::mem::take(&mut self.created) {
            REGISTRY.with(|r| r.borrow_mut().remove(&self.context_id));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.end();
    }
}

thread_local! {
    static CURRENT: RefCell<Option<Slot>> = const { RefCell::new(None) };
    static REGISTRY: RefCell<HashMap<u32, SharedSlot>> = RefCell::new(HashMap::new());
    static VM_TOKEN: RefCell<Option<Option<String>>> = const { RefCell::new(None) };
}

/// Lends `slot` for a callback; returns what was lent before (an outer callback's), for [`leave`].
pub fn enter(slot: &mut Slot) -> Option<Slot> {
    let lent = std::mem::take(slot);
    CURRENT.with(|c| c.borrow_mut().replace(lent))
}

/// Takes the slot back after the callback (the body chunk read is forgotten) and restores `outer`.
pub fn leave(slot: &mut Slot, outer: Option<Slot>) {
    if let Some(mut lent) = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer)) {
        lent.body = None;
        lent.now_ns = None;
        *slot = lent;
    }
}

/// The chunk's bytes, read once per callback when a slot is lent.
pub(crate) fn body(buffer: BufferType, size: usize) -> Vec<u8> {
    let cached =
        CURRENT.with(|c| c.borrow().as_ref().and_then(|s| s.body.as_ref().filter(|(b, n, _)| *b == buffer && *n == size).map(|(_, _, bytes)| bytes.clone())));
    if let Some(bytes) = cached {
        return bytes;
    }
    let bytes = crate::body(buffer, size);
    CURRENT.with(|c| {
        if let Some(slot) = c.borrow_mut().as_mut().filter(|s| s.several) {
            slot.body = Some((buffer, size, bytes.clone()));
        }
    });
    bytes
}

/// The host time, read once per callback when a slot is lent.
pub(crate) fn now_ns(read: impl FnOnce() -> u64) -> u64 {
    if let Some(now) = CURRENT.with(|c| c.borrow().as_ref().and_then(|s| s.now_ns)) {
        return now;
    }
    let now = read();
    CURRENT.with(|c| {
        if let Some(slot) = c.borrow_mut().as_mut() {
            slot.now_ns = Some(now);
        }
    });
    now
}

/// A body was edited: what was read of it is stale.
pub(crate) fn body_changed() {
    CURRENT.with(|c| {
        if let Some(slot) = c.borrow_mut().as_mut() {
            slot.body = None;
        }
    });
}

/// This VM's name among the VMs that may share a stream's filter state: its `vm_id` and a number
/// no other VM with that id got. `None` when shared data cannot give one.
fn vm_token() -> Option<String> {
    VM_TOKEN.with(|t| {
        t.borrow_mut()
            .get_or_insert_with(|| {
                let n = sluice_core::store::counter_add(&mut crate::SharedData, "sluice/vm-sequence", 1).ok()?;
                let vm_id = crate::property(&["plugin_vm_id"]).unwrap_or_default();
                Some(format!("{vm_id}#{n}"))
            })
            .clone()
    })
}

/// Makes the stream's shared observer and says where it is (filter state [`OBSERVATION_PROPERTY`]),
/// for the filters behind this one in this VM: a filter in front of the readers (latency-guard)
/// calls this at the request, before any of them asks. Nothing outside a lent slot or when shared
/// data cannot name this VM.
pub fn announce() {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let Some(slot) = c.as_mut() else { return };
        if slot.shared != Shared::Unresolved {
            return;
        }
        let Some(token) = vm_token() else {
            slot.shared = Shared::Alone;
            return;
        };
        slot.shared = keep_new(slot);
        crate::set_property(OBSERVATION_PROPERTY, format!("{token} {}", slot.context_id).as_bytes());
    });
}

/// A reader of the stream's shared observer for `kind`: the one a filter in front announced, else
/// one for this filter's sections when it has several; its own observer outside a lent slot, for
/// another VM's stream, for a filter of one section alone on the stream, or for another API kind.
pub(crate) fn observer(kind: ApiKind) -> Observer {
    let resolved = CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        let slot = c.as_mut()?;
        if slot.shared == Shared::Unresolved {
            slot.shared = resolve(slot);
        }
        match slot.shared {
            Shared::At(key) => REGISTRY.with(|r| r.borrow().get(&key).cloned()),
            Shared::Unresolved | Shared::Alone => None,
        }
    });
    match resolved {
        Some(shared) => Observer::join(&shared, kind),
        None => Observer::own(kind),
    }
}

/// Finds the stream's shared observer through its filter state, or makes one for this filter's
/// sections (a filter of one section then observes alone).
fn resolve(slot: &mut Slot) -> Shared {
    if let Some(address) = crate::property(&[OBSERVATION_PROPERTY]) {
        let ours = |(their_token, key): (&str, &str)| {
            let key = key.parse::<u32>().ok()?;
            (vm_token()? == their_token && REGISTRY.with(|r| r.borrow().contains_key(&key))).then_some(key)
        };
        if let Some(key) = address.rsplit_once(' ').and_then(ours) {
            return Shared::At(key);
        }
        // Another VM's (or a stale) announcement: this filter's sections share among themselves.
    }
    if !slot.several {
        return Shared::Alone;
    }
    keep_new(slot)
}

/// A new, empty place for the stream's shared observer, kept under this instance's context id
/// until the stream ends ([`Slot::end`]).
fn keep_new(slot: &mut Slot) -> Shared {
    REGISTRY.with(|r| r.borrow_mut().insert(slot.context_id, shared_slot()));
    slot.created = true;
    Shared::At(slot.context_id)
}
