//! DeepSeek DualPipe / DualPipeV trace importer (`program` and `ops`), then every pass.
#![no_main]

use libfuzzer_sys::fuzz_target;
use schedc::import::dualpipe::{parse_trace, parse_trace_compute_only};

mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(p) = parse_trace(text) {
        common::check(&p, None);
    }
    if let Ok(p) = parse_trace_compute_only(text) {
        common::check(&p, None);
    }
});
