//! Shared queues: a context registers a named queue and is told (`proxy_on_queue_ready`) after
//! anyone enqueues to it; consumers dequeue one item at a time.

use std::collections::{BTreeMap, VecDeque};

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, Status};
use crate::guest;
use crate::state::{lock, Deferred, HostState};

#[derive(Clone, Debug)]
struct Queue {
    name: String,
    /// The VM that registered it (its `vm_id`) and its index in the process.
    vm_id: String,
    vm: u32,
    /// The context told when an item arrives.
    owner: u32,
    items: VecDeque<Vec<u8>>,
}

/// Every queue of the VM.
#[derive(Clone, Debug, Default)]
pub(crate) struct Queues {
    queues: BTreeMap<u32, Queue>,
}

impl Queues {
    /// Registers `name` for `owner` of VM `vm` (`vm_id`); registering an existing name of the
    /// same VM id returns its id and moves it.
    pub fn register(&mut self, vm_id: &str, vm: u32, name: &str, owner: u32) -> u32 {
        if let Some(id) = self.resolve(vm_id, name) {
            if let Some(queue) = self.queues.get_mut(&id) {
                queue.owner = owner;
                queue.vm = vm;
            }
            return id;
        }
        let id = u32::try_from(self.queues.len()).unwrap_or(u32::MAX - 1) + 1;
        self.queues.insert(id, Queue { name: name.to_owned(), vm_id: vm_id.to_owned(), vm, owner, items: VecDeque::new() });
        id
    }

    /// The queue `name` registered under `vm_id`.
    pub fn resolve(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.queues.iter().find(|(_, q)| q.name == name && q.vm_id == vm_id).map(|(id, _)| *id)
    }

    /// The queue `name`, whichever VM registered it.
    pub fn find(&self, name: &str) -> Option<u32> {
        self.queues.iter().find(|(_, q)| q.name == name).map(|(id, _)| *id)
    }

    /// Appends `item`; returns the VM and context to notify.
    pub fn enqueue(&mut self, id: u32, item: Vec<u8>) -> Result<(u32, u32), Status> {
        let queue = self.queues.get_mut(&id).ok_or(Status::NotFound)?;
        queue.items.push_back(item);
        Ok((queue.vm, queue.owner))
    }

    pub fn dequeue(&mut self, id: u32) -> Result<Vec<u8>, Status> {
        let queue = self.queues.get_mut(&id).ok_or(Status::NotFound)?;
        queue.items.pop_front().ok_or(Status::Empty)
    }

    /// The items waiting in `name`.
    pub fn items(&self, name: &str) -> Option<Vec<Vec<u8>>> {
        let id = self.find(name)?;
        self.queues.get(&id).map(|q| q.items.iter().cloned().collect())
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_register_shared_queue", proxy_register_shared_queue)?;
    linker.func_wrap(MODULE, "proxy_resolve_shared_queue", proxy_resolve_shared_queue)?;
    linker.func_wrap(MODULE, "proxy_enqueue_shared_queue", proxy_enqueue_shared_queue)?;
    linker.func_wrap(MODULE, "proxy_dequeue_shared_queue", proxy_dequeue_shared_queue)?;
    Ok(())
}

fn proxy_register_shared_queue(mut caller: Caller<'_, HostState>, name_ptr: u32, name_len: u32, id_out: u32) -> HostcallResult {
    let name = guest::read_string(&mut caller, name_ptr, name_len)?;
    let state = caller.data_mut();
    let owner = state.effective_context;
    let id = lock(&state.queues).register(&state.plugin.vm_id, state.vm, &name, owner);
    guest::write_u32(&mut caller, id_out, id)?;
    reply(Status::Ok)
}

fn proxy_resolve_shared_queue(mut caller: Caller<'_, HostState>, vm_id_ptr: u32, vm_id_len: u32, name_ptr: u32, name_len: u32, id_out: u32) -> HostcallResult {
    let vm_id = guest::read_string(&mut caller, vm_id_ptr, vm_id_len)?;
    let name = guest::read_string(&mut caller, name_ptr, name_len)?;
    let state = caller.data();
    // No VM id means the caller's own.
    let vm_id = if vm_id.is_empty() { state.plugin.vm_id.clone() } else { vm_id };
    let found = lock(&state.queues).resolve(&vm_id, &name);
    let Some(id) = found else {
        return reply(Status::NotFound);
    };
    guest::write_u32(&mut caller, id_out, id)?;
    reply(Status::Ok)
}

fn proxy_enqueue_shared_queue(mut caller: Caller<'_, HostState>, id: u32, ptr: u32, len: u32) -> HostcallResult {
    let item = guest::read(&mut caller, ptr, len)?;
    let state = caller.data_mut();
    let result = lock(&state.queues).enqueue(id, item);
    match result {
        Ok((vm, owner)) => {
            lock(&state.deferred).push_back(Deferred::QueueReady { vm, context_id: owner, queue_id: id });
            reply(Status::Ok)
        }
        Err(status) => reply(status),
    }
}

fn proxy_dequeue_shared_queue(mut caller: Caller<'_, HostState>, id: u32, data_out: u32, size_out: u32) -> HostcallResult {
    let result = lock(&caller.data().queues).dequeue(id);
    match result {
        Ok(item) => {
            guest::return_bytes(&mut caller, &item, data_out, size_out)?;
            reply(Status::Ok)
        }
        Err(status) => reply(status),
    }
}
