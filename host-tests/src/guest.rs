//! Access to the plugin's linear memory from inside a hostcall: reading arguments, writing
//! out-parameters, and handing bytes back through the plugin's own allocator
//! (`proxy_on_memory_allocate`), which is how the ABI returns variable-sized data.
//!
//! A pointer outside linear memory traps: the SDK would panic on the `InvalidMemoryAccess` status
//! anyway, and a trap names the hostcall, which is what a failing test wants to see.

use wasmtime::error::Context as _;
use wasmtime::{bail, format_err, Caller, Extern, Memory, Result};

use crate::state::HostState;

fn memory(caller: &mut Caller<'_, HostState>) -> Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Ok(memory),
        _ => bail!("the plugin exports no memory"),
    }
}

/// Copies `len` bytes at `ptr` out of the plugin. A null pointer with length 0 is an empty slice.
pub(crate) fn read(caller: &mut Caller<'_, HostState>, ptr: u32, len: u32) -> Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let memory = memory(caller)?;
    let start = ptr as usize;
    let end = start.checked_add(len as usize).ok_or_else(|| format_err!("pointer overflow"))?;
    memory.data(&*caller).get(start..end).map(<[u8]>::to_vec).ok_or_else(|| format_err!("plugin passed bytes {start}..{end} outside its linear memory"))
}

/// Reads `len` bytes at `ptr` as UTF-8 (lossily: names from the plugin are only ever compared or
/// shown).
pub(crate) fn read_string(caller: &mut Caller<'_, HostState>, ptr: u32, len: u32) -> Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
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

fn allocate(caller: &mut Caller<'_, HostState>, size: u32) -> Result<u32> {
    let malloc = match caller.get_export("proxy_on_memory_allocate") {
        Some(Extern::Func(f)) => f.typed::<u32, u32>(&*caller)?,
        _ => bail!("the plugin exports no proxy_on_memory_allocate"),
    };
    let ptr = malloc.call(&mut *caller, size)?;
    if ptr == 0 {
        bail!("proxy_on_memory_allocate({size}) returned null");
    }
    Ok(ptr)
}
