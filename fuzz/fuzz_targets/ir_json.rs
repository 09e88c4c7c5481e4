//! IR JSON loader (`schedc::input::load_str` with a `.json` name), then every pass.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(loaded) = schedc::input::load_str("x.json", text.to_string(), &Default::default()) {
        common::check(&loaded.program, loaded.spans.as_ref());
    }
});
