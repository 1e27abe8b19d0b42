//! Small pieces of the process shell shared by client and server.

use crate::config::Config;

/// What the process holds now, for status: runtime tasks, open fds, resident memory.
pub fn process_status() -> crate::status::ProcessStatus {
    let tasks =
        tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_alive_tasks() as u64);
    let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    // SAFETY: sysconf reads a constant of the system; no memory is touched.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let rss_bytes = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page);
    let (heap_in_use_bytes, heap_free_bytes) = heap();
    crate::status::ProcessStatus {
        tasks,
        open_fds,
        rss_bytes,
        heap_in_use_bytes,
        heap_free_bytes,
    }
}

/// The allocator's bytes in use (heap and its own mappings) and free.
fn heap() -> (u64, u64) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks as u64 + m.hblkhd as u64, m.fordblks as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    (0, 0)
}

/// Datagrams the kernel dropped, socket buffer full, at the UDP sockets bound to local `port`
/// in this network namespace (the `drops` column of /proc/self/net/udp and udp6).
pub fn udp_drops(port: u16) -> u64 {
    ["/proc/self/net/udp", "/proc/self/net/udp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .map(|text| drops_at(&text, port))
        .sum()
}

/// The `drops` of the sockets at local `port` in a /proc/net/udp table.
fn drops_at(table: &str, port: u16) -> u64 {
    let want = format!(":{port:04X}");
    (table.lines().skip(1))
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let local = cols.get(1)?;
            local
                .ends_with(&want)
                .then(|| cols.last()?.parse::<u64>().ok())?
        })
        .sum()
}

/// TUN MTU: as configured, or derived from the smallest link MTU (`mpquic_core::packet::mtu`).
pub fn tun_mtu(cfg: &Config, link_mtu: u32) -> u32 {
    cfg.tun_mtu
        .unwrap_or(mpquic_core::packet::mtu::tun_mtu(link_mtu))
}

/// The instance's TUN device, created with the configured offloads and MTU (IPv4 only inside
/// the tunnel for now), with one queue.
pub fn open_tun(
    platform: &crate::io::platform::Platform,
    cfg: &Config,
    name: &str,
    mtu: u32,
) -> std::io::Result<crate::io::tun::Tun> {
    let mut queues = open_tun_queues(platform, cfg, name, mtu, 1)?;
    Ok(queues.swap_remove(0))
}

/// The same with `queues` queues (the server's, one reader each); the first sets the device up.
pub fn open_tun_queues(
    platform: &crate::io::platform::Platform,
    cfg: &Config,
    name: &str,
    mtu: u32,
    queues: usize,
) -> std::io::Result<Vec<crate::io::tun::Tun>> {
    let tuns = platform.tun(name, cfg.tun_offload, queues)?;
    let tun = &tuns[0];
    tun.device().set_mtu(mtu)?;
    tun.device().disable_ipv6();
    tracing::info!(
        tun = %name,
        offload = tun.device().offload(),
        udp_offload = tun.device().udp_offload(),
        queues = tuns.len(),
        "TUN device open"
    );
    Ok(tuns)
}

/// 64 random bits from the kernel (session ids).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom(2) writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        // Unreachable on Linux >= 3.17; fall back to time and pid rather than fail.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        return t ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_ne_bytes(b)
}

/// Let freed buffers go back to the system. glibc raises its mmap threshold to the size of the
/// largest mmapped block freed so far (up to 32 MiB), so after the first connection's buffers
/// (a QUIC endpoint's receive buffer is hundreds of KiB) are freed, later ones come from the
/// heap, where the small long-lived allocations made meanwhile pin them: a client whose paths
/// reconnected a few hundred times kept tens of MiB it no longer used. A fixed threshold keeps
/// every block of 128 KiB or more in its own mapping, returned when it is freed.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning; called before the runtime starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Connections were let go (`released`): once they have drained, the heap's free pages go back
/// to the system. A connection is a few hundred small blocks (the QUIC engine's state, stream
/// chunks of up to 64 KiB) that end up spread between blocks that live on, so glibc cannot
/// shrink its heap by itself: with pipes, 15 path reconnections left 10 MiB of free pages in
/// the client's RSS. `malloc_trim` takes them back (a few ms for a heap of tens of MiB): once
/// soon after a release, and once more when the closed connection has surely drained, so at
/// most twice per `TRIM_AGAIN`, however many paths flap.
static RELEASED: tokio::sync::Notify = tokio::sync::Notify::const_new();
const TRIM_AFTER: std::time::Duration = std::time::Duration::from_secs(1);
const TRIM_AGAIN: std::time::Duration = std::time::Duration::from_secs(4);

/// A connection was closed or replaced: its memory goes back to the system soon (`trim_task`).
pub fn released() {
    RELEASED.notify_one();
}

/// Between releases: a tunnel that carries traffic for hours without a connection ending frees
/// its buffers into the heap too (an hour's soak ended 1.6 MiB above its start with no trim
/// in between).
const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(30);
/// Free memory in the heap worth a trim between releases.
const TRIM_FREE: u64 = 1 << 20;

/// The instance's housekeeping: trims the heap `TRIM_AFTER` after connections were released,
/// and `TRIM_AGAIN` after that (a closed QUIC connection drains for three probe timeouts
/// before the engine frees its state); otherwise every `TRIM_EVERY` when the heap holds more
/// than `TRIM_FREE` free (a trim of a heap of tens of MiB takes about a millisecond).
pub async fn trim_task() {
    loop {
        let released = tokio::time::timeout(TRIM_EVERY, RELEASED.notified())
            .await
            .is_ok();
        match released {
            true => {
                for wait in [TRIM_AFTER, TRIM_AGAIN] {
                    tokio::time::sleep(wait).await;
                    trim();
                }
            }
            false if heap().1 > TRIM_FREE => trim(),
            false => {}
        }
    }
}

fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the heap to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn udp_drops_are_read_for_the_port_only() {
        let table = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
  123: 0100630A:AFD9 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 9 2 0000000000000000 18686\n\
  124: 00000000:AFDA 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 9 2 0000000000000000 5\n";
        assert_eq!(super::drops_at(table, 45017), 18686);
        assert_eq!(super::drops_at(table, 45018), 5);
        assert_eq!(super::drops_at(table, 1), 0);
    }
}
