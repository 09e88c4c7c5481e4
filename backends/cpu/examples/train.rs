//! Trains the default model under a spec with the CPU executor, with a progress bar:
//! `cargo run --release -p schedc-cpu --example train -- SPEC PP MB STEPS [DATA] [MESH] [--verify]`
//! (e.g. `specs/dualpipe.sched 4 8 200 ../shared/data/tinyshakespeare.txt`). Prints the
//! report as JSON. This is the run `schedc run ... --backend cpu` performs.

use schedc::input::{load_spec, Overrides};
use schedc_cpu::{run, RunConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        eprintln!("usage: train SPEC PP MB STEPS [DATA] [MESH] [--verify]");
        std::process::exit(2);
    }
    let verify = args.iter().any(|a| a == "--verify");
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let num = |i: usize| -> u32 {
        pos[i].parse().unwrap_or_else(|_| {
            eprintln!("`{}` is not a number", pos[i]);
            std::process::exit(2)
        })
    };
    let text = std::fs::read_to_string(pos[0]).unwrap_or_else(|e| {
        eprintln!("cannot read {}: {e}", pos[0]);
        std::process::exit(2)
    });
    let ov = Overrides {
        pp: Some(num(1)),
        microbatches: Some(num(2)),
        ..Default::default()
    };
    let program = match load_spec(&text, &ov) {
        Ok(e) => e.program,
        Err(_) => {
            eprintln!("the spec refuses this instance");
            std::process::exit(1)
        }
    };
    let cfg = RunConfig {
        steps: num(3) as usize,
        data: pos.get(4).map(|p| p.into()),
        mesh: pos.get(5).map(|m| {
            m.parse().unwrap_or_else(|e| {
                eprintln!("{e}");
                std::process::exit(2)
            })
        }),
        verify,
        progress: true,
        ..RunConfig::default()
    };
    match run(&program, &cfg) {
        Ok(r) => {
            eprint!("{}", r.to_human());
            println!("{}", r.to_json());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}
