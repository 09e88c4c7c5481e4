//! The NCCL unique-id rendezvous of NCCL mode: rank 0 makes one id per communicator and
//! hands them to every other rank, over loopback or cluster TCP (`tcp://HOST:PORT`: rank 0
//! listens, the others connect) or through a shared file (`file:PATH`: rank 0 writes it
//! atomically, the others poll for it). Multi-node is the same code given an address every
//! node can reach.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Where the ranks meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 listens on this address; the others connect to it.
    Tcp(String),
    /// Rank 0 writes this file; the others read it.
    File(PathBuf),
}

impl std::str::FromStr for Rendezvous {
    type Err = String;
    /// `tcp://HOST:PORT` or `file:PATH`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(a) = s.strip_prefix("tcp://") {
            if a.rsplit_once(':')
                .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                return Err(format!("rendezvous `{s}`: expected tcp://HOST:PORT"));
            }
            Ok(Rendezvous::Tcp(a.to_string()))
        } else if let Some(p) = s.strip_prefix("file:") {
            if p.is_empty() {
                return Err("rendezvous `file:`: the path is empty".into());
            }
            Ok(Rendezvous::File(PathBuf::from(p)))
        } else {
            Err(format!(
                "rendezvous `{s}`: expected tcp://HOST:PORT or file:PATH"
            ))
        }
    }
}

const MAGIC: &[u8; 8] = b"schedc01";

fn encode(ids: &[[u8; 128]]) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend((ids.len() as u32).to_le_bytes());
    for id in ids {
        v.extend_from_slice(id);
    }
    v
}

fn decode(b: &[u8]) -> Result<Vec<[u8; 128]>, String> {
    if b.len() < 12 || &b[..8] != MAGIC {
        return Err("the rendezvous data is not schedc's".into());
    }
    let n = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
    if b.len() != 12 + 128 * n {
        return Err(format!(
            "the rendezvous data has {} bytes for {n} ids",
            b.len()
        ));
    }
    Ok(b[12..]
        .chunks_exact(128)
        .map(|c| {
            let mut id = [0u8; 128];
            id.copy_from_slice(c);
            id
        })
        .collect())
}

/// Shares `ids` from rank 0 with the other `world - 1` ranks: rank 0 passes `Some(ids)`
/// and gets them back once every rank has them (TCP) or once they are written (file);
/// the others pass `None` and get them. Errors, with the rank and the address: the
/// timeout, a refused connection, malformed data.
pub fn exchange(
    how: &Rendezvous,
    rank: u32,
    world: u32,
    ids: Option<Vec<[u8; 128]>>,
    timeout: Duration,
) -> Result<Vec<[u8; 128]>, String> {
    let start = Instant::now();
    let left = || timeout.saturating_sub(start.elapsed());
    match (how, ids) {
        (Rendezvous::Tcp(addr), Some(ids)) => {
            let l = TcpListener::bind(addr)
                .map_err(|e| format!("rank 0 cannot listen on {addr}: {e}"))?;
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            let data = encode(&ids);
            let mut served = 1;
            while served < world {
                match l.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).map_err(|e| e.to_string())?;
                        s.set_write_timeout(Some(left().max(Duration::from_millis(10))))
                            .map_err(|e| e.to_string())?;
                        s.write_all(&data)
                            .map_err(|e| format!("rank 0 sending the ids: {e}"))?;
                        served += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if left().is_zero() {
                            return Err(format!(
                                "rank 0 waited {:.0} s on {addr} for {} of {} ranks",
                                timeout.as_secs_f64(),
                                world - served,
                                world - 1
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(format!("rank 0 accepting on {addr}: {e}")),
                }
            }
            Ok(ids)
        }
        (Rendezvous::Tcp(addr), None) => {
            let target = addr
                .to_socket_addrs()
                .map_err(|e| format!("rank {rank}: rendezvous address {addr}: {e}"))?
                .next()
                .ok_or(format!(
                    "rank {rank}: rendezvous address {addr} resolves to nothing"
                ))?;
            loop {
                match TcpStream::connect_timeout(&target, Duration::from_millis(200)) {
                    Ok(mut s) => {
                        s.set_read_timeout(Some(left().max(Duration::from_millis(10))))
                            .map_err(|e| e.to_string())?;
                        let mut b = Vec::new();
                        s.read_to_end(&mut b)
                            .map_err(|e| format!("rank {rank} reading the ids from {addr}: {e}"))?;
                        return decode(&b);
                    }
                    Err(e) => {
                        if left().is_zero() {
                            return Err(format!(
                                "rank {rank} could not reach rank 0 at {addr} within {:.0} s: {e}",
                                timeout.as_secs_f64()
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        (Rendezvous::File(path), Some(ids)) => {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, encode(&ids))
                .map_err(|e| format!("rank 0 writing {}: {e}", tmp.display()))?;
            std::fs::rename(&tmp, path)
                .map_err(|e| format!("rank 0 writing {}: {e}", path.display()))?;
            Ok(ids)
        }
        (Rendezvous::File(path), None) => loop {
            if let Ok(b) = std::fs::read(path) {
                return decode(&b);
            }
            if left().is_zero() {
                return Err(format!(
                    "rank {rank} waited {:.0} s for rank 0 to write {}",
                    timeout.as_secs_f64(),
                    path.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> Vec<[u8; 128]> {
        (0..3u8).map(|i| [i + 7; 128]).collect()
    }

    fn share(how: Rendezvous, world: u32) -> Vec<Vec<[u8; 128]>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let how = how.clone();
                    s.spawn(move || {
                        exchange(&how, r, world, (r == 0).then(ids), Duration::from_secs(20))
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_gets_rank_0s_ids_over_loopback_tcp() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let got = share(Rendezvous::Tcp(format!("127.0.0.1:{port}")), 4);
        assert!(got.iter().all(|g| *g == ids()));
    }

    #[test]
    fn every_rank_gets_rank_0s_ids_through_a_file() {
        let dir = std::env::temp_dir().join(format!("schedc-rdv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let got = share(Rendezvous::File(dir.join("ids")), 3);
        assert!(got.iter().all(|g| *g == ids()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_rank_0_is_a_timeout_with_the_address() {
        let e = exchange(
            &Rendezvous::File(std::env::temp_dir().join("schedc-no-such-rendezvous")),
            2,
            3,
            None,
            Duration::from_millis(50),
        )
        .unwrap_err();
        assert!(
            e.starts_with("rank 2 waited 0 s for rank 0 to write"),
            "{e}"
        );
        assert_eq!(
            "udp://x".parse::<Rendezvous>().unwrap_err(),
            "rendezvous `udp://x`: expected tcp://HOST:PORT or file:PATH"
        );
        assert!("tcp://host".parse::<Rendezvous>().is_err());
        assert_eq!(
            "tcp://10.0.0.1:29500".parse::<Rendezvous>().unwrap(),
            Rendezvous::Tcp("10.0.0.1:29500".into())
        );
    }
}

/// Where this process runs in NCCL mode: its global rank, its GPU and where the ranks meet,
/// from the command line's flags and a cluster launcher's environment ([`placement`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Global rank.
    pub rank: u32,
    /// The GPU of this process (an ordinal on its node).
    pub device: usize,
    /// Where the ranks meet.
    pub rendezvous: Rendezvous,
    /// Notes for the user: a flag that overrode the environment.
    pub notes: Vec<String>,
}

/// The flags that place a process ([`placement`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementFlags {
    /// `--rank`.
    pub rank: Option<u32>,
    /// `--rendezvous`.
    pub rendezvous: Option<String>,
    /// `--device`.
    pub device: Option<usize>,
}

/// Places this process of a `world`-rank run from `flags` and the environment `env`
/// (a lookup, e.g. of `std::env::var`):
///
/// * torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`: rank
///   `RANK`, GPU `LOCAL_RANK`, rendezvous `tcp://MASTER_ADDR:(MASTER_PORT + 1)` (the port
///   itself is torchrun's own store's);
/// * else SLURM's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`: rank, world, GPU; the
///   rendezvous from `MASTER_ADDR`/`MASTER_PORT` as above if set (a batch script exports
///   them), else `--rendezvous` (e.g. `file:` on a shared file system);
/// * each flag overrides what the environment says (with a note when they differ).
///
/// `Ok(None)`: neither a `--rank` nor a launcher's rank (the local launcher starts the
/// ranks). Errors, naming the variable or flag: a value that is not a number, a launcher's
/// world size other than the mesh's `world`, a rank outside the world, a rank without a
/// rendezvous, a bad `--rendezvous`.
pub fn placement(
    flags: &PlacementFlags,
    env: &dyn Fn(&str) -> Option<String>,
    world: u32,
) -> Result<Option<Placement>, String> {
    let num = |k: &str| -> Result<Option<u64>, String> {
        match env(k) {
            None => Ok(None),
            Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                format!("{k}={v}: expected a non-negative integer (set by the launcher)")
            }),
        }
    };
    let torchrun = env("RANK").is_some();
    let (launcher, rank_var, world_var, local_var) = if torchrun {
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    } else {
        ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    };
    let env_rank = num(rank_var)?;
    let env_world = num(world_var)?;
    let env_local = num(local_var)?;
    if env_rank.is_some() {
        if let Some(w) = env_world {
            if w != world as u64 {
                return Err(format!(
                    "{launcher} started {w} processes ({world_var}={w}), but the schedule on its mesh has {world} ranks: start one process per rank"
                ));
            }
        }
    }
    let mut notes = Vec::new();
    let rank = match (flags.rank, env_rank) {
        (None, None) => return Ok(None),
        (Some(r), Some(e)) => {
            if r as u64 != e {
                notes.push(format!("--rank {r} overrides {rank_var}={e}"));
            }
            r as u64
        }
        (Some(r), None) => r as u64,
        (None, Some(e)) => e,
    };
    if rank >= world as u64 {
        let from = if flags.rank.is_some() {
            "--rank".to_string()
        } else {
            rank_var.to_string()
        };
        return Err(format!(
            "{from} {rank} is outside the world of {world} ranks (0..={})",
            world.saturating_sub(1)
        ));
    }
    let device = match (flags.device, env_local) {
        (Some(d), Some(e)) => {
            if d as u64 != e {
                notes.push(format!("--device {d} overrides {local_var}={e}"));
            }
            d
        }
        (Some(d), None) => d,
        (None, Some(e)) => e as usize,
        // Without a launcher's local rank: the rank's GPU is the rank (one node).
        (None, None) => rank as usize,
    };
    let master = match (env("MASTER_ADDR"), num("MASTER_PORT")?) {
        (Some(a), Some(p)) => {
            if p >= u16::MAX as u64 {
                return Err(format!(
                    "MASTER_PORT={p}: schedc's rank 0 listens on the next port, which must be below 65536"
                ));
            }
            Some(format!("tcp://{a}:{}", p + 1))
        }
        _ => None,
    };
    let rendezvous = match (&flags.rendezvous, master) {
        (Some(f), _) => f
            .parse()
            .map_err(|e: String| format!("--rendezvous: {e}"))?,
        (None, Some(m)) => m.parse().map_err(|e: String| {
            format!("MASTER_ADDR/MASTER_PORT give `{m}`, not an address: {e}")
        })?,
        (None, None) => {
            return Err(if flags.rank.is_some() {
                "--rank needs --rendezvous (or MASTER_ADDR and MASTER_PORT)".to_string()
            } else {
                format!(
                    "{launcher} gives this process {rank_var}={rank}, but no rendezvous: set MASTER_ADDR and MASTER_PORT or give --rendezvous (tcp://HOST:PORT, or file:PATH on a shared file system)"
                )
            })
        }
    };
    Ok(Some(Placement {
        rank: rank as u32,
        device,
        rendezvous,
        notes,
    }))
}

#[cfg(test)]
mod placement_tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn flags(rank: Option<u32>, rdv: Option<&str>, device: Option<usize>) -> PlacementFlags {
        PlacementFlags {
            rank,
            rendezvous: rdv.map(str::to_string),
            device,
        }
    }

    #[test]
    fn torchrun_environment_places_the_process() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]);
        let p = placement(&PlacementFlags::default(), &e, 8)
            .unwrap()
            .unwrap();
        assert_eq!(
            p,
            Placement {
                rank: 5,
                device: 1,
                rendezvous: Rendezvous::Tcp("node0:29501".into()),
                notes: Vec::new(),
            }
        );
        // Flags win, with a note.
        let p = placement(&flags(Some(4), Some("file:/shared/x"), Some(0)), &e, 8)
            .unwrap()
            .unwrap();
        assert_eq!(p.rank, 4);
        assert_eq!(p.device, 0);
        assert_eq!(p.rendezvous, Rendezvous::File("/shared/x".into()));
        assert_eq!(
            p.notes,
            vec![
                "--rank 4 overrides RANK=5",
                "--device 0 overrides LOCAL_RANK=1"
            ]
        );
    }

    #[test]
    fn slurm_environment_places_the_process() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "3"),
        ]);
        // No rendezvous in SLURM's environment: --rendezvous or MASTER_ADDR/PORT.
        assert_eq!(
            placement(&PlacementFlags::default(), &e, 4).unwrap_err(),
            "SLURM gives this process SLURM_PROCID=3, but no rendezvous: set MASTER_ADDR and MASTER_PORT or give --rendezvous (tcp://HOST:PORT, or file:PATH on a shared file system)"
        );
        let p = placement(&flags(None, Some("file:/shared/rdv"), None), &e, 4)
            .unwrap()
            .unwrap();
        assert_eq!((p.rank, p.device), (3, 3));
        assert_eq!(p.rendezvous, Rendezvous::File("/shared/rdv".into()));
        let e = env(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "6000"),
        ]);
        let p = placement(&PlacementFlags::default(), &e, 4)
            .unwrap()
            .unwrap();
        assert_eq!((p.rank, p.device), (2, 0));
        assert_eq!(p.rendezvous, Rendezvous::Tcp("10.0.0.1:6001".into()));
    }

    #[test]
    fn torchrun_inside_slurm_uses_torchruns_rank() {
        // srun starts one torchrun per node; torchrun's RANK is the process's.
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("RANK", "6"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "2"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "29500"),
        ]);
        let p = placement(&PlacementFlags::default(), &e, 8)
            .unwrap()
            .unwrap();
        assert_eq!((p.rank, p.device), (6, 2));
    }

    #[test]
    fn conflicting_or_malformed_launcher_values_are_clear_errors() {
        let e = env(&[("RANK", "1"), ("WORLD_SIZE", "8")]);
        assert_eq!(
            placement(&flags(None, Some("tcp://h:1"), None), &e, 4).unwrap_err(),
            "torchrun started 8 processes (WORLD_SIZE=8), but the schedule on its mesh has 4 ranks: start one process per rank"
        );
        let e = env(&[("RANK", "x1")]);
        assert_eq!(
            placement(&PlacementFlags::default(), &e, 4).unwrap_err(),
            "RANK=x1: expected a non-negative integer (set by the launcher)"
        );
        let e = env(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")]);
        assert_eq!(
            placement(&flags(None, Some("tcp://h:1"), None), &e, 4)
                .unwrap_err()
                .as_str(),
            "SLURM_PROCID 4 is outside the world of 4 ranks (0..=3)"
        );
        assert_eq!(
            placement(&flags(Some(9), Some("tcp://h:1"), None), &env(&[]), 4).unwrap_err(),
            "--rank 9 is outside the world of 4 ranks (0..=3)"
        );
        assert_eq!(
            placement(&flags(Some(1), None, None), &env(&[]), 4).unwrap_err(),
            "--rank needs --rendezvous (or MASTER_ADDR and MASTER_PORT)"
        );
        assert_eq!(
            placement(&flags(Some(1), Some("udp://x"), None), &env(&[]), 4).unwrap_err(),
            "--rendezvous: rendezvous `udp://x`: expected tcp://HOST:PORT or file:PATH"
        );
        let e = env(&[
            ("RANK", "0"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "65535"),
        ]);
        assert!(placement(&PlacementFlags::default(), &e, 4)
            .unwrap_err()
            .starts_with("MASTER_PORT=65535: "));
        // No rank anywhere: the local launcher.
        assert_eq!(
            placement(&PlacementFlags::default(), &env(&[]), 4),
            Ok(None)
        );
    }
}
