//! IR text (and `.case`) parser, then every pass.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(parsed) = schedc_ir::text::parse(text) {
        common::check(&parsed.program, Some(&parsed.spans));
    }
});
