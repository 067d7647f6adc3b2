//! `sluice.wasm`: the one sluice filter. Its configuration has one section per policy
//! (`llm_metrics`, …; docs/configuration.md); everything else is `sluice-engine`.

proxy_wasm::main! {{
    sluice_engine::start_sections();
}}
