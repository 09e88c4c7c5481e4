//! The schedule language: parse, then the `fmt` round trip (formatting a parsed file must
//! parse back to the same syntax tree and be idempotent), then elaboration of a few small
//! instances, then every pass on what elaborates.
#![no_main]

use libfuzzer_sys::fuzz_target;
use schedc::dsl::{elaborate, fmt::format_file, parse_file, Instance};

mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = parse_file(text) else {
        return;
    };
    let formatted = format_file(&file, text);
    let back = parse_file(&formatted).expect("formatted text parses");
    assert_eq!(back, file, "fmt changed the syntax tree:\n{formatted}");
    assert_eq!(format_file(&back, &formatted), formatted, "fmt is not idempotent");
    // Keep each instance cheap: a runaway loop is an error after this many steps.
    schedc::dsl::elab::set_step_budget(20_000);
    for (pp, mb, vpp) in [(1, 1, None), (2, 4, None), (4, 8, Some(2))] {
        if let Ok(e) = elaborate(&file, &Instance { pp, mb, vpp, params: Vec::new() }) {
            common::check(&e.program, Some(&e.spans));
        }
    }
});
