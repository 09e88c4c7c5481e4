//! Issue 24, item 5: NCCL mode placed by a cluster launcher's environment (torchrun's,
//! SLURM's) as well as by flags; what cannot hold is refused before the GPU is opened.

use std::process::Command;

fn run(env: &[(&str, &str)], extra: &[&str]) -> (Option<i32>, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_schedc"));
    c.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
    ] {
        c.env_remove(k);
    }
    let out = c
        .args(["run", "specs/1f1b.sched", "--pp", "2", "--mb", "4"])
        .args(["--backend", "cuda", "--mode", "nccl"])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_launchers_world_size_other_than_the_meshs_is_refused() {
    let (code, e) = run(
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1234"),
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{e}");
    assert!(
        e.contains("error: torchrun started 8 processes (WORLD_SIZE=8), but the schedule on its mesh has 2 ranks: start one process per rank"),
        "{e}"
    );
    let (code, e) = run(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3")], &[]);
    assert_eq!(code, Some(2), "{e}");
    assert!(
        e.contains("error: SLURM started 3 processes (SLURM_NTASKS=3)"),
        "{e}"
    );
}

#[test]
fn a_slurm_rank_without_a_rendezvous_is_refused_and_flags_override_the_environment() {
    let (code, e) = run(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")], &[]);
    assert_eq!(code, Some(2), "{e}");
    assert!(
        e.contains("SLURM gives this process SLURM_PROCID=1, but no rendezvous"),
        "{e}"
    );
    // --rank overrides RANK: the note, then (no GPU here) the environment's error, exit 2.
    let (code, e) = run(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ],
        &["--rank", "1"],
    );
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("note: --rank 1 overrides RANK=0"), "{e}");
}
