//! The book builds with the current mdbook and its internal links hold (issue 11, item 35).
//!
//! `.ci/run` builds the book with a pinned mdbook; these checks need no mdbook, so that a
//! broken link or a configuration key the current mdbook refuses fails `cargo test` too.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn book() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../book")
}

/// The keys mdbook 0.5 accepts in `[book]` (it refuses unknown ones, such as the
/// `multilingual` key of mdbook 0.4).
const BOOK_KEYS: &[&str] = &[
    "authors",
    "description",
    "language",
    "src",
    "text-direction",
    "title",
];

#[test]
fn book_toml_has_only_keys_mdbook_accepts() {
    let text = std::fs::read_to_string(book().join("book.toml")).unwrap();
    let v: toml::Table = toml::from_str(&text).unwrap();
    let b = v["book"].as_table().unwrap();
    for k in b.keys() {
        assert!(
            BOOK_KEYS.contains(&k.as_str()),
            "book.toml: mdbook 0.5 refuses `[book] {k}`"
        );
    }
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

/// Link targets `](target)` outside code fences and inline code, with their line numbers.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans.
        let mut plain = String::new();
        let mut code = false;
        for c in line.chars() {
            if c == '`' {
                code = !code;
            } else if !code {
                plain.push(c);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((i + 1, target.to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// mdbook's heading ids: lower case, spaces to `-`, other punctuation but `-` and `_` dropped.
fn heading_ids(text: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let title = line.trim_start_matches('#').trim();
        let id: String = title
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap_or(c))
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        ids.insert(id);
    }
    ids
}

#[test]
fn internal_links_resolve() {
    let src = book().join("src");
    let mut files = Vec::new();
    markdown_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 10, "{} pages", files.len());
    let mut broken = Vec::new();
    let mut checked = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (line, t) in links(&text) {
            if t.is_empty() || t.contains("://") || t.starts_with("mailto:") || t.starts_with('<') {
                continue;
            }
            let (path, anchor) = match t.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (t.as_str(), None),
            };
            let target = if path.is_empty() {
                f.clone()
            } else {
                f.parent().unwrap().join(path)
            };
            checked += 1;
            let shown = format!("{}:{line}: `{t}`", f.strip_prefix(&src).unwrap().display());
            if !target.exists() {
                broken.push(format!("{shown}: no such file"));
                continue;
            }
            if let Some(a) = anchor {
                if target.extension().is_some_and(|x| x == "md") {
                    let ids = heading_ids(&std::fs::read_to_string(&target).unwrap());
                    if !ids.contains(a) {
                        broken.push(format!("{shown}: no heading with id `{a}`"));
                    }
                }
            }
        }
    }
    assert!(checked > 0);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_page_is_in_the_summary() {
    let src = book().join("src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<String> = links(&summary).into_iter().map(|(_, t)| t).collect();
    for e in std::fs::read_dir(&src).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(listed.contains(&name), "{name} is not in SUMMARY.md");
        }
    }
}
