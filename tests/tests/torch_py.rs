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

/// Issue 25, item 3: the pip package `schedc_torch` (python/, built by maturin from
/// pyproject.toml) links to the runtime's files in backends/torch; a rename or a move there
/// must not leave a wheel without its runtime. (`backends/torch/pip_check.sh` builds and
/// installs the wheel and runs it; this is the part that needs no build.)
#[test]
fn pip_package_links_to_the_runtime_files() {
    let root = schedc_tests::conform::root();
    let pkg = root.join("python/schedc_torch");
    for (link, target) in [
        ("runtime.py", "schedc_torch_runtime.py"),
        ("program.py", "schedc_program.py"),
        ("autograd.py", "schedc_autograd.py"),
        ("torch_csv.py", "schedc_torch.py"),
    ] {
        let p = pkg.join(link);
        let meta = std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(
            meta.file_type().is_symlink(),
            "{} is not a link",
            p.display()
        );
        let got =
            std::fs::canonicalize(&p).unwrap_or_else(|e| panic!("{} dangles: {e}", p.display()));
        let want = std::fs::canonicalize(root.join("backends/torch").join(target)).unwrap();
        assert_eq!(got, want, "{link}");
    }
    let init = std::fs::read_to_string(pkg.join("__init__.py")).unwrap();
    for flat in ["schedc_program", "schedc_autograd", "schedc_torch_runtime"] {
        assert!(
            init.contains(&format!("_sys.modules.setdefault(\"{flat}\"")),
            "__init__.py does not register {flat}"
        );
    }
    let py = std::fs::read_to_string(root.join("pyproject.toml")).unwrap();
    for line in [
        "bindings = \"bin\"",
        "manifest-path = \"cli/Cargo.toml\"",
        "python-source = \"python\"",
        "module-name = \"schedc_torch\"",
    ] {
        assert!(
            py.lines().any(|l| l == line),
            "pyproject.toml lacks `{line}`"
        );
    }
    let cli = std::fs::read_to_string(root.join("cli/Cargo.toml")).unwrap();
    assert!(
        cli.contains("[[bin]]\nname = \"schedc\""),
        "cli/Cargo.toml builds no `schedc`"
    );
}
