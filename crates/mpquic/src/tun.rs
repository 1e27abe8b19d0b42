//! The TUN device and the few interface settings mpquic makes (MTU, IPv4 address, up), all by
//! ioctl: no `ip` commands. The device is not persistent, so it disappears, with its address and
//! connected route, when the process exits, however it exits.
//!
//! The device is opened by tun-rs, with offloads by default (IFF_VNET_HDR, TSO/USO and checksum
//! offload): a read may be a 64 KB super-packet of one flow, which tun-rs splits into segments of
//! the flow's MSS (its port of wireguard-go's); what the tunnel delivers is queued (`queue`) into
//! `mpquic_core::coalesce`, which joins consecutive segments of a flow as they come, and written
//! at the end of a receive wake-up (`flush`). Either way the kernel's stack runs once per
//! super-packet instead of once per packet. (tun-rs's own coalescing copies and allocates every
//! packet once more; ours copies each packet once, into its write.)

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use mpquic_core::classify::Prefix;
use mpquic_core::PacketInfo;

use std::sync::Mutex;

use crate::batch::PacketBatch;

/// The kernel's `struct in6_rtmsg` (linux/ipv6_route.h): libc declares it with private
/// fields, so it cannot be built from there.
#[repr(C)]
struct In6Rtmsg {
    dst: libc::in6_addr,
    src: libc::in6_addr,
    gateway: libc::in6_addr,
    kind: u32,
    dst_len: u16,
    src_len: u16,
    metric: u32,
    info: libc::c_ulong,
    flags: u32,
    ifindex: libc::c_int,
}

/// `struct ifreq`: 16-byte name and a 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> io::Result<IfReq> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad interface name `{name}`"),
            ));
        }
        let mut r = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        r.name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(r)
    }
    fn set_short(&mut self, v: libc::c_short) {
        self.data[..2].copy_from_slice(&v.to_ne_bytes());
    }
    fn short(&self) -> libc::c_short {
        libc::c_short::from_ne_bytes([self.data[0], self.data[1]])
    }
    fn set_int(&mut self, v: libc::c_int) {
        self.data[..4].copy_from_slice(&v.to_ne_bytes());
    }
    fn int(&self) -> libc::c_int {
        libc::c_int::from_ne_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
    fn set_v4(&mut self, a: Ipv4Addr) {
        // struct sockaddr_in: family, port, address.
        self.data = [0; 24];
        self.data[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        self.data[4..8].copy_from_slice(&a.octets());
    }
    fn v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.data[4], self.data[5], self.data[6], self.data[7])
    }
}

fn ioctl(fd: RawFd, req: libc::c_ulong, r: &mut IfReq) -> io::Result<()> {
    // SAFETY: `r` is a valid, properly sized `struct ifreq` for every request used here.
    let rc = unsafe { libc::ioctl(fd, req as _, r as *mut IfReq) };
    os_result(rc)
}

/// A system call's return code as a result, the error taken from errno at once (before any
/// other call, such as closing a socket, can change it).
fn os_result(rc: libc::c_int) -> io::Result<()> {
    match rc < 0 {
        true => Err(io::Error::last_os_error()),
        false => Ok(()),
    }
}

/// A socket to issue interface ioctls on.
fn ctl_socket() -> io::Result<OwnedFd> {
    socket_of(libc::AF_INET)
}

fn socket_of(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked and owned.
    let fd = unsafe { libc::socket(family, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// MTU of an existing interface.
pub fn interface_mtu(name: &str) -> io::Result<u32> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFMTU, &mut r)?;
    Ok(r.int() as u32)
}

/// First IPv4 address of an existing interface.
pub fn interface_v4(name: &str) -> io::Result<Ipv4Addr> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFADDR, &mut r)?;
    Ok(r.v4())
}

pub struct Tun {
    backend: Backend,
    name: String,
    /// What the tunnel delivered and has not written yet (`queue`, `flush`).
    outbox: Mutex<Outbox>,
}

enum Backend {
    /// A kernel TUN device through tun-rs: with `offload`, IFF_VNET_HDR and the kernel's TSO/USO
    /// and checksum offloads, so one read can be a 64 KB super-packet of a flow (split here into
    /// segments) and one write can carry many coalesced segments (GRO).
    Kernel(tun_rs::AsyncDevice),
    /// Tests: the device's other side is the test (`memnet::Host`).
    #[cfg(test)]
    Memory(crate::memnet::MemTun),
}

/// Segments one TUN read yields at most: a 64 KB super-packet cut at the flow's MSS. The kernel
/// sends super-packets only for MSS of ~512 bytes and more (65535 / 128); a smaller MSS is
/// refused by the split and counted as malformed (wireguard-go has the same bound).
const MAX_SEGMENTS: usize = tun_rs::IDEAL_BATCH_SIZE;
/// Packets queued for writing at most; a full outbox is written before it takes more.
const OUTBOX_PACKETS: usize = 128;
/// Bytes of the virtio header in front of every read and write with offloads.
const VNET: usize = mpquic_core::coalesce::VNET_HDR;

/// What the tunnel delivered and has not written yet: coalesced per flow as it comes
/// (`mpquic_core::coalesce`), written in arrival order.
type Outbox = mpquic_core::coalesce::Coalescer;

/// Packets a TUN write refused: how many and why (the kernel's error).
#[derive(Debug)]
pub struct Refused {
    pub packets: u64,
    pub error: io::Error,
}

/// A reader's buffers for offloaded reads: the raw read (virtio header and up to 64 KB) and
/// the segments it is split into, before they are copied into the batch.
pub struct ReadScratch {
    raw: Vec<u8>,
    segments: Vec<u8>,
    sizes: [usize; MAX_SEGMENTS],
}

impl ReadScratch {
    pub fn new() -> ReadScratch {
        ReadScratch {
            raw: vec![0; VNET + 65535],
            segments: Vec::new(),
            sizes: [0; MAX_SEGMENTS],
        }
    }
}

impl Default for ReadScratch {
    fn default() -> Self {
        ReadScratch::new()
    }
}

impl Tun {
    /// Create the TUN device `name` with `queues` queues (`queue_count`), without packet
    /// information headers; with `offload`, with the virtio header and the kernel's
    /// segmentation and checksum offloads. Each queue is a `Tun` of its own (its descriptor and
    /// its outbox); the first one also sets the device up (MTU, address).
    ///
    /// Why queues: with more than one (IFF_MULTI_QUEUE) the kernel hands each flow's packets to
    /// one queue (by flow hash, or to the queue that last wrote the flow's other direction), so
    /// one reader per queue spreads the device's reads over the runtime's threads without
    /// reordering a flow, and writers of different queues never share an outbox lock.
    pub fn create(name: &str, offload: bool, queues: usize) -> io::Result<Vec<Tun>> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad interface name `{name}`"),
            ));
        }
        let dev = tun_rs::DeviceBuilder::new()
            .name(name)
            .offload(offload)
            .multi_queue(queues > 1)
            // Down until `set_ipv4`: up before `disable_ipv6`, the kernel sent an IPv6 router
            // solicitation into the device (ff02::2), which the server counted as no_route.
            .enable(false)
            .build_async()
            .map_err(|e| {
                io::Error::new(e.kind(), format!("cannot create TUN device {name}: {e}"))
            })?;
        let mut more = Vec::with_capacity(queues.saturating_sub(1));
        for q in 1..queues {
            more.push(dev.try_clone().map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot open queue {q} of TUN device {name}: {e}"),
                )
            })?);
        }
        Ok(std::iter::once(dev)
            .chain(more)
            .map(|d| Tun::with_backend(name, Backend::Kernel(d)))
            .collect())
    }

    fn with_backend(name: &str, backend: Backend) -> Tun {
        let mut tun = Tun {
            backend,
            name: name.to_string(),
            outbox: Mutex::default(),
        };
        // The outbox joins what the device takes joined.
        tun.outbox = Mutex::new(Outbox::new(tun.offload(), tun.udp_offload()));
        tun
    }

    /// Whether reads and writes carry the virtio header (offloads on).
    pub fn offload(&self) -> bool {
        match &self.backend {
            Backend::Kernel(d) => d.tcp_gso(),
            #[cfg(test)]
            Backend::Memory(_) => false,
        }
    }

    /// Whether the kernel takes coalesced UDP too (USO, Linux 6.2 and later).
    pub fn udp_offload(&self) -> bool {
        match &self.backend {
            Backend::Kernel(d) => d.udp_gso(),
            #[cfg(test)]
            Backend::Memory(_) => false,
        }
    }

    #[cfg(test)]
    pub fn memory(name: &str, dev: crate::memnet::MemTun) -> Tun {
        Tun::with_backend(name, Backend::Memory(dev))
    }

    /// IPv6 is off until the device gets an IPv6 address (`set_ipv6`; IPv4-only tunnels
    /// never do): without this the kernel would send IPv6 router solicitations and MLD reports
    /// into the tunnel, which the server counts as spoofed.
    pub fn disable_ipv6(&self) {
        if !matches!(self.backend, Backend::Kernel(_)) {
            return;
        }
        let path = format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", self.name);
        // Absent when the kernel has no IPv6; nothing to do then.
        let _ = std::fs::write(path, "1");
    }

    pub fn set_mtu(&self, mtu: u32) -> io::Result<()> {
        #[cfg(test)]
        if let Backend::Memory(_) = &self.backend {
            return Ok(());
        }
        let s = ctl_socket()?;
        let mut r = IfReq::new(&self.name)?;
        r.set_int(mtu as libc::c_int);
        ioctl(s.as_raw_fd(), libc::SIOCSIFMTU, &mut r)
    }

    /// Assign the IPv4 address and prefix and bring the device up; the kernel adds the
    /// connected route for the prefix.
    pub fn set_ipv4(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        #[cfg(test)]
        if let Backend::Memory(m) = &self.backend {
            m.set_ipv4(addr, prefix);
            return Ok(());
        }
        let s = ctl_socket()?;
        let mut r = IfReq::new(&self.name)?;
        r.set_v4(addr);
        ioctl(s.as_raw_fd(), libc::SIOCSIFADDR, &mut r)?;
        let mut r = IfReq::new(&self.name)?;
        r.set_v4(Ipv4Addr::from(crate::config::mask(prefix)));
        ioctl(s.as_raw_fd(), libc::SIOCSIFNETMASK, &mut r)?;
        self.up(&s)
    }

    /// Assign the IPv6 address and prefix (a dual-stack tunnel); the kernel adds the connected
    /// route when the device is up (`set_ipv4`, after this). The device gets no link-local
    /// address (`addr_gen_mode` 1), so the kernel sends no router solicitations from it, and a
    /// TUN device (NOARP) joins no solicited-node group: nothing but the tunnel's own traffic
    /// goes in.
    pub fn set_ipv6(&self, addr: Ipv6Addr, prefix: u8) -> io::Result<()> {
        #[cfg(test)]
        if let Backend::Memory(_) = &self.backend {
            return Ok(());
        }
        let conf = |key: &str, v: &str| {
            let path = format!("/proc/sys/net/ipv6/conf/{}/{key}", self.name);
            std::fs::write(&path, v).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot enable IPv6 on {} ({path}): {e}", self.name),
                )
            })
        };
        conf("addr_gen_mode", "1")?;
        conf("router_solicitations", "0")?;
        conf("disable_ipv6", "0")?;
        let req = libc::in6_ifreq {
            ifr6_addr: libc::in6_addr {
                s6_addr: addr.octets(),
            },
            ifr6_prefixlen: u32::from(prefix),
            ifr6_ifindex: self.ifindex()?,
        };
        let s6 = socket_of(libc::AF_INET6)?;
        // SAFETY: `req` is a valid struct in6_ifreq for SIOCSIFADDR on an AF_INET6 socket.
        let rc = unsafe { libc::ioctl(s6.as_raw_fd(), libc::SIOCSIFADDR as _, &req) };
        match rc {
            0 => Ok(()),
            _ => match io::Error::last_os_error() {
                e if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
                e => Err(io::Error::new(
                    e.kind(),
                    format!("cannot set {addr}/{prefix} on {}: {e}", self.name),
                )),
            },
        }
    }

    /// Route `lan` into this device (SIOCADDRT; a route that is already there is fine): the
    /// server's routes to its clients' site LANs (routed LANs), IPv4 or IPv6.
    pub fn add_route(&self, lan: &Prefix) -> io::Result<()> {
        self.route(libc::SIOCADDRT, lan)
    }

    /// Take the route `lan` out of this device (SIOCDELRT; one that is not there is fine): a
    /// site LAN no client may announce any longer (a reload).
    pub fn del_route(&self, lan: &Prefix) -> io::Result<()> {
        self.route(libc::SIOCDELRT, lan)
    }

    fn route(&self, op: libc::c_ulong, lan: &Prefix) -> io::Result<()> {
        #[cfg(test)]
        if let Backend::Memory(_) = &self.backend {
            return Ok(());
        }
        let done = match lan.addr {
            IpAddr::V4(net) => self.route4(op, net, lan.len),
            IpAddr::V6(net) => self.route6(op, net, lan.len),
        };
        match done {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && op == libc::SIOCADDRT => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) && op == libc::SIOCDELRT => Ok(()),
            Err(e) => Err(io::Error::new(
                e.kind(),
                format!("cannot change the route {lan} of {}: {e}", self.name),
            )),
            Ok(()) => Ok(()),
        }
    }

    /// The IPv4 route ioctl (struct rtentry).
    fn route4(&self, op: libc::c_ulong, net: Ipv4Addr, len: u8) -> io::Result<()> {
        let sockaddr = |a: Ipv4Addr| {
            // SAFETY: sockaddr_in and sockaddr are plain C structs of the same size; all-zero
            // is a valid value of both.
            let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from(a).to_be();
            unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
        };
        let dev = std::ffi::CString::new(self.name.clone())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "device name"))?;
        // SAFETY: all-zero is a valid rtentry; the pointers it gets (the device name) outlive
        // the ioctl below.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr(net);
        rt.rt_genmask = sockaddr(Ipv4Addr::from(crate::config::mask(len)));
        rt.rt_flags = libc::RTF_UP;
        rt.rt_dev = dev.as_ptr() as *mut libc::c_char;
        let s = ctl_socket()?;
        // SAFETY: `rt` is a valid struct rtentry for SIOCADDRT / SIOCDELRT.
        let rc = unsafe { libc::ioctl(s.as_raw_fd(), op as _, &mut rt) };
        os_result(rc)
    }

    /// The IPv6 route ioctl (struct in6_rtmsg on an AF_INET6 socket, the device by index, the
    /// kernel's default metric for user routes).
    fn route6(&self, op: libc::c_ulong, net: Ipv6Addr, len: u8) -> io::Result<()> {
        let msg = In6Rtmsg {
            dst: libc::in6_addr {
                s6_addr: net.octets(),
            },
            src: libc::in6_addr { s6_addr: [0; 16] },
            gateway: libc::in6_addr { s6_addr: [0; 16] },
            kind: 0,
            dst_len: u16::from(len),
            src_len: 0,
            metric: 0,
            info: 0,
            flags: libc::RTF_UP as u32,
            ifindex: self.ifindex()?,
        };
        let s6 = socket_of(libc::AF_INET6)?;
        // SAFETY: `msg` has the layout of the kernel's struct in6_rtmsg, which SIOCADDRT /
        // SIOCDELRT read on an AF_INET6 socket.
        let rc = unsafe { libc::ioctl(s6.as_raw_fd(), op as _, &msg) };
        os_result(rc)
    }

    /// The device's interface index (IPv6 ioctls name the device by it).
    fn ifindex(&self) -> io::Result<libc::c_int> {
        let s = ctl_socket()?;
        let mut r = IfReq::new(&self.name)?;
        ioctl(s.as_raw_fd(), libc::SIOCGIFINDEX, &mut r)?;
        Ok(r.int())
    }

    /// Up, and without IFF_MULTICAST: the tunnel carries unicast only (a multicast destination
    /// has no session), and a multicast device gets the kernel's group reports written into it,
    /// e.g. an MLD report from `::` to ff02::16 as soon as IPv6 forwarding is turned on, which
    /// the peer could only drop and count (`spoofed_source`, `no_route`).
    fn up(&self, s: &OwnedFd) -> io::Result<()> {
        let mut r = IfReq::new(&self.name)?;
        ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r)?;
        let flags = (r.short() | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short)
            & !(libc::IFF_MULTICAST as libc::c_short);
        r.set_short(flags);
        ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &mut r)
    }

    /// Fill `batch` with what the device has queued: waits for the first read, then reads
    /// until the device is drained or the batch has `BATCH_PACKETS` (one wake-up, many
    /// packets; one offloaded read may add a super-packet's segments beyond that). Packets of
    /// `mtu` bytes at most; longer ones (the MTU was lowered under us) and reads that could not
    /// be split are dropped and returned in the counts, for the caller to count.
    pub async fn read_batch(
        &self,
        batch: &mut PacketBatch,
        scratch: &mut ReadScratch,
        mtu: usize,
    ) -> io::Result<ReadDrops> {
        let mut drops = ReadDrops::default();
        loop {
            match &self.backend {
                Backend::Kernel(dev) => dev.readable().await?,
                #[cfg(test)]
                Backend::Memory(m) => m.readable().await,
            }
            while !batch.is_full() {
                match self.try_read(batch, scratch, mtu, &mut drops) {
                    Ok(true) => {}
                    // Drained: the next wait is for new packets.
                    Ok(false) => break,
                    // What was read before the error goes out first; the error comes back on
                    // the next read.
                    Err(_) if !batch.is_empty() || drops.any() => break,
                    Err(e) => return Err(e),
                }
            }
            if !batch.is_empty() || drops.any() {
                return Ok(drops);
            }
        }
    }

    /// One read without waiting, its packets (a super-packet's segments) into `batch`:
    /// `Ok(false)` when nothing is queued.
    fn try_read(
        &self,
        batch: &mut PacketBatch,
        scratch: &mut ReadScratch,
        mtu: usize,
        drops: &mut ReadDrops,
    ) -> io::Result<bool> {
        // One byte more than the MTU: a packet that fills its slot was longer than allowed.
        let stride = mtu + 1;
        // Outside tests the match has one arm; it keeps one code path for both builds.
        #[allow(clippy::infallible_destructuring_match)]
        let dev = match &self.backend {
            Backend::Kernel(dev) => dev,
            #[cfg(test)]
            Backend::Memory(m) => {
                let read = m.try_recv(batch.slot(stride));
                return match read? {
                    Some(n) if n > mtu => {
                        drops.oversized += 1;
                        Ok(true)
                    }
                    Some(n) => {
                        batch.commit(n);
                        Ok(true)
                    }
                    None => Ok(false),
                };
            }
        };
        if scratch.segments.len() != stride * MAX_SEGMENTS {
            scratch.segments = vec![0; stride * MAX_SEGMENTS];
        }
        let mut chunks = scratch.segments.chunks_exact_mut(stride);
        let mut slots: [&mut [u8]; MAX_SEGMENTS] =
            std::array::from_fn(|_| chunks.next().unwrap_or_default());
        let n = match dev.try_recv_multiple(&mut scratch.raw, &mut slots, &mut scratch.sizes, 0) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            // The read worked but its packet could not be split (a malformed virtio header,
            // more segments than MAX_SEGMENTS, a segment longer than the MTU).
            Err(e) if e.raw_os_error().is_none() => {
                tracing::debug!(tun = %self.name, error = %e, "TUN super-packet dropped");
                drops.unsplit += 1;
                return Ok(true);
            }
            Err(e) => return Err(e),
        };
        for (slot, &len) in slots.iter().zip(&scratch.sizes).take(n) {
            if len > mtu {
                drops.oversized += 1;
            } else {
                batch.push(&slot[..len]);
            }
        }
        Ok(true)
    }

    /// Read packets forever, a batch per wake-up; clamp the MSS of TCP SYNs to `mss`, and hand
    /// each batch with its packets' parsed headers to `f`. The one TUN read loop of client and
    /// server.
    pub async fn read_loop(
        &self,
        mtu: u32,
        mss: u16,
        mut f: impl FnMut(&mut PacketBatch, &[Option<PacketInfo>], ReadDrops),
    ) {
        let mut batch = PacketBatch::new();
        let mut scratch = ReadScratch::new();
        let mut infos: Vec<Option<PacketInfo>> = Vec::with_capacity(crate::batch::BATCH_PACKETS);
        loop {
            batch.clear();
            let drops = match self
                .read_batch(&mut batch, &mut scratch, mtu as usize)
                .await
            {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(tun = %self.name, error = %e, "TUN read failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            infos.clear();
            for i in 0..batch.len() {
                let pkt = batch.packet_mut(i).expect("nothing taken yet");
                let info = PacketInfo::parse(pkt);
                if let Some(info) = &info {
                    // Only the MSS option and the TCP checksum change: `info` stays valid.
                    info.clamp_mss(pkt, mss);
                }
                infos.push(info);
            }
            f(&mut batch, &infos, drops);
        }
    }

    /// Queue one packet for the device; it is written by the next `flush` (or now, when the
    /// outbox is full: then what that write refused is returned).
    pub fn queue(&self, pkt: &[u8]) -> Option<Refused> {
        let mut out = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        let refused = if out.packets() == OUTBOX_PACKETS {
            self.write_out(&mut out)
        } else {
            None
        };
        out.push(pkt);
        refused
    }

    /// Write what is queued, coalesced where the device takes super-packets. Writers keep
    /// their order: the outbox stays locked while it is written.
    pub fn flush(&self) -> Option<Refused> {
        let mut out = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        self.write_out(&mut out)
    }

    /// One packet now: queued and written with whatever was queued before it.
    pub fn send(&self, pkt: &[u8]) -> Option<Refused> {
        let first = self.queue(pkt);
        let second = self.flush();
        match (first, second) {
            (Some(mut a), Some(b)) => {
                a.packets += b.packets;
                Some(a)
            }
            (a, b) => a.or(b),
        }
    }

    /// Each of the outbox's writes (a packet or a super-packet): a TUN write only fails when
    /// the kernel cannot take it (the packets it carries are counted, the last error kept); it
    /// does not block.
    fn write_out(&self, out: &mut Outbox) -> Option<Refused> {
        if out.packets() == 0 {
            return None;
        }
        let mut refused: Option<Refused> = None;
        for (w, packets) in out.writes() {
            if let Err(error) = self.write(w) {
                let r = refused.get_or_insert(Refused { packets: 0, error });
                r.packets += packets as u64;
            }
        }
        out.clear();
        refused
    }

    /// One write: the virtio header and the packet with offloads, the packet alone without.
    fn write(&self, w: &[u8]) -> io::Result<usize> {
        let (fd, bytes) = match &self.backend {
            Backend::Kernel(dev) if dev.tcp_gso() => (dev.as_raw_fd(), w),
            Backend::Kernel(dev) => (dev.as_raw_fd(), &w[VNET..]),
            #[cfg(test)]
            Backend::Memory(m) => return m.send(&w[VNET..]),
        };
        // SAFETY: `bytes` is valid for `bytes.len()` bytes; `fd` is the open TUN device.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

/// Packets a wake-up of the reader dropped before they reached the batch.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReadDrops {
    /// Longer than the MTU.
    pub oversized: u64,
    /// Offloaded reads whose super-packet could not be split into segments.
    pub unsplit: u64,
}

impl ReadDrops {
    fn any(&self) -> bool {
        self.oversized + self.unsplit > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_packets_wait_for_the_flush_and_keep_their_order() {
        let net = crate::memnet::Network::new();
        let mut host = net.host("t0");
        let tun = net.tun("t0").unwrap();
        for i in 0..3u8 {
            assert!(tun.queue(&[i; 40]).is_none());
        }
        assert!(
            host.from_dev.try_recv().is_err(),
            "nothing before the flush"
        );
        assert!(tun.flush().is_none());
        for i in 0..3u8 {
            assert_eq!(host.from_dev.try_recv().unwrap(), vec![i; 40]);
        }
        // A full outbox is written before it takes more: memory stays bounded without a flush.
        for i in 0..=OUTBOX_PACKETS {
            assert!(tun.queue(&[i as u8; 60]).is_none());
        }
        for i in 0..OUTBOX_PACKETS {
            assert_eq!(host.from_dev.try_recv().unwrap(), vec![i as u8; 60]);
        }
        assert!(host.from_dev.try_recv().is_err());
        // `send` writes at once, behind what was queued.
        assert!(tun.send(&[0xee; 20]).is_none());
        assert_eq!(
            host.from_dev.try_recv().unwrap(),
            vec![OUTBOX_PACKETS as u8; 60]
        );
        assert_eq!(host.from_dev.try_recv().unwrap(), vec![0xee; 20]);
    }

    #[test]
    fn refused_writes_are_counted_with_the_error() {
        let net = crate::memnet::Network::new();
        let host = net.host("t1");
        let tun = net.tun("t1").unwrap();
        drop(host); // nobody reads: every write is refused
        tun.queue(&[1; 40]);
        tun.queue(&[2; 40]);
        let r = tun.flush().expect("refused");
        assert_eq!(r.packets, 2);
        assert!(tun.flush().is_none(), "refused packets are not retried");
    }
}
