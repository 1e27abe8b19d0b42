//! The client half of `mpquic status` and `mpquic reload`: which instance's control socket to
//! ask (the only live one in /run/mpquic, or the one a process id listens on), and the request.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

const RUN_DIR: &str = "/run/mpquic";

/// The control socket to query when `--socket` is not given: the only one in /run/mpquic that
/// an instance answers on. Sockets nobody listens on (left by an instance killed with SIGKILL)
/// are skipped and named in the error when no live one is left.
pub fn default_socket() -> Result<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(RUN_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sock"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    pick_live(RUN_DIR, found)
}

/// The control socket of the instance with process id `pid` (`mpquic reload --pid`, as the
/// systemd unit's ExecReload gives it): the unix socket it listens on, found from its open
/// descriptors and the kernel's socket table, so it holds wherever `control_socket` points and
/// however broken the instance's file is now.
pub fn socket_of_pid(pid: u32) -> Result<PathBuf> {
    let mut found = listening_sockets(pid)?;
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => bail!("process {pid} listens on no control socket (is it mpquic?)"),
        _ => bail!("process {pid} listens on several unix sockets ({found:?}); give --socket"),
    }
}

/// The unix socket paths process `pid` listens on.
pub(super) fn listening_sockets(pid: u32) -> Result<Vec<PathBuf>> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("no process {pid} (or not ours to look at)"))?;
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix"))?;
    // "Num RefCount Protocol Flags Type St Inode Path"; a listening socket has flag
    // __SO_ACCEPTCON (0x10000).
    Ok(table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| {
            f.len() >= 8
                && inodes.contains(f[6])
                && u32::from_str_radix(f[3], 16).is_ok_and(|x| x & 0x10000 != 0)
        })
        .map(|f| PathBuf::from(f[7]))
        .collect())
}

/// Of the sockets `found` in `dir`, the one live one (see `default_socket`).
fn pick_live(dir: &str, found: Vec<PathBuf>) -> Result<PathBuf> {
    let (mut live, mut stale, mut unusable) = (Vec::new(), Vec::new(), Vec::new());
    for p in found {
        match UnixStream::connect(&p) {
            Ok(_) => live.push(p),
            // Nobody listens: the instance is gone.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => stale.push(p),
            Err(e) => unusable.push(format!("{}: {e}", p.display())),
        }
    }
    let names = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match live.len() {
        1 => Ok(live.remove(0)),
        0 if !unusable.is_empty() => bail!(
            "cannot use the control sockets in {dir} ({}); mpquic status needs root",
            unusable.join("; ")
        ),
        0 if !stale.is_empty() => bail!(
            "no running instance found in {dir}; not answering (left by stopped instances): {}",
            names(&stale)
        ),
        0 => bail!("no running instance found in {dir}; give --socket PATH"),
        _ => bail!(
            "several instances are running; choose one with --socket: {}",
            names(&live)
        ),
    }
}

/// GET `path` over the unix socket; returns the body.
pub fn get_over_socket(socket: &Path, path: &str) -> Result<String> {
    match request_over_socket(socket, "GET", path)? {
        (200, body) => Ok(body),
        (code, body) => bail!("control socket answered {code}: {}", body.trim_end()),
    }
}

/// POST /reload over the unix socket (`mpquic reload`): what changed, or why the instance
/// refused the new file.
pub fn reload_over_socket(socket: &Path) -> Result<String> {
    match request_over_socket(socket, "POST", "/reload")? {
        (200, body) => Ok(body),
        (409, body) => bail!("reload refused: {body}"),
        (code, body) => bail!("control socket answered {code}: {}", body.trim_end()),
    }
}

/// `method path` over the unix socket; returns the status code and the body.
fn request_over_socket(socket: &Path, method: &str, path: &str) -> Result<(u16, String)> {
    let mut s = UnixStream::connect(socket).with_context(|| {
        format!(
            "cannot connect to {} (is the instance running?)",
            socket.display()
        )
    })?;
    // A reload waits for new connections (each at most a few seconds).
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: mpquic\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("malformed response")?;
    let code = (head.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .context("malformed response")?;
    Ok((code, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn status_skips_sockets_nobody_answers_on() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let live = dir.path().join("live.sock");
        let _l = UnixListener::bind(&live).unwrap();
        // A socket whose listener is gone: what SIGKILL leaves behind.
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());

        assert_eq!(
            pick_live(&d, vec![live.clone(), stale.clone()]).unwrap(),
            live
        );
        let e = pick_live(&d, vec![stale.clone()]).unwrap_err().to_string();
        assert!(
            e.contains("not answering") && e.contains("stale.sock"),
            "{e}"
        );
        let other = dir.path().join("other.sock");
        let _o = UnixListener::bind(&other).unwrap();
        let e = pick_live(&d, vec![live, stale, other])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("several instances") && !e.contains("stale.sock"),
            "{e}"
        );
        let e = pick_live(&d, vec![]).unwrap_err().to_string();
        assert!(e.contains("no running instance"), "{e}");
    }
}
