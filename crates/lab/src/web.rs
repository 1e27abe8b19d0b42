//! Web-like transfers for scenarios (`kind: web`): objects of one size fetched over TCP, one
//! after another or several at a time, each on a new connection, the way a browser loading a
//! page's objects from many hosts does; judged by each object's completion time (connect to
//! last byte, so the handshake's round trip and slow start are in it: that is what short
//! transfers cost on a long or jittery path, and what bulk throughput figures do not show).
//!
//! `mpquic-lab web serve PORT` runs on the far side: it reads an 8-byte object size (big
//! endian) from each connection, sends that many bytes and closes. `mpquic-lab web fetch
//! HOST:PORT` on the LAN side runs `--parallel` fetch loops for `--seconds` and prints each
//! fetch's start (seconds into the run) and completion time, and the fetches that failed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::voice::pct;

/// Largest object a server sends (a request above it is refused: the connection closes).
const MAX_OBJECT: u64 = 1 << 30;
/// Connections a server serves at once; beyond, new ones wait in the listen queue.
const MAX_SERVING: usize = 256;
/// A fetch that has not completed by then counts as failed (a stalled connection).
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// Serve objects on `port`: new connections for `seconds` and one more (no fetch starts later),
/// then until those being served are done (at most `FETCH_TIMEOUT`).
pub fn serve(port: u16, seconds: f64) -> Result<Value> {
    let listener = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("port {port}"))?;
    listener.set_nonblocking(true)?;
    let until = Instant::now() + Duration::from_secs_f64(seconds) + Duration::from_secs(1);
    let serving = Arc::new(AtomicUsize::new(0));
    let mut served = 0u64;
    while Instant::now() < until {
        match listener.accept() {
            Ok((conn, _)) if serving.load(Ordering::Relaxed) < MAX_SERVING => {
                served += 1;
                serving.fetch_add(1, Ordering::Relaxed);
                let serving = serving.clone();
                std::thread::spawn(move || {
                    // A client that goes away mid-object is its own failure, counted there.
                    let _ = send_object(conn);
                    serving.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Ok(_) => {} // over the bound: dropped, the client sees its fetch fail
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("accepting"),
        }
    }
    let done_by = Instant::now() + FETCH_TIMEOUT;
    while serving.load(Ordering::Relaxed) > 0 && Instant::now() < done_by {
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(json!({"served": served}))
}

fn send_object(mut conn: TcpStream) -> Result<()> {
    conn.set_nonblocking(false)?;
    conn.set_read_timeout(Some(FETCH_TIMEOUT))?;
    conn.set_write_timeout(Some(FETCH_TIMEOUT))?;
    let mut req = [0u8; 8];
    conn.read_exact(&mut req)?;
    let mut left = u64::from_be_bytes(req);
    if left > MAX_OBJECT {
        bail!("object of {left} bytes refused");
    }
    let chunk = [0u8; 64 * 1024];
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        conn.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    Ok(())
}

/// One object from `to`: its completion time, or why it failed.
fn fetch_one(to: SocketAddr, size: u64) -> Result<Duration> {
    let t0 = Instant::now();
    let mut conn = TcpStream::connect_timeout(&to, FETCH_TIMEOUT).context("connect")?;
    conn.set_read_timeout(Some(FETCH_TIMEOUT))?;
    conn.write_all(&size.to_be_bytes())?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    while got < size {
        if t0.elapsed() > FETCH_TIMEOUT {
            bail!("{got} of {size} bytes after {FETCH_TIMEOUT:?}");
        }
        match conn.read(&mut buf)? {
            0 => bail!("closed after {got} of {size} bytes"),
            n => got += n as u64,
        }
    }
    Ok(t0.elapsed())
}

/// `parallel` fetch loops against `to` for `seconds`: `{"fetches": [[start_s, ms], ...],
/// "failed": [[start_s, "why"], ...]}` (a loop starts its next fetch when one ends).
pub fn fetch(to: &str, size: u64, parallel: usize, seconds: f64) -> Result<Value> {
    let to = to
        .to_socket_addrs()
        .context("the server's address")?
        .next()
        .context("the server's address")?;
    let valid = (1..=64).contains(&parallel) && seconds.is_finite() && seconds > 0.0;
    if !valid {
        bail!("--parallel 1..64 and --seconds above 0");
    }
    if size == 0 || size > MAX_OBJECT {
        bail!("--size 1..{MAX_OBJECT}");
    }
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(seconds);
    let loops: Vec<_> = (0..parallel)
        .map(|_| {
            std::thread::spawn(move || {
                let (mut done, mut failed) = (Vec::new(), Vec::new());
                while Instant::now() < until {
                    let start = t0.elapsed().as_secs_f64();
                    match fetch_one(to, size) {
                        Ok(d) => done.push(json!([start, d.as_secs_f64() * 1e3])),
                        Err(e) => {
                            failed.push(json!([start, format!("{e:#}")]));
                            // A refused connect fails at once: do not spin on it.
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
                (done, failed)
            })
        })
        .collect();
    let (mut fetches, mut failed) = (Vec::new(), Vec::new());
    for l in loops {
        let (d, f) = l
            .join()
            .map_err(|_| anyhow::anyhow!("a fetch loop panicked"))?;
        fetches.extend(d);
        failed.extend(f);
    }
    Ok(json!({"fetches": fetches, "failed": failed}))
}

/// `mpquic-lab web ROLE AT`: `serve PORT` or `fetch HOST:PORT`.
pub fn run(role: &str, at: &str, size: u64, parallel: usize, seconds: f64) -> Result<Value> {
    match role {
        "serve" => serve(at.parse().context("serve PORT: the port")?, seconds),
        "fetch" => fetch(at, size, parallel, seconds),
        other => bail!("web {other}: serve or fetch"),
    }
}

/// The figures web-like transfers are judged by, from `fetch`'s output: completed and failed
/// fetches, objects a second, the completion time's median, p95 and maximum, and each fetch
/// as `[start_s, ms]` in the order they started (to line the slow ones up with a link's events:
/// a Starlink reconfiguration, an LTE stall).
pub fn judge(out: &Value, seconds: f64) -> Value {
    let mut each: Vec<(f64, f64)> = out["fetches"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| Some((f[0].as_f64()?, f[1].as_f64()?)))
                .collect()
        })
        .unwrap_or_default();
    each.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut ms: Vec<f64> = each.iter().map(|&(_, ms)| ms).collect();
    let round = |x: f64, to: f64| (x * to).round() / to;
    let each: Vec<Value> = each
        .iter()
        .map(|&(s, ms)| json!([round(s, 1e3), round(ms, 10.0)]))
        .collect();
    ms.sort_by(f64::total_cmp);
    let failed = out["failed"].as_array().map_or(0, Vec::len);
    json!({
        "fetched": ms.len(),
        "failed": failed,
        "failures": out["failed"].as_array().map(|a| a.iter().take(5).cloned().collect::<Vec<_>>()),
        "objects_per_s": if seconds > 0.0 { ms.len() as f64 / seconds } else { 0.0 },
        "fetches": each,
        "completion_ms": if ms.is_empty() { json!(null) } else {
            json!({"median": pct(&ms, 0.5), "p95": pct(&ms, 0.95), "max": ms[ms.len() - 1]})
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over loopback: every object arrives whole, sequential and parallel, and the judge counts
    /// them; a server that is not there makes failures, not a hang or a panic.
    #[test]
    fn objects_are_fetched_whole_and_judged() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let server = std::thread::spawn(move || serve(port, 1.5).unwrap());
        let to = format!("127.0.0.1:{port}");
        // The server binds at once; the first connect may still race it (a failure, retried).
        let one = fetch(&to, 100_000, 1, 0.5).unwrap();
        let six = fetch(&to, 100_000, 6, 0.5).unwrap();
        let j1 = judge(&one, 0.5);
        let j6 = judge(&six, 0.5);
        assert!(j1["fetched"].as_u64().unwrap() >= 5, "{j1}");
        let each = j6["fetches"].as_array().unwrap();
        assert_eq!(each.len() as u64, j6["fetched"].as_u64().unwrap(), "{j6}");
        let starts: Vec<f64> = each.iter().map(|f| f[0].as_f64().unwrap()).collect();
        assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{j6}");
        assert!(
            j6["fetched"].as_u64().unwrap() >= j1["fetched"].as_u64().unwrap() / 2,
            "{j6}"
        );
        let p95 = j6["completion_ms"]["p95"].as_f64().unwrap();
        assert!(
            p95 >= j6["completion_ms"]["median"].as_f64().unwrap(),
            "{j6}"
        );
        server.join().unwrap();
        let none = fetch(&to, 1000, 1, 0.3).unwrap();
        let j = judge(&none, 0.3);
        assert_eq!(j["fetched"], 0, "{j}");
        assert!(j["failed"].as_u64().unwrap() >= 1, "{j}");
        assert!(j["completion_ms"].is_null());
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(fetch("127.0.0.1:1", 0, 1, 1.0).is_err());
        assert!(fetch("127.0.0.1:1", 10, 0, 1.0).is_err());
        assert!(fetch("127.0.0.1:1", 10, 1, f64::NAN).is_err());
        assert!(run("listen", "80", 1, 1, 1.0).is_err());
    }
}
