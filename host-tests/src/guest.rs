//! Access to the plugin's linear memory from inside a hostcall: reading arguments, writing
//! out-parameters, and handing bytes back through the plugin's own allocator
//! (`proxy_on_memory_allocate`), which is how the ABI returns variable-sized data.
//!
//! A pointer outside linear memory traps: the SDK would panic on the `InvalidMemoryAccess` status
//! anyway, and a trap names the hostcall, which is what a failing test wants to see.

use std::borrow::Cow;

use wasmtime::error::Context as _;
use wasmtime::{bail, format_err, AsContextMut, Caller, Extern, Instance, Memory, Result, TypedFunc};

use crate::state::HostState;

/// A returned value's buffer is kept for the next one unless it grew past this (a huge body).
const KEEP_SCRATCH_BYTES: usize = 1 << 20;

/// The exports hostcalls use, looked up once when the VM starts: by name in every hostcall, the
/// lookup (and typing the allocator) cost more than most hostcalls' own work.
#[derive(Default)]
pub(crate) struct GuestExports {
    memory: Option<Memory>,
    /// Taken out while it runs (a hostcall made from inside it looks it up by name instead).
    allocate: Option<TypedFunc<u32, u32>>,
}

impl GuestExports {
    /// What `instance` exports; what is missing or of another type stays unset, and the hostcall
    /// that needs it fails as it always did, through the lookup by name.
    pub fn of(instance: &Instance, mut store: impl AsContextMut) -> Self {
        let memory = instance.get_memory(&mut store, "memory");
        let allocate = instance.get_typed_func::<u32, u32>(&mut store, "proxy_on_memory_allocate").ok();
        Self { memory, allocate }
    }
}

fn find_memory(caller: &mut Caller<'_, HostState>) -> Option<Memory> {
    if let Some(memory) = caller.data().guest.memory {
        return Some(memory);
    }
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Some(memory),
        _ => None,
    }
}

fn memory(caller: &mut Caller<'_, HostState>) -> Result<Memory> {
    find_memory(caller).ok_or_else(|| format_err!("the plugin exports no memory"))
}

/// The plugin's linear memory, borrowed for reading in place ([`view`]).
pub(crate) struct Guest<'a> {
    /// `None` when the plugin exports no memory: only a non-empty read fails for it.
    memory: Option<&'a [u8]>,
}

impl<'a> Guest<'a> {
    /// The `len` bytes at `ptr`. A null pointer with length 0 is an empty slice.
    pub fn bytes(&self, ptr: u32, len: u32) -> Result<&'a [u8]> {
        if len == 0 {
            return Ok(&[]);
        }
        let Some(memory) = self.memory else {
            bail!("the plugin exports no memory");
        };
        let start = ptr as usize;
        let end = start.checked_add(len as usize).ok_or_else(|| format_err!("pointer overflow"))?;
        memory.get(start..end).ok_or_else(|| format_err!("plugin passed bytes {start}..{end} outside its linear memory"))
    }

    /// The `len` bytes at `ptr` as UTF-8 (lossily: names from the plugin are only ever compared or
    /// shown); borrowed when they are valid.
    pub fn str(&self, ptr: u32, len: u32) -> Result<Cow<'a, str>> {
        let bytes = self.bytes(ptr, len)?;
        // `from_utf8` checks valid text (all of it, in practice) faster than the lossy decoder.
        Ok(std::str::from_utf8(bytes).map_or_else(|_| String::from_utf8_lossy(bytes), Cow::Borrowed))
    }
}

/// The plugin's memory and the host state at once: a hostcall reads its arguments in place
/// instead of copying each into a `Vec` first.
pub(crate) fn view<'a>(caller: &'a mut Caller<'_, HostState>) -> (Guest<'a>, &'a mut HostState) {
    match find_memory(caller) {
        Some(memory) => {
            let (data, state) = memory.data_and_store_mut(caller);
            (Guest { memory: Some(data) }, state)
        }
        None => (Guest { memory: None }, caller.data_mut()),
    }
}

/// Copies `len` bytes at `ptr` out of the plugin. A null pointer with length 0 is an empty slice.
pub(crate) fn read(caller: &mut Caller<'_, HostState>, ptr: u32, len: u32) -> Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    view(caller).0.bytes(ptr, len).map(<[u8]>::to_vec)
}

/// Reads `len` bytes at `ptr` as UTF-8 (lossily: names from the plugin are only ever compared or
/// shown).
pub(crate) fn read_string(caller: &mut Caller<'_, HostState>, ptr: u32, len: u32) -> Result<String> {
    if len == 0 {
        return Ok(String::new());
    }
    view(caller).0.str(ptr, len).map(Cow::into_owned)
}

fn write(caller: &mut Caller<'_, HostState>, ptr: u32, bytes: &[u8]) -> Result<()> {
    let memory = memory(caller)?;
    memory.write(&mut *caller, ptr as usize, bytes).with_context(|| format!("plugin passed out-pointer {ptr} outside its linear memory"))
}

/// Stores a `u32` out-parameter.
pub(crate) fn write_u32(caller: &mut Caller<'_, HostState>, ptr: u32, value: u32) -> Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Stores a `u64` out-parameter.
pub(crate) fn write_u64(caller: &mut Caller<'_, HostState>, ptr: u32, value: u64) -> Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Returns `bytes` to the plugin: allocates with `proxy_on_memory_allocate`, copies, and stores
/// the pointer and size at `ptr_out` and `size_out`. Empty data allocates nothing and returns a
/// null pointer, which the SDK reads as "no data".
pub(crate) fn return_bytes(caller: &mut Caller<'_, HostState>, bytes: &[u8], ptr_out: u32, size_out: u32) -> Result<()> {
    let size = u32::try_from(bytes.len()).context("value too large for wasm32")?;
    let ptr = if bytes.is_empty() {
        0
    } else {
        let ptr = allocate(caller, size)?;
        write(caller, ptr, bytes)?;
        ptr
    };
    write_u32(caller, ptr_out, ptr)?;
    write_u32(caller, size_out, size)
}

/// Returns to the plugin, as [`return_bytes`] does, what `fill` writes into a buffer from the
/// plugin's memory (its arguments, in place) and the host state. `fill` answers whether there is
/// a value; without one nothing is returned. The buffer is reused from one call to the next, so
/// a value the host holds is copied once, straight into it.
pub(crate) fn return_filled(
    caller: &mut Caller<'_, HostState>,
    ptr_out: u32,
    size_out: u32,
    fill: impl FnOnce(&Guest<'_>, &mut HostState, &mut Vec<u8>) -> Result<bool>,
) -> Result<bool> {
    // Taken, not borrowed: the allocator runs plugin code, which may make hostcalls of its own.
    let mut buffer = std::mem::take(&mut caller.data_mut().scratch);
    buffer.clear();
    let (guest, state) = view(caller);
    let result = match fill(&guest, state, &mut buffer) {
        Ok(true) => return_bytes(caller, &buffer, ptr_out, size_out).map(|()| true),
        other => other,
    };
    if buffer.capacity() <= KEEP_SCRATCH_BYTES {
        caller.data_mut().scratch = buffer;
    }
    result
}

fn allocate(caller: &mut Caller<'_, HostState>, size: u32) -> Result<u32> {
    let ptr = match caller.data_mut().guest.allocate.take() {
        Some(malloc) => {
            let ptr = malloc.call(&mut *caller, size);
            caller.data_mut().guest.allocate = Some(malloc);
            ptr?
        }
        None => {
            let malloc = match caller.get_export("proxy_on_memory_allocate") {
                Some(Extern::Func(f)) => f.typed::<u32, u32>(&*caller)?,
                _ => bail!("the plugin exports no proxy_on_memory_allocate"),
            };
            malloc.call(&mut *caller, size)?
        }
    };
    if ptr == 0 {
        bail!("proxy_on_memory_allocate({size}) returned null");
    }
    Ok(ptr)
}
