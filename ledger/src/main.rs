//! `sluice-ledger`: see docs/ledger.md ("Running sluice-ledger") and `sluice-ledger --help`.

use sluice_ledger::Config;

fn main() {
    let config = match Config::from_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(message) => {
            let help = std::env::args().any(|a| a == "--help" || a == "-h");
            eprintln!("{message}");
            std::process::exit(if help { 0 } else { 2 });
        }
    };
    let runtime = if config.threads == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(config.threads).enable_all().build()
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sluice-ledger: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    // Stateless: stopping at any point is safe (a script either ran whole in Redis or not at all),
    // so the process simply serves until it is killed.
    if let Err(message) = runtime.block_on(sluice_ledger::run(config, std::future::pending())) {
        eprintln!("sluice-ledger: {message}");
        std::process::exit(1);
    }
}
