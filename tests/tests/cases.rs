//! Every `.case` file of `shared/cases` (schedules distilled from public bug reports) and of
//! `tests/cases` gives the verdict, error code and figures its `expect` lines state.

use schedc::casefile::run_case;
use std::path::Path;

fn run_dir(dir: &Path) -> usize {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "case"))
        .collect();
    files.sort();
    let mut failures = Vec::new();
    for f in &files {
        let r = run_case(f.to_str().unwrap());
        if !r.passed {
            failures.push(format!("{}:\n  {}", r.path, r.differences.join("\n  ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    files.len()
}

#[test]
fn shared_cases() {
    let Some(d) = schedc_tests::shared_dir() else {
        return;
    };
    assert_eq!(run_dir(&d.join("cases")), 30);
}

#[test]
fn own_cases() {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("cases");
    assert!(run_dir(&d) >= 12);
}
