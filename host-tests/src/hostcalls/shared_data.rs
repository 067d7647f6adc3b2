//! Shared data: a key-value store shared by every context of the VM, with compare-and-swap.
//!
//! Every write gives the entry a new, never-zero CAS. A write that carries a CAS other than 0 is
//! refused with `CasMismatch` unless it equals the entry's current CAS. A write with a null value
//! (the SDK's `remove_shared_data`) deletes the entry.

use std::collections::BTreeMap;

use wasmtime::{Caller, Linker, Result};

use super::MODULE;
use crate::abi::{reply, HostcallResult, Status};
use crate::guest;
use crate::state::{lock, HostState};

/// The store.
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedData {
    entries: BTreeMap<String, (Vec<u8>, u32)>,
    last_cas: u32,
}

impl SharedData {
    /// The value and CAS of `key`.
    pub fn get(&self, key: &str) -> Option<(&[u8], u32)> {
        self.entries.get(key).map(|(v, cas)| (v.as_slice(), *cas))
    }

    /// Writes (or with `None` deletes) `key` if `cas` is 0 or current.
    pub fn set(&mut self, key: &str, value: Option<Vec<u8>>, cas: u32) -> Result<(), Status> {
        if let Some((_, current)) = self.entries.get(key) {
            if cas != 0 && cas != *current {
                return Err(Status::CasMismatch);
            }
        }
        match value {
            Some(value) => {
                self.last_cas = self.last_cas.checked_add(1).unwrap_or(1);
                self.entries.insert(key.to_owned(), (value, self.last_cas));
            }
            None => {
                self.entries.remove(key);
            }
        }
        Ok(())
    }

    /// Every key, in order.
    pub fn keys(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }
}

pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> Result<()> {
    linker.func_wrap(MODULE, "proxy_get_shared_data", proxy_get_shared_data)?;
    linker.func_wrap(MODULE, "proxy_set_shared_data", proxy_set_shared_data)?;
    Ok(())
}

fn proxy_get_shared_data(mut caller: Caller<'_, HostState>, key_ptr: u32, key_len: u32, value_out: u32, size_out: u32, cas_out: u32) -> HostcallResult {
    let mut cas = 0;
    let found = guest::return_filled(&mut caller, value_out, size_out, |guest, state, out| {
        let key = guest.str(key_ptr, key_len)?;
        let data = lock(&state.shared_data);
        let Some((value, current)) = data.get(&key) else {
            return Ok(false);
        };
        out.extend_from_slice(value);
        cas = current;
        Ok(true)
    })?;
    if !found {
        return reply(Status::NotFound);
    }
    guest::write_u32(&mut caller, cas_out, cas)?;
    reply(Status::Ok)
}

fn proxy_set_shared_data(mut caller: Caller<'_, HostState>, key_ptr: u32, key_len: u32, value_ptr: u32, value_len: u32, cas: u32) -> HostcallResult {
    let (guest, state) = guest::view(&mut caller);
    let key = guest.str(key_ptr, key_len)?;
    let value = if value_ptr == 0 && value_len == 0 { None } else { Some(guest.bytes(value_ptr, value_len)?.to_vec()) };
    let result = lock(&state.shared_data).set(&key, value, cas);
    match result {
        Ok(()) => reply(Status::Ok),
        Err(status) => reply(status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_cas_is_refused_and_fresh_cas_accepted() {
        let mut data = SharedData::default();
        data.set("k", Some(b"1".to_vec()), 0).unwrap();
        let (_, cas1) = data.get("k").unwrap();
        assert_ne!(cas1, 0);
        data.set("k", Some(b"2".to_vec()), cas1).unwrap();
        assert_eq!(data.set("k", Some(b"3".to_vec()), cas1), Err(Status::CasMismatch));
        assert_eq!(data.get("k").unwrap().0, b"2");
        data.set("k", None, 0).unwrap();
        assert!(data.get("k").is_none());
    }
}
