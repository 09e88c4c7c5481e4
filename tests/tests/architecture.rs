//! The crate graph is the one `book/src/architecture.md` states: every crate depends (normal,
//! dev or build dependency) on exactly the schedc crates its row of the table allows, and
//! every workspace member has a row.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The table between the `architecture-table` markers: crate -> (path, allowed schedc deps).
fn book_table() -> BTreeMap<String, (String, BTreeSet<String>)> {
    let text = read(&root().join("book/src/architecture.md"));
    let body = text
        .split("<!-- architecture-table: begin -->")
        .nth(1)
        .and_then(|t| t.split("<!-- architecture-table: end -->").next())
        .expect("the architecture table markers");
    let mut out = BTreeMap::new();
    for line in body.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "", crate, path, holds, may depend on, ""
        let unquote = |s: &str| s.trim_matches('`').to_string();
        let deps = if cells[4] == "(none)" {
            BTreeSet::new()
        } else {
            cells[4].split(',').map(|d| unquote(d.trim())).collect()
        };
        out.insert(
            unquote(cells[1]),
            (unquote(cells[2]).trim_end_matches('/').to_string(), deps),
        );
    }
    out
}

/// Every workspace member: path -> (package name, schedc crates it depends on).
fn manifests() -> BTreeMap<String, (String, BTreeSet<String>)> {
    let ws: toml::Table = toml::from_str(&read(&root().join("Cargo.toml"))).unwrap();
    let members = ws["workspace"]["members"].as_array().unwrap();
    let mut out = BTreeMap::new();
    for m in members {
        let path = m.as_str().unwrap().to_string();
        let t: toml::Table = toml::from_str(&read(&root().join(&path).join("Cargo.toml"))).unwrap();
        let name = t["package"]["name"].as_str().unwrap().to_string();
        let mut deps = BTreeSet::new();
        for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
            if let Some(d) = t.get(section).and_then(|d| d.as_table()) {
                deps.extend(d.keys().filter(|k| k.starts_with("schedc")).cloned());
            }
        }
        out.insert(path, (name, deps));
    }
    out
}

#[test]
fn the_crate_graph_is_the_books() {
    let book = book_table();
    let found = manifests();
    assert_eq!(
        found.len(),
        book.len(),
        "workspace members {:?} vs the book's rows {:?}",
        found.keys().collect::<Vec<_>>(),
        book.keys().collect::<Vec<_>>()
    );
    for (path, (name, deps)) in &found {
        let (book_path, allowed) = book
            .get(name)
            .unwrap_or_else(|| panic!("crate {name} ({path}) has no row in architecture.md"));
        assert_eq!(book_path, path, "{name}'s path");
        assert_eq!(
            deps, allowed,
            "{name} depends on {deps:?}; architecture.md allows exactly {allowed:?}"
        );
    }
}

#[test]
fn layering_holds() {
    let found: BTreeMap<String, BTreeSet<String>> = manifests().into_values().collect();
    // The compiler knows no backend and no CLI; no backend knows the CLI.
    assert!(found["schedc"].iter().all(|d| d == "schedc-ir"));
    for (name, deps) in &found {
        if name != "schedc-cli" {
            assert!(!deps.contains("schedc-cli"), "{name} depends on the CLI");
        }
    }
    assert!(!found["schedc-program"].contains("schedc-cpu"));
}

#[test]
fn no_code_looks_for_a_sibling_executable() {
    // `schedc run` used to execute a `schedc-cpu` binary found next to its own executable
    // (`current_exe().parent().join(...)`). A backend may start processes of its own (one
    // per GPU), but none looks up another binary beside `schedc`.
    let mut hits = Vec::new();
    for dir in ["cli/src", "compiler/src", "ir/src", "backends"] {
        visit(&root().join(dir), &mut |p| {
            if p.extension().is_some_and(|e| e == "rs") {
                let t = read(p);
                let sibling = t.match_indices("current_exe").any(|(i, _)| {
                    let after = &t[i..(i + 300).min(t.len())];
                    after.contains("parent") || after.contains("EXE_SUFFIX")
                });
                if sibling || t.contains("EXE_SUFFIX") {
                    hits.push(p.display().to_string());
                }
            }
        });
    }
    assert!(hits.is_empty(), "{hits:?}");
}

fn visit(d: &Path, f: &mut dyn FnMut(&Path)) {
    let Ok(rd) = std::fs::read_dir(d) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            if !p.ends_with("target") {
                visit(&p, f);
            }
        } else {
            f(&p);
        }
    }
}
