//! The standard library of schedules (`specs/*.sched`), embedded in the binary, so that
//! `schedc compare` and `schedc plan` work from any directory; `--specs DIR` reads a
//! directory instead ([`from_dir`]).

/// The standard library: `(name, text)` for each `specs/NAME.sched`, sorted by name.
pub fn standard_library() -> &'static [(&'static str, &'static str)] {
    STANDARD_LIBRARY
}

const STANDARD_LIBRARY: &[(&str, &str)] = &[
    ("1f1b", include_str!("../../specs/1f1b.sched")),
    (
        "1f1b_offload",
        include_str!("../../specs/1f1b_offload.sched"),
    ),
    (
        "1f1b_recompute",
        include_str!("../../specs/1f1b_recompute.sched"),
    ),
    ("bpipe", include_str!("../../specs/bpipe.sched")),
    ("chimera", include_str!("../../specs/chimera.sched")),
    (
        "chimera_direct",
        include_str!("../../specs/chimera_direct.sched"),
    ),
    ("dualpipe", include_str!("../../specs/dualpipe.sched")),
    ("dualpipev", include_str!("../../specs/dualpipev.sched")),
    ("gpipe", include_str!("../../specs/gpipe.sched")),
    ("hanayo", include_str!("../../specs/hanayo.sched")),
    (
        "interleaved_1f1b",
        include_str!("../../specs/interleaved_1f1b.sched"),
    ),
    (
        "interleaved_1f1b_a2a",
        include_str!("../../specs/interleaved_1f1b_a2a.sched"),
    ),
    (
        "interleaved_zb",
        include_str!("../../specs/interleaved_zb.sched"),
    ),
    ("looped_bfs", include_str!("../../specs/looped_bfs.sched")),
    ("v_half", include_str!("../../specs/v_half.sched")),
    ("v_min", include_str!("../../specs/v_min.sched")),
    ("zb_h1", include_str!("../../specs/zb_h1.sched")),
    ("zb_h2", include_str!("../../specs/zb_h2.sched")),
    ("zb_offload", include_str!("../../specs/zb_offload.sched")),
    ("zbv", include_str!("../../specs/zbv.sched")),
];

/// A spec of the standard library by name.
pub fn get(name: &str) -> Option<&'static str> {
    STANDARD_LIBRARY
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
}

/// Every `NAME.sched` of `dir` as `(NAME, text)`, sorted by name.
///
/// Errors: the directory cannot be read (with its name), a spec in it cannot be read, or it
/// holds no `.sched` file.
pub fn from_dir(dir: &std::path::Path) -> Result<Vec<(String, String)>, String> {
    let shown = dir.display();
    let rd = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot read the spec directory `{shown}`: {e}"))?;
    let mut out = Vec::new();
    for e in rd {
        let p = e
            .map_err(|e| format!("cannot read the spec directory `{shown}`: {e}"))?
            .path();
        if p.extension().is_some_and(|x| x == "sched") {
            let name = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read_to_string(&p)
                .map_err(|e| format!("cannot read `{}`: {e}", p.display()))?;
            out.push((name, text));
        }
    }
    if out.is_empty() {
        return Err(format!("`{shown}` holds no .sched spec"));
    }
    out.sort();
    Ok(out)
}

/// The standard library as owned pairs (the shape of [`from_dir`]).
pub fn standard_library_owned() -> Vec<(String, String)> {
    STANDARD_LIBRARY
        .iter()
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_embedded_library_is_specs_dir() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
        let on_disk = super::from_dir(&dir).unwrap();
        let embedded = super::standard_library_owned();
        let names = |v: &[(String, String)]| v.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        assert_eq!(
            names(&embedded),
            names(&on_disk),
            "add the new spec to compiler/src/specs.rs"
        );
        assert_eq!(embedded, on_disk);
    }
}
