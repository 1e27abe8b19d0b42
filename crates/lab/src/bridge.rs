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
use crate::nat::{Nat, NatStats};
use crate::packet_ring::RxRing;
use crate::timing::{self, arrival_age, LinkTimes, WakeTuner};

const ETH_HDR: usize = 14;
const ETH_P_ALL: u16 = 0x0003;
const VLAN_HDR: usize = 4;
/// Longest sleep of an idle direction (live changes wake it up at once).
const MAX_IDLE: Duration = Duration::from_secs(1);

/// An AF_PACKET socket bound to one interface.
pub struct RawSocket {
    fd: OwnedFd,
}

impl RawSocket {
    /// A socket that only sends on `ifname`: bound to protocol 0, so the kernel queues it no
    /// copies of the interface's traffic (which nobody would read).
    pub fn output(ifname: &str) -> io::Result<RawSocket> {
        let s = RawSocket::open(0)?;
        s.bind(ifname, 0)?;
        s.setopt(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 16 << 20)?;
        Ok(s)
    }

    fn open(protocol: u16) -> io::Result<RawSocket> {
        // SAFETY: plain socket(2); result checked and owned.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                i32::from(protocol.to_be()),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor we own.
        Ok(RawSocket {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Bind to `ifname` for `protocol` (0: send only); its interface index.
    fn bind(&self, ifname: &str, protocol: u16) -> io::Result<i32> {
        let ifindex = ifindex(ifname)?;
        // SAFETY: zeroed sockaddr_ll is valid; fields set below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = protocol.to_be();
        sll.sll_ifindex = ifindex;
        // SAFETY: sll is a valid sockaddr_ll of the given size.
        let rc = unsafe {
            libc::bind(
                self.fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ifindex)
    }

    fn setopt(&self, level: i32, name: i32, v: i32) -> io::Result<()> {
        crate::packet_ring::setopt(self.fd.as_raw_fd(), level, name, &v)
    }

    /// Frames the kernel dropped for this socket since the last call (its ring was full).
    fn take_drops(&self) -> u64 {
        crate::packet_ring::take_drops(self.fd.as_raw_fd())
    }

    fn send(&self, frame: &[u8]) -> bool {
        // SAFETY: frame valid for len bytes.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        n == frame.len() as isize
    }
}

/// The receiving side of a direction: every frame arriving on an interface (promiscuous, so
/// frames for the far end's MAC too), read from a shared-memory ring with the kernel's stamps.
pub struct Input {
    sock: RawSocket,
    ring: RxRing,
}

impl Input {
    pub fn open(ifname: &str) -> io::Result<Input> {
        let sock = RawSocket::open(ETH_P_ALL)?;
        // The ring before the bind: no frame may land in the ordinary receive queue.
        let ring = RxRing::new(
            sock.fd.as_raw_fd(),
            mtu(&sock, ifname)? + ETH_HDR + VLAN_HDR,
        )?;
        let ifindex = sock.bind(ifname, ETH_P_ALL)?;
        // Our own transmissions must not come back to us as input.
        sock.setopt(libc::SOL_PACKET, 23 /* PACKET_IGNORE_OUTGOING */, 1)?;
        // Frames for other MACs (the far end's) must reach us.
        // SAFETY: zeroed packet_mreq is valid; fields set below.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = ifindex;
        mreq.mr_type = libc::PACKET_MR_PROMISC as u16;
        // SAFETY: valid packet_mreq of the given size.
        let rc = unsafe {
            libc::setsockopt(
                sock.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_ADD_MEMBERSHIP,
                (&mreq as *const libc::packet_mreq).cast(),
                std::mem::size_of::<libc::packet_mreq>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // Stamped where the kernel receives the frame: the emulated delay starts there, not
        // when this thread gets round to reading it.
        sock.setopt(libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 1)?;
        Ok(Input { sock, ring })
    }
}

fn ifindex(ifname: &str) -> io::Result<i32> {
    let name =
        std::ffi::CString::new(ifname).map_err(|_| io::Error::other("bad interface name"))?;
    // SAFETY: valid C string.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::other(format!("no interface {ifname}"))),
        i => Ok(i as i32),
    }
}

/// The interface's MTU (the ring's slots hold a frame of that size).
fn mtu(sock: &RawSocket, ifname: &str) -> io::Result<usize> {
    // SAFETY: zeroed ifreq is valid; the name is copied in below (NUL-terminated by the zeroes).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if ifname.len() >= req.ifr_name.len() {
        return Err(io::Error::other(format!(
            "interface name too long: {ifname}"
        )));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads ifr_name and writes ifru_mtu of our ifreq.
    if unsafe { libc::ioctl(sock.fd.as_raw_fd(), libc::SIOCGIFMTU, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the union's MTU member.
    Ok(usize::try_from(unsafe { req.ifr_ifru.ifru_mtu }).unwrap_or(0))
}

/// Wait until one of `fds` is readable or `until` passes (nanosecond resolution); false on
/// timeout. Without `until`, wait at most `MAX_IDLE`.
fn wait_readable(fds: &[i32], until: Option<Instant>) -> bool {
    let timeout = until.map_or(MAX_IDLE, |u| u.saturating_duration_since(Instant::now()));
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; 2];
    for (p, fd) in pfds.iter_mut().zip(fds) {
        p.fd = *fd;
    }
    let n = fds.len().min(pfds.len());
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // SAFETY: valid pollfds; null sigmask.
    unsafe { libc::ppoll(pfds.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null()) > 0 }
}

/// An eventfd the control plane writes to wake a direction thread (a live change).
struct Wakeup {
    fd: OwnedFd,
}

impl Wakeup {
    fn new() -> Wakeup {
        // SAFETY: plain eventfd(2); failure only under fd exhaustion, which nothing survives.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
        // SAFETY: fresh descriptor we own.
        Wakeup {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        }
    }

    fn notify(&self) {
        let one = 1u64;
        // SAFETY: 8-byte write to our eventfd; a full counter (never here) only means awake.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn clear(&self) {
        let mut n = 0u64;
        // SAFETY: 8-byte read from our non-blocking eventfd.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
    }
}

/// Shared between a direction's thread and the control plane.
pub struct Direction {
    pub pending: Mutex<Option<LinkSpec>>,
    /// A new epoch for the recordings and slots (`Link::set_epoch`), on the wall clock.
    pub pending_epoch: Mutex<Option<std::time::SystemTime>>,
    pub spec: Mutex<LinkSpec>,
    pub stats: Mutex<LinkStats>,
    /// Frames that were not IP (ARP...), passed through unemulated.
    pub passthrough: Mutex<u64>,
    pub send_errors: Mutex<u64>,
    /// Frames the kernel dropped before this thread read them (its socket buffer was full).
    pub socket_drops: Mutex<u64>,
    /// Frames longer than the input interface's MTU allows (cut by the kernel, so dropped).
    pub oversize_drops: Mutex<u64>,
    wakeup: Wakeup,
}

impl Direction {
    pub fn new(spec: LinkSpec) -> Arc<Direction> {
        Arc::new(Direction {
            pending: Mutex::new(None),
            pending_epoch: Mutex::new(None),
            spec: Mutex::new(spec),
            stats: Mutex::new(LinkStats::default()),
            passthrough: Mutex::new(0),
            send_errors: Mutex::new(0),
            socket_drops: Mutex::new(0),
            oversize_drops: Mutex::new(0),
            wakeup: Wakeup::new(),
        })
    }

    /// Hand the thread a new spec; it applies it at once (also when it sleeps).
    pub fn set_pending(&self, spec: LinkSpec) {
        *lock(&self.pending) = Some(spec);
        self.wakeup.notify();
    }

    /// Hand the thread a new epoch (the scenario runner puts it where its traffic starts, so
    /// every system it compares meets the same part of a recording); applied at once.
    pub fn set_epoch(&self, wall: std::time::SystemTime) {
        *lock(&self.pending_epoch) = Some(wall);
        self.wakeup.notify();
    }

    /// A change handed over is not applied yet.
    pub fn changing(&self) -> bool {
        lock(&self.pending).is_some() || lock(&self.pending_epoch).is_some()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A path's NAT (`nat.rs`), shared by its two directions and the control plane; off until
/// `mpquic-lab nat NAME PATH on`.
pub struct PathNat {
    on: AtomicBool,
    nat: Mutex<Nat>,
}

impl PathNat {
    pub fn new(seed: u64) -> Arc<PathNat> {
        Arc::new(PathNat {
            on: AtomicBool::new(false),
            nat: Mutex::new(Nat::new(seed, None)),
        })
    }

    /// On (with mappings that expire after `timeout` idle, or never) or off (mappings
    /// forgotten, packets pass untranslated).
    pub fn set(&self, on: bool, timeout: Option<Duration>) {
        let mut nat = lock(&self.nat);
        nat.forget();
        nat.set_timeout(timeout);
        self.on.store(on, Ordering::Relaxed);
    }

    pub fn rebind(&self) -> Result<(), String> {
        if !self.on.load(Ordering::Relaxed) {
            return Err("the path has no NAT (mpquic-lab nat NAME PATH on)".into());
        }
        lock(&self.nat).rebind();
        Ok(())
    }

    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> NatStats {
        lock(&self.nat).stats
    }
}

/// Which side of a path's NAT a direction is: client to server (`Outbound`: source ports
/// mapped when a frame enters the link) or server to client (`Inbound`: mapped back when it
/// leaves the link, so a packet still in flight at a rebind finds its mapping gone).
pub enum NatSide {
    Outbound(Arc<PathNat>),
    Inbound(Arc<PathNat>),
}

/// One direction of a path: frames read from `input` go through the link model of `dir` and
/// leave on `output`.
pub struct DirectionIo {
    pub input: Input,
    pub output: RawSocket,
    pub dir: Arc<Direction>,
    pub seed: u64,
    pub nat: NatSide,
}

/// Forward one direction until `stop`, in rounds (`timing::plan`). One thread per direction:
/// a thread for both directions of a path saved few wake-ups (the CPU goes to handling frames,
/// above all to the receiving endpoint's network stack, which runs inside our send()) and capped
/// a path at ~0.9 Gbit/s with packets released 7.6 ms late on average.
pub fn run(io: DirectionIo, stop: Arc<AtomicBool>) {
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
    let mut f = Forwarder::new(io);
    // Deaf phase: control events only; listening: input too.
    let wake_fd = f.dir.wakeup.fd.as_raw_fd();
    let all_fds = [f.input.sock.fd.as_raw_fd(), wake_fd];
    let mut tuner = WakeTuner::default();
    while !stop.load(Ordering::Relaxed) {
        // What is due leaves first (its time is what the round was planned for), then the
        // input is read and what it made due (a link without delay) leaves too.
        f.apply_pending();
        f.release();
        let more = f.read_input();
        f.release();
        let now = Instant::now();
        f.publish_if_due(now);
        if more {
            continue;
        }
        let mut plan = timing::plan(now, &[f.times()], &tuner);
        if plan.listen_until.is_none() && f.published.dirty(&f.link, f.counters) {
            // Idle with counters not yet published: wake up to publish them.
            plan.listen_until = Some(f.published.due().unwrap_or(now));
        }
        if wait_readable(&[wake_fd], Some(plan.deaf_until)) {
            f.dir.wakeup.clear();
            continue;
        }
        let from = Instant::now();
        if wait_readable(&all_fds, plan.listen_until) {
            f.dir.wakeup.clear();
            continue;
        }
        if let Some(until) = plan.spin_until {
            let woke = Instant::now();
            let wake = plan.listen_until.unwrap_or(woke);
            tuner.observe(
                wake.saturating_duration_since(from),
                woke.saturating_duration_since(wake),
            );
            while Instant::now() < until {
                // Other emulator threads (same real-time priority) may run meanwhile.
                std::thread::yield_now();
            }
        }
    }
}

/// Counters the shell keeps beside the model's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ShellCounters {
    passthrough: u64,
    send_errors: u64,
    socket_drops: u64,
    oversize_drops: u64,
}

/// One direction's frames and model.
struct Forwarder {
    input: Input,
    output: RawSocket,
    dir: Arc<Direction>,
    link: Link<Vec<u8>>,
    /// Frame buffers to reuse.
    free: Vec<Vec<u8>>,
    out: Vec<Vec<u8>>,
    counters: ShellCounters,
    published: Published,
    /// Arrival times handed to the model never go backwards (stamps come from several CPUs).
    last_arrival: Instant,
    /// The last round that released a packet.
    last_release: Option<Instant>,
    nat: NatSide,
}

impl Forwarder {
    fn new(io: DirectionIo) -> Forwarder {
        let mut link = Link::new(lock(&io.dir.spec).clone(), io.seed);
        link.set_epoch(timing::minute_start(
            Instant::now(),
            std::time::SystemTime::now(),
        ));
        Forwarder {
            input: io.input,
            output: io.output,
            dir: io.dir,
            link,
            free: Vec::new(),
            out: Vec::new(),
            counters: ShellCounters::default(),
            published: Published::default(),
            last_arrival: Instant::now(),
            last_release: None,
            nat: io.nat,
        }
    }

    fn apply_pending(&mut self) {
        if let Some(spec) = lock(&self.dir.pending).take() {
            self.link.set_spec(spec.clone());
            *lock(&self.dir.spec) = spec;
        }
        if let Some(wall) = lock(&self.dir.pending_epoch).take() {
            let now = Instant::now();
            self.link
                .set_epoch(timing::instant_of(wall, now, std::time::SystemTime::now()));
        }
    }

    /// Hand the counters to the control plane every `Published::EVERY` while they change.
    fn publish_if_due(&mut self, now: Instant) {
        let p = &mut self.published;
        if p.due().is_some_and(|due| now < due) || !p.dirty(&self.link, self.counters) {
            return;
        }
        // Read (and reset) by the kernel; a full buffer only happens while frames arrive.
        self.counters.socket_drops += self.input.sock.take_drops();
        *lock(&self.dir.stats) = self.link.stats;
        *lock(&self.dir.passthrough) = self.counters.passthrough;
        *lock(&self.dir.send_errors) = self.counters.send_errors;
        *lock(&self.dir.socket_drops) = self.counters.socket_drops;
        *lock(&self.dir.oversize_drops) = self.counters.oversize_drops;
        (p.stats, p.counters) = (self.link.stats, self.counters);
        p.at = Some(now);
    }

    fn times(&self) -> LinkTimes {
        LinkTimes {
            deadline: self.link.next_deadline(),
            min_delay: self.link.min_delay(),
            slack: self.link.spec().slack,
            last_release: self.last_release,
        }
    }

    /// Most frames to read in one round, so deliveries keep flowing under load. True when more
    /// may be waiting.
    const READ_BUDGET: usize = 256;

    /// Read what has arrived into the model, at the kernel's arrival times.
    fn read_input(&mut self) -> bool {
        for _ in 0..Self::READ_BUDGET {
            let taken = self.input.ring.take(|rx| {
                if rx.truncated {
                    self.counters.oversize_drops += 1;
                    return;
                }
                let frame = rx.data;
                let ip = frame.get(ETH_HDR..).filter(|_| is_ip(frame));
                match ip.and_then(|p| PacketInfo::parse(p).map(|i| (p.len(), i))) {
                    Some((len, mut info)) => {
                        let mut v = self.free.pop().unwrap_or_default();
                        v.clear();
                        v.extend_from_slice(frame);
                        let now = Instant::now();
                        if let NatSide::Outbound(nat) = &self.nat {
                            if nat.is_on() {
                                lock(&nat.nat).outbound(&mut v[ETH_HDR..], now);
                                // The flow is its external port's from here on.
                                info = PacketInfo::parse(&v[ETH_HDR..]).unwrap_or(info);
                            }
                        }
                        let age = arrival_age(rx.stamp_ns, clock_ns(libc::CLOCK_REALTIME), || {
                            clock_ns(libc::CLOCK_MONOTONIC)
                        });
                        let arrival = age
                            .and_then(|a| now.checked_sub(a))
                            .unwrap_or(now)
                            .max(self.last_arrival);
                        self.last_arrival = arrival;
                        self.link.push(arrival, v, len, info.flow_hash());
                    }
                    None => {
                        self.counters.passthrough += 1;
                        if !self.output.send(frame) {
                            self.counters.send_errors += 1;
                        }
                    }
                }
            });
            if taken.is_none() {
                return false;
            }
        }
        true
    }

    /// Send every packet that is due.
    fn release(&mut self) {
        let now = Instant::now();
        self.link.poll(now, &mut self.out);
        if self.out.is_empty() {
            return;
        }
        self.last_release = Some(now);
        let mut nat = match &self.nat {
            NatSide::Inbound(nat) if nat.is_on() => Some(lock(&nat.nat)),
            _ => None,
        };
        for mut frame in self.out.drain(..) {
            // Frames in the model are IP frames (others pass through unemulated). One the NAT
            // has no mapping for is dropped (counted in its stats).
            let mapped = nat
                .as_mut()
                .is_none_or(|nat| nat.inbound(&mut frame[ETH_HDR..], now));
            if mapped && !self.output.send(&frame) {
                self.counters.send_errors += 1;
            }
            if self.free.len() < 4096 {
                self.free.push(frame);
            }
        }
    }
}

/// What the control plane has seen of a direction's counters, refreshed every `EVERY`.
#[derive(Default)]
struct Published {
    at: Option<Instant>,
    stats: LinkStats,
    counters: ShellCounters,
}

impl Published {
    const EVERY: Duration = Duration::from_millis(100);

    /// When the next publication is due; `None`: at once (never published).
    fn due(&self) -> Option<Instant> {
        self.at.map(|t| t + Self::EVERY)
    }

    fn dirty(&self, link: &Link<Vec<u8>>, counters: ShellCounters) -> bool {
        (link.stats, counters) != (self.stats, self.counters)
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
