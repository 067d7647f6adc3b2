//! Which `env` imports of a plugin this host does not implement. Every name the proxy-wasm SDK
//! can import must be provided; anything else is linked as a stub that traps when called, so a
//! plugin still loads — this check is what catches a missing hostcall before a test stumbles on it.

use wasmtime::{Extern, ExternType, FuncType, Store};

use crate::gateway::{host_state, linker, Plugin, PluginSpec};
use crate::hostcalls::MODULE;

/// The `env` imports of `wasm` that this host does not define with a matching signature, as
/// `"name: reason"`. A module that does not compile yields one entry saying so.
pub fn unimplemented_imports(wasm: &[u8]) -> Vec<String> {
    match check(wasm) {
        Ok(missing) => missing,
        Err(error) => vec![format!("<module>: {error:#}")],
    }
}

fn check(wasm: &[u8]) -> anyhow::Result<Vec<String>> {
    let plugin = Plugin::from_bytes(wasm)?;
    let module = plugin.module();
    let linker = linker(module.engine())?;
    let mut store = Store::new(module.engine(), host_state(PluginSpec::new(""), None));
    let mut missing = Vec::new();
    for import in module.imports().filter(|i| i.module() == MODULE) {
        let name = import.name();
        let ExternType::Func(wanted) = import.ty() else {
            missing.push(format!("{name}: imported as something other than a function"));
            continue;
        };
        match linker.get_by_import(&mut store, &import) {
            Some(Extern::Func(func)) => {
                let have = func.ty(&store);
                if signature(&have) != signature(&wanted) {
                    missing.push(format!("{name}: plugin wants {}, host defines {}", signature(&wanted), signature(&have)));
                }
            }
            Some(_) => missing.push(format!("{name}: defined, but not as a function")),
            None => missing.push(format!("{name}: not defined")),
        }
    }
    Ok(missing)
}

fn signature(ty: &FuncType) -> String {
    let params: Vec<String> = ty.params().map(|t| t.to_string()).collect();
    let results: Vec<String> = ty.results().map(|t| t.to_string()).collect();
    format!("({}) -> ({})", params.join(", "), results.join(", "))
}
