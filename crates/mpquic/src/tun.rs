//! The TUN device and the few interface settings mpquic makes (MTU, IPv4 address, up), all by
//! ioctl: no `ip` commands. The device is not persistent, so it disappears, with its address and
//! connected route, when the process exits, however it exits.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use mpquic_core::PacketInfo;

use crate::batch::PacketBatch;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

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
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A socket to issue interface ioctls on.
fn ctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked and owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
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
}

enum Backend {
    Kernel(AsyncFd<OwnedFd>),
    /// Tests: the device's other side is the test (`memnet::Host`).
    #[cfg(test)]
    Memory(crate::memnet::MemTun),
}

impl Tun {
    /// Create (or attach to) the TUN device `name`, without packet information headers.
    pub fn create(name: &str) -> io::Result<Tun> {
        // SAFETY: open(2) with a constant path; result checked.
        let raw = unsafe {
            libc::open(
                c"/dev/net/tun".as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if raw < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("cannot open /dev/net/tun: {e}"),
            ));
        }
        // SAFETY: raw is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut r = IfReq::new(name)?;
        r.set_short(IFF_TUN | IFF_NO_PI);
        ioctl(fd.as_raw_fd(), TUNSETIFF, &mut r).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot create TUN device {name}: {e}"))
        })?;
        // SAFETY: `fd` is an owned, valid descriptor that stays open while the AsyncFd owns it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| io::Error::other(format!("cannot register TUN fd: {e}")))?;
        Ok(Tun {
            backend: Backend::Kernel(fd),
            name: name.to_string(),
        })
    }

    #[cfg(test)]
    pub fn memory(name: &str, dev: crate::memnet::MemTun) -> Tun {
        Tun {
            backend: Backend::Memory(dev),
            name: name.to_string(),
        }
    }

    /// The tunnel carries IPv4 only for now: without this the kernel would send IPv6 router
    /// solicitations and MLD reports into the tunnel, which the server counts as spoofed.
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

    fn up(&self, s: &OwnedFd) -> io::Result<()> {
        let mut r = IfReq::new(&self.name)?;
        ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r)?;
        let flags = r.short() | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        r.set_short(flags);
        ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &mut r)
    }

    /// One read(2) without waiting: `Ok(None)` when nothing is queued.
    fn try_read(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // Outside tests the match has one arm; it keeps one code path for both builds.
        #[allow(clippy::infallible_destructuring_match)]
        let fd = match &self.backend {
            Backend::Kernel(fd) => fd,
            #[cfg(test)]
            Backend::Memory(m) => return m.try_recv(buf),
        };
        // SAFETY: buf is valid for buf.len() bytes.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(e)
        }
    }

    /// Fill `batch` with what the device has queued: waits for the first packet, then reads
    /// until the queue is empty or the batch is full (one wake-up, many packets). Packets of
    /// `mtu` bytes at most; a longer one (the MTU was lowered under us) is dropped and returned
    /// in the count of oversized packets, for the caller to count.
    pub async fn read_batch(&self, batch: &mut PacketBatch, mtu: usize) -> io::Result<u64> {
        let mut oversized = 0;
        loop {
            let mut guard = match &self.backend {
                Backend::Kernel(fd) => Some(fd.readable().await?),
                #[cfg(test)]
                Backend::Memory(m) => {
                    m.readable().await;
                    None
                }
            };
            while !batch.is_full() {
                // One byte more than the MTU: a read that fills it was longer than allowed.
                let read = match self.try_read(batch.slot(mtu + 1)) {
                    Ok(r) => r,
                    // What was read before the error goes out first; the error comes back on
                    // the next read.
                    Err(_) if !batch.is_empty() || oversized > 0 => break,
                    Err(e) => return Err(e),
                };
                match read {
                    Some(n) if n > mtu => oversized += 1,
                    Some(n) => batch.commit(n),
                    None => {
                        // Drained: the next wait is for new packets.
                        if let Some(g) = guard.as_mut() {
                            g.clear_ready();
                        }
                        break;
                    }
                }
            }
            if !batch.is_empty() || oversized > 0 {
                return Ok(oversized);
            }
        }
    }

    /// Read packets forever, a batch per wake-up; clamp the MSS of TCP SYNs to `mss`, and hand
    /// each batch with its packets' parsed headers to `f`. The one TUN read loop of client and
    /// server.
    pub async fn read_loop(
        &self,
        mtu: u32,
        mss: u16,
        mut f: impl FnMut(&mut PacketBatch, &[Option<PacketInfo>], u64),
    ) {
        let mut batch = PacketBatch::new();
        let mut infos: Vec<Option<PacketInfo>> = Vec::with_capacity(crate::batch::BATCH_PACKETS);
        loop {
            batch.clear();
            let oversized = match self.read_batch(&mut batch, mtu as usize).await {
                Ok(n) => n,
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
            f(&mut batch, &infos, oversized);
        }
    }

    /// Write one packet without waiting. A TUN write only fails when the kernel cannot take the
    /// packet (the caller counts it as a drop); it does not block.
    pub fn send(&self, pkt: &[u8]) -> io::Result<usize> {
        // Outside tests the match has one arm; it keeps one code path for both builds.
        #[allow(clippy::infallible_destructuring_match)]
        let fd = match &self.backend {
            Backend::Kernel(fd) => fd,
            #[cfg(test)]
            Backend::Memory(m) => return m.send(pkt),
        };
        // SAFETY: pkt is valid for pkt.len() bytes.
        let n = unsafe { libc::write(fd.as_raw_fd(), pkt.as_ptr().cast(), pkt.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}
