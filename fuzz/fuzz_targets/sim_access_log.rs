//! The simulator's access-log reader (sim/src/observed.rs `read_access_log`: a real gateway's JSON
//! access log with the plugins' stamps, into verdicts) on any bytes, read through a `BufRead` of
//! fuzzer-chosen capacity: never a panic, the iterator ends, and how the input is cut into reads
//! changes nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core_fuzz::observed::read_access_log;
use std::io::BufReader;

fn read(body: &[u8], capacity: usize) -> Vec<String> {
    let mut it = read_access_log(BufReader::with_capacity(capacity, body));
    let mut items = Vec::new();
    for _ in 0..=body.len() + 1 {
        match it.next() {
            None => return items,
            Some(Ok(v)) => items.push(format!("{v:?}")),
            Some(Err(e)) => items.push(format!("error {e}")),
        }
    }
    panic!("the reader yielded more items than the input has lines");
}

fuzz_target!(|data: &[u8]| {
    let Some((&cap, body)) = data.split_first() else { return };
    assert_eq!(read(body, 1 + usize::from(cap & 15)), read(body, 8192), "the result depends on how the input is read");
});
