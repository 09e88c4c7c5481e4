//! PyTorch pipelining CSV importer, every pass, and the CSV writer in both forms.
#![no_main]

use libfuzzer_sys::fuzz_target;
use schedc::import::torch::{parse_csv, write_csv, TorchFormat};

mod common;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = parse_csv(text, &Default::default()) {
        common::check(&t.program, Some(&t.spans));
        // Errors are fine (what torch cannot express); panics are not.
        let _ = std::hint::black_box(write_csv(&t.program, TorchFormat::ComputeOnly));
        let _ = std::hint::black_box(write_csv(&t.program, TorchFormat::ComputeComms));
    }
});
