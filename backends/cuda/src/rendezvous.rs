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
