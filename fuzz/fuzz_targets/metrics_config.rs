//! llm-metrics' configuration decoding (`sluice_llm_metrics::config::Settings::parse`) and the price
//! table decoder it and tenant-budget share (`price::PriceTable::from_json`), on any bytes; a
//! decoded table prices a usage of input-chosen size (costs saturate, never overflow) for the
//! model names its entries match.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::price::{glob_match, PriceTable};
use sluice_core::usage::Usage;
use sluice_llm_metrics::config::Settings;

fn use_prices(table: &PriceTable, data: &[u8]) {
    let n = |i: usize| data.get(i).map_or(0, |&b| u64::from(b) << (b % 64));
    let usage = Usage { input_tokens: n(0), output_tokens: n(1), cached_input_tokens: n(2), cache_creation_input_tokens: n(3), reasoning_tokens: n(4) };
    for model in ["gpt-4o", "claude-3-5-sonnet", "", "*"] {
        let _ = table.cost_micro_usd(model, &usage);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(settings) = Settings::parse(data) {
        use_prices(&settings.prices, data);
        let _ = settings.wants_path("/v1/chat/completions");
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(table) = PriceTable::from_json(text) {
            use_prices(&table, data);
        }
        if let Some((pattern, name)) = text.split_once('\n') {
            let _ = glob_match(pattern, name);
        }
    }
});
