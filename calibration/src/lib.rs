//! Calibration of `sluice-core`'s prompt-token estimate against a real tokenizer.
//!
//! Everything lives in `tests/prompt_estimate.rs`: it tokenizes a generated corpus of chat requests
//! with DeepSeek's `tokenizer.json` and reports how far `prompt_tokens_estimate` (and strict mode's
//! body-bytes bound) are from the real counts. Figures: `docs/estimate-calibration.md`.
