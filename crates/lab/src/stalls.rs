//! How long inner TCP flows stall (scenarios' TCP `iperf3` items): `mpquic-lab stalls PORT`
//! runs in the receiving host's namespace while a transfer runs and watches the receiver's own
//! ACKs. A TCP receiver's cumulative ACK moves only when the next bytes in order have arrived,
//! so the time between two moves is the time the application got nothing: a loss waiting for
//! its retransmission, a tunnel holding packets back to put them in order, a link that stopped.
//! Throughput per second hides these (a 300 ms stall in a 20 Mbit/s second costs 30% of that
//! second, and the flow catches up); a call or a page waiting on such a flow sees all of it.
//!
//! What counts: for each flow (four-tuple) with `PORT` at either end, the gaps between ACK
//! moves once it has acknowledged data (the handshake and iperf3's set-up before its first
//! bytes do not count, its cookie included: `SETUP_BYTES`); a move of exactly one (a SYN or a FIN) is not data and is not timed, so
//! the wait for the test's end before the FIN is not a stall either. Flows that acknowledged
//! less than `MIN_FLOW_BYTES` (iperf3's control connection) are left out. Stamps are the
//! kernel's, taken when each ACK leaves the receiver.
//!
//! Under kernel MPTCP the receiver's TCP ACKs are per subflow (the data-level ACK is an MPTCP
//! option), so the runner does not watch those rows.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::packet_ring::{setopt, take_drops};

/// A stall at least this long is listed (the longest an inner flow may stall across a
/// reconfiguration or a capacity dip, by the figure the product is held to).
pub const STALL_MS: u64 = 200;
/// Flows that acknowledged less than this are not bulk transfers (iperf3's control
/// connection carries a few hundred bytes).
const MIN_FLOW_BYTES: u64 = 100_000;
/// What a flow acknowledges before this is set-up, not timed: iperf3 sends a 37-byte cookie
/// on each stream as it connects, and the streams of one test (`-P 16`) connect one after
/// another and wait for the last before the test starts: timed, the first stream's wait
/// showed as a 600 ms stall at the start of every 16-flow upload.
const SETUP_BYTES: u64 = 64;
/// Stalls listed per flow at most (the count and the longest are always whole).
const MAX_LISTED: usize = 64;
/// Bytes of each captured packet the filter keeps: IPv6 and TCP headers with options.
const SNAP: u32 = 128;

/// Where a flow's receiver is, and where it sends to.
type FlowKey = (IpAddr, u16, IpAddr, u16);

/// One flow's ACK progress.
#[derive(Debug, Default, Clone)]
struct Flow {
    last_ack: Option<u32>,
    /// When the ACK last moved over data (ns since the epoch); 0 before the first.
    last_move_ns: u64,
    acked: u64,
    longest_ns: u64,
    /// When the longest stall began.
    longest_at_ns: u64,
    /// Stalls of `STALL_MS` or more: (start, length) in ns.
    stalls: Vec<(u64, u64)>,
    over: u64,
}

/// The flows seen so far: fed every TCP packet the receiver sent (`on_packet`), sans I/O.
#[derive(Debug, Default)]
pub struct Watch {
    port: u16,
    flows: HashMap<FlowKey, Flow>,
}

impl Watch {
    pub fn new(port: u16) -> Watch {
        Watch {
            port,
            flows: HashMap::new(),
        }
    }

    /// An IP packet the receiver sent at `at_ns` (its start: IPv4 or IPv6, at least the TCP
    /// header). Anything else is ignored.
    pub fn on_packet(&mut self, at_ns: u64, p: &[u8]) {
        let Some((key, ack)) = tcp_ack(p) else {
            return;
        };
        if key.1 != self.port && key.3 != self.port {
            return;
        }
        let f = self.flows.entry(key).or_default();
        let Some(last) = f.last_ack else {
            f.last_ack = Some(ack);
            return;
        };
        // Sequence space wraps: a move is forward by less than half of it.
        let moved = ack.wrapping_sub(last);
        if moved == 0 || moved >= 1 << 31 {
            return;
        }
        f.last_ack = Some(ack);
        if moved == 1 {
            return;
        }
        f.acked += u64::from(moved);
        if f.acked <= SETUP_BYTES {
            return;
        }
        if f.last_move_ns != 0 {
            let gap = at_ns.saturating_sub(f.last_move_ns);
            if gap > f.longest_ns {
                f.longest_ns = gap;
                f.longest_at_ns = f.last_move_ns;
            }
            if gap >= STALL_MS * 1_000_000 {
                f.over += 1;
                if f.stalls.len() < MAX_LISTED {
                    f.stalls.push((f.last_move_ns, gap));
                }
            }
        }
        f.last_move_ns = at_ns;
    }

    /// The bulk flows' stalls: `{"flows": N, "longest_ms", "longest_at_unix", "over_200ms",
    /// "stalls": [[start_unix, ms], ...]}` (the stalls of every flow, by start).
    pub fn report(&self) -> Value {
        let bulk: Vec<&Flow> = self
            .flows
            .values()
            .filter(|f| f.acked >= MIN_FLOW_BYTES)
            .collect();
        let longest = bulk.iter().max_by_key(|f| f.longest_ns);
        let mut stalls: Vec<(u64, u64)> = bulk.iter().flat_map(|f| f.stalls.clone()).collect();
        stalls.sort_unstable();
        let unix = |ns: u64| ns as f64 / 1e9;
        let ms = |ns: u64| (ns as f64 / 1e6 * 10.0).round() / 10.0;
        json!({
            "flows": bulk.len(),
            "threshold_ms": STALL_MS,
            "longest_ms": longest.map(|f| ms(f.longest_ns)),
            "longest_at_unix": longest.map(|f| unix(f.longest_at_ns)),
            "over_threshold": bulk.iter().map(|f| f.over).sum::<u64>(),
            "stalls": stalls.iter().map(|&(at, len)| json!([unix(at), ms(len)])).collect::<Vec<_>>(),
        })
    }
}

/// A TCP packet's flow and acknowledgement number (only packets with the ACK flag).
fn tcp_ack(p: &[u8]) -> Option<(FlowKey, u32)> {
    let (src, dst, tcp) = match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < 20 || p[9] != 6 || ihl < 20 {
                return None;
            }
            let a: [u8; 4] = p[12..16].try_into().ok()?;
            let b: [u8; 4] = p[16..20].try_into().ok()?;
            (IpAddr::from(a), IpAddr::from(b), p.get(ihl..)?)
        }
        6 => {
            // No extension headers: the lab's hosts send none on TCP.
            if p.len() < 40 || p[6] != 6 {
                return None;
            }
            let a: [u8; 16] = p[8..24].try_into().ok()?;
            let b: [u8; 16] = p[24..40].try_into().ok()?;
            (IpAddr::from(a), IpAddr::from(b), &p[40..])
        }
        _ => return None,
    };
    if tcp.len() < 20 || tcp[13] & 0x10 == 0 {
        return None;
    }
    let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
    let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    Some(((src, sport, dst, dport), ack))
}

/// Watch the TCP packets this namespace sends with `port` at either end until standard input
/// closes (the runner closes it when the transfer is over); print the report (JSON).
pub fn run(port: u16) -> Result<Value> {
    let sock = open().context("a packet socket for the ACK watch (needs CAP_NET_RAW)")?;
    let fd = sock.as_raw_fd();
    let mut watch = Watch::new(port);
    let mut buf = [0u8; SNAP as usize];
    let mut stdin_open = true;
    while stdin_open {
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: libc::STDIN_FILENO,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("poll");
        }
        if fds[1].revents != 0 {
            // Readable stdin is its end (nothing is written to it) or a hang-up.
            let mut b = [0u8; 64];
            // SAFETY: reading into a local buffer of that size.
            let r = unsafe { libc::read(libc::STDIN_FILENO, b.as_mut_ptr().cast(), b.len()) };
            stdin_open = r > 0;
        }
        // Drain what waits (also after stdin closed: the last ACKs).
        while let Some((len, at_ns)) = recv_stamped(fd, &mut buf) {
            watch.on_packet(at_ns, &buf[..len]);
        }
    }
    let mut v = watch.report();
    v["capture_drops"] = json!(take_drops(fd));
    Ok(v)
}

/// An AF_PACKET socket on every interface of the namespace that gets, cut to `SNAP` bytes from
/// the IP header, only the TCP packets the host sends (the filter runs in the kernel, so the
/// data arriving at 100+ Mbit/s is never copied here), stamped by the kernel.
fn open() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); checked and owned below.
    let raw = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            i32::from((libc::ETH_P_ALL as u16).to_be()),
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // Classic BPF over the packet from its network header (SOCK_DGRAM): sent by this host,
    // IPv4 or IPv6, TCP.
    const AD: u32 = 0xfffff000; // SKF_AD_OFF
    let ins = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let ld_w_abs = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let ld_h_abs = (libc::BPF_LD | libc::BPF_H | libc::BPF_ABS) as u16;
    let ld_b_abs = (libc::BPF_LD | libc::BPF_B | libc::BPF_ABS) as u16;
    let jeq = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    let prog = [
        /* 0 */ ins(ld_w_abs, 0, 0, AD + 4), // SKF_AD_PKTTYPE
        /* 1 */ ins(jeq, 0, 8, libc::PACKET_OUTGOING as u32),
        /* 2 */ ins(ld_h_abs, 0, 0, AD), // SKF_AD_PROTOCOL
        /* 3 */ ins(jeq, 0, 2, libc::ETH_P_IP as u32),
        /* 4 */ ins(ld_b_abs, 0, 0, 9),
        /* 5 */ ins(jeq, 3, 4, 6),
        /* 6 */ ins(jeq, 0, 3, libc::ETH_P_IPV6 as u32),
        /* 7 */ ins(ld_b_abs, 0, 0, 6),
        /* 8 */ ins(jeq, 0, 1, 6),
        /* 9 */ ins(ret, 0, 0, SNAP),
        /* 10 */ ins(ret, 0, 0, 0),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    setopt(
        sock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_ATTACH_FILTER,
        &fprog,
    )?;
    setopt(
        sock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_TIMESTAMPNS,
        &1i32,
    )?;
    // Room for seconds of ACKs should this process be descheduled for a while.
    setopt(
        sock.as_raw_fd(),
        libc::SOL_SOCKET,
        libc::SO_RCVBUFFORCE,
        &(8i32 << 20),
    )?;
    // Frames queued before the filter was attached are not filtered: let them go.
    let mut b = [0u8; 1];
    while recv_stamped(sock.as_raw_fd(), &mut b).is_some() {}
    Ok(sock)
}

/// One waiting packet into `buf` (cut to its size): its length and the kernel's stamp (ns
/// since the epoch); `None` when nothing waits.
fn recv_stamped(fd: i32, buf: &mut [u8]) -> Option<(usize, u64)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: zeroed msghdr is valid; its pointers are set to live buffers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points at valid buffers for the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return None;
    }
    let mut at_ns = 0u64;
    // SAFETY: walking the control messages the kernel wrote into `cbuf`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::timespec>());
                at_ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if at_ns == 0 {
        at_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    }
    Some(((n as usize).min(buf.len()), at_ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 TCP packet from 10.0.0.2:5201 to 10.0.0.1:40000 acknowledging `ack`.
    fn ack4(ack: u32, sport: u16) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[9] = 6;
        p[12..16].copy_from_slice(&[10, 0, 0, 2]);
        p[16..20].copy_from_slice(&[10, 0, 0, 1]);
        p[20..22].copy_from_slice(&sport.to_be_bytes());
        p[22..24].copy_from_slice(&40000u16.to_be_bytes());
        p[28..32].copy_from_slice(&ack.to_be_bytes());
        p[33] = 0x10;
        p
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn gaps_between_ack_moves_over_data_are_the_stalls() {
        let mut w = Watch::new(5201);
        let isn = u32::MAX - 50_000; // wraps during the flow
        let t0 = 1_000_000 * MS;
        w.on_packet(t0, &ack4(isn, 5201)); // the SYN's ACK
        w.on_packet(t0 + MS, &ack4(isn.wrapping_add(1), 5201));
        // iperf3's cookie, then the wait for the other streams to connect: set-up, not timed.
        w.on_packet(t0 + 40 * MS, &ack4(isn.wrapping_add(38), 5201));
        // Set-up before the first data: not timed.
        let mut ack = isn.wrapping_add(38);
        let mut t = t0 + 900 * MS;
        for _ in 0..100 {
            ack = ack.wrapping_add(2896);
            w.on_packet(t, &ack4(ack, 5201));
            t += 5 * MS;
        }
        // A duplicate ACK 250 ms on does not end the stall; the move 320 ms on does.
        w.on_packet(t + 250 * MS, &ack4(ack, 5201));
        let stall_from = t - 5 * MS;
        t += 315 * MS;
        ack = ack.wrapping_add(2896);
        w.on_packet(t, &ack4(ack, 5201));
        // The FIN, a second after the last data: not a stall.
        w.on_packet(t + 1000 * MS, &ack4(ack.wrapping_add(1), 5201));
        // Another port's flow is not watched.
        w.on_packet(t, &ack4(7, 6000));
        w.on_packet(t + 5000 * MS, &ack4(300_000, 6000));
        let r = w.report();
        assert_eq!(r["flows"], 1);
        assert_eq!(r["longest_ms"], 320.0);
        assert_eq!(r["over_threshold"], 1);
        assert_eq!(r["stalls"][0][0], stall_from as f64 / 1e9);
        assert_eq!(r["stalls"][0][1], 320.0);
    }

    #[test]
    fn a_control_connection_and_malformed_packets_are_left_out() {
        let mut w = Watch::new(5201);
        w.on_packet(0, &ack4(1, 5201));
        w.on_packet(10 * MS, &ack4(300, 5201));
        w.on_packet(5000 * MS, &ack4(600, 5201));
        for bad in [
            &[][..],
            &[0x45, 0, 0][..],
            &[0x60; 39][..],
            &ack4(1, 5201)[..30],
        ] {
            w.on_packet(6000 * MS, bad);
        }
        let r = w.report();
        assert_eq!(r["flows"], 0);
        assert_eq!(r["longest_ms"], Value::Null);
        assert_eq!(r["over_threshold"], 0);
    }
}
