//! `backends/torch/schedc_torch.py`'s checks that need no torch (issue 11, item 31: the CSV
//! form is detected, a form the file is not in and a wrong M are refused with the fix), run
//! with plain python3. `backends/torch/run_e2e.sh` runs the same file and the end-to-end
//! test with torch 2.15.

use std::process::Command;

#[test]
fn schedc_torch_checks_without_torch() {
    let root = schedc_tests::conform::root();
    let script = root.join("backends/torch/test_schedc_torch.py");
    let out = match Command::new("python3")
        .arg(&script)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            // Written past libtest's capture, so that the skip shows where it is seen.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: python3 is not available ({e}); run_e2e.sh runs this file"
            );
            return;
        }
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("Ran 6 tests") && err.contains("OK"), "{err}");
}
