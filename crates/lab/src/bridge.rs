//! The emulator's I/O shell: for each path, two AF_PACKET sockets on the emulator's two veth ends
//! (towards the client and towards the server) and one thread per direction that feeds frames
//! through that direction's `Link` model. IP frames are emulated; ARP and other non-IP frames
//! pass straight through, so neighbour discovery never fails because of emulated loss.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpquic_core::PacketInfo;

use crate::emu::{Link, LinkSpec, LinkStats};
use crate::timing::{arrival_age, WakeTuner};

const ETH_HDR: usize = 14;
const ETH_P_ALL: u16 = 0x0003;
const MAX_FRAME: usize = 65_536 + ETH_HDR;
/// Longest sleep between checks for live changes and shutdown.
const MAX_WAIT: Duration = Duration::from_millis(20);

/// A raw socket bound to one interface.
pub struct RawSocket {
    fd: OwnedFd,
}

impl RawSocket {
    pub fn bind(ifname: &str) -> io::Result<RawSocket> {
        // SAFETY: plain socket(2); result checked and owned.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                i32::from(ETH_P_ALL.to_be()),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let name =
            std::ffi::CString::new(ifname).map_err(|_| io::Error::other("bad interface name"))?;
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(io::Error::other(format!("no interface {ifname}")));
        }
        // SAFETY: zeroed sockaddr_ll is valid; fields set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ALL.to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: sll is a valid sockaddr_ll of the given size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let s = RawSocket { fd };
        // Our own transmissions must not come back to us as input.
        s.setopt(libc::SOL_PACKET, 23 /* PACKET_IGNORE_OUTGOING */, 1)?;
        // Frames for other MACs (the far end's) must reach us.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = ifindex as i32;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        // SAFETY: valid packet_mreq.
        unsafe {
            libc::setsockopt(
                s.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_ADD_MEMBERSHIP,
                (&mreq as *const libc::packet_mreq).cast(),
                std::mem::size_of::<libc::packet_mreq>() as u32,
            )
        };
        s.setopt(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 16 << 20)?;
        s.setopt(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 16 << 20)?;
        // The kernel's receive time of each frame: the emulated delay starts there, not when
        // this thread gets round to reading it.
        s.setopt(libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1)?;
        Ok(s)
    }

    fn setopt(&self, level: i32, name: i32, v: i32) -> io::Result<()> {
        // SAFETY: int option on our socket.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (&v as *const i32).cast(),
                std::mem::size_of::<i32>() as u32,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// One frame and its kernel receive stamp (ns, 0 if none), or `None` when nothing is waiting.
    fn recv(&self, buf: &mut [u8]) -> Option<(usize, u64)> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // u64s keep the control buffer aligned for cmsghdr.
        let mut control = [0u64; 8];
        // SAFETY: zeroed msghdr is valid; the pointers set below outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        // SAFETY: msg describes valid buffers.
        let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, 0) };
        if n <= 0 {
            return None;
        }
        let mut stamp = 0;
        // SAFETY: walking the control messages the kernel wrote into `control`.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                    let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                    stamp = timespec_ns(&ts);
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        Some((n as usize, stamp))
    }

    fn send(&self, frame: &[u8]) -> bool {
        // SAFETY: frame valid for len bytes.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        n == frame.len() as isize
    }

    /// Wait until readable or `timeout` passes (nanosecond resolution); false on timeout.
    fn wait(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // SAFETY: one valid pollfd; null sigmask.
        unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) > 0 }
    }
}

/// Shared between a direction's thread and the control plane.
pub struct Direction {
    pub pending: Mutex<Option<LinkSpec>>,
    pub spec: Mutex<LinkSpec>,
    pub stats: Mutex<LinkStats>,
    /// Frames that were not IP (ARP...), passed through unemulated.
    pub passthrough: Mutex<u64>,
    pub send_errors: Mutex<u64>,
}

impl Direction {
    pub fn new(spec: LinkSpec) -> Arc<Direction> {
        Arc::new(Direction {
            pending: Mutex::new(None),
            spec: Mutex::new(spec),
            stats: Mutex::new(LinkStats::default()),
            passthrough: Mutex::new(0),
            send_errors: Mutex::new(0),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forward frames from `input` to `output` through `dir`'s link model until `stop`.
pub fn run_direction(
    input: RawSocket,
    output: RawSocket,
    dir: Arc<Direction>,
    seed: u64,
    stop: Arc<AtomicBool>,
) {
    // SAFETY: prctl with a constant option; 1 us timer slack keeps delays precise.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0, 0, 0) };
    // The lowest real-time priority: on a busy machine a normal thread wakes milliseconds late,
    // which would become emulated delay (netem runs in the kernel and has no such problem). The
    // kernel's RT throttling still leaves other work 5% of each second.
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: valid sched_param for the calling thread.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        eprintln!(
            "warning: no real-time priority ({}); delays may stretch on a busy machine",
            io::Error::last_os_error()
        );
    }
    let mut link: Link<Vec<u8>> = Link::new(lock(&dir.spec).clone(), seed);
    let mut free: Vec<Vec<u8>> = Vec::new();
    let mut out: Vec<Vec<u8>> = Vec::new();
    let mut buf = vec![0u8; MAX_FRAME];
    let mut last_publish = Instant::now();
    let (mut passthrough, mut send_errors) = (0u64, 0u64);
    let mut tuner = WakeTuner::default();
    // Arrival times handed to the model never go backwards (stamps come from several CPUs).
    let mut last_arrival = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if let Some(spec) = lock(&dir.pending).take() {
            link.set_spec(spec.clone());
            *lock(&dir.spec) = spec;
        }
        let now = Instant::now();
        let wait = link
            .next_deadline()
            .map_or(MAX_WAIT, |d| d.saturating_duration_since(now).min(MAX_WAIT));
        // Sleeping wakes up late; for the last stretch before a deadline, spin instead so delays
        // stay close to the model. The stretch follows the lateness this thread observes.
        let spin = tuner.spin(wait);
        if wait > spin {
            let sleep = wait - spin;
            if !input.wait(sleep) {
                tuner.observe(sleep, now.elapsed().saturating_sub(sleep));
            }
        } else if !wait.is_zero() {
            std::thread::yield_now();
        }
        // Drain what has arrived (bounded, so output keeps flowing under load).
        for _ in 0..256 {
            let Some((n, stamp)) = input.recv(&mut buf) else {
                break;
            };
            let frame = &buf[..n];
            let ip = frame.get(ETH_HDR..).filter(|_| is_ip(frame));
            match ip.and_then(|p| PacketInfo::parse(p).map(|i| (p.len(), i))) {
                Some((len, info)) => {
                    let mut v = free.pop().unwrap_or_default();
                    v.clear();
                    v.extend_from_slice(frame);
                    let now = Instant::now();
                    let age = arrival_age(stamp, clock_ns(libc::CLOCK_REALTIME), || {
                        clock_ns(libc::CLOCK_MONOTONIC)
                    });
                    let arrival = age
                        .and_then(|a| now.checked_sub(a))
                        .unwrap_or(now)
                        .max(last_arrival);
                    last_arrival = arrival;
                    link.push(arrival, v, len, info.flow_hash());
                }
                None => {
                    passthrough += 1;
                    if !output.send(frame) {
                        send_errors += 1;
                    }
                }
            }
        }
        link.poll(Instant::now(), &mut out);
        for frame in out.drain(..) {
            if !output.send(&frame) {
                send_errors += 1;
            }
            if free.len() < 4096 {
                free.push(frame);
            }
        }
        if last_publish.elapsed() >= Duration::from_millis(100) {
            *lock(&dir.stats) = link.stats;
            *lock(&dir.passthrough) = passthrough;
            *lock(&dir.send_errors) = send_errors;
            last_publish = Instant::now();
        }
    }
}

fn timespec_ns(ts: &libc::timespec) -> u64 {
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid clock id and timespec (vDSO, no syscall).
    unsafe { libc::clock_gettime(clock, &mut ts) };
    timespec_ns(&ts)
}

fn is_ip(frame: &[u8]) -> bool {
    matches!(frame.get(12..14), Some([0x08, 0x00]) | Some([0x86, 0xdd]))
}
