//! The few interface settings mpquic makes, all by ioctl on the interface's name (no `ip`
//! commands): a TUN device's MTU, addresses, routes and up state, and what the client reads of a
//! WAN interface (its MTU, its IPv4 address).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use mpquic_core::classify::Prefix;

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
pub fn mtu(name: &str) -> io::Result<u32> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFMTU, &mut r)?;
    Ok(r.int() as u32)
}

/// First IPv4 address of an existing interface.
pub fn first_ipv4(name: &str) -> io::Result<Ipv4Addr> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFADDR, &mut r)?;
    Ok(r.v4())
}

/// IPv6 is off until the device gets an IPv6 address (`set_ipv6`; IPv4-only tunnels
/// never do): without this the kernel would send IPv6 router solicitations and MLD reports
/// into the tunnel, which the server counts as spoofed.
pub fn disable_ipv6(name: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", name);
    // Absent when the kernel has no IPv6; nothing to do then.
    let _ = std::fs::write(path, "1");
}

pub fn set_mtu(name: &str, mtu: u32) -> io::Result<()> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    r.set_int(mtu as libc::c_int);
    ioctl(s.as_raw_fd(), libc::SIOCSIFMTU, &mut r)
}

/// Assign the IPv4 address and prefix and bring the device up; the kernel adds the
/// connected route for the prefix.
pub fn set_ipv4(name: &str, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    r.set_v4(addr);
    ioctl(s.as_raw_fd(), libc::SIOCSIFADDR, &mut r)?;
    let mut r = IfReq::new(name)?;
    r.set_v4(Ipv4Addr::from(crate::config::mask(prefix)));
    ioctl(s.as_raw_fd(), libc::SIOCSIFNETMASK, &mut r)?;
    up(name, &s)
}

/// Assign the IPv6 address and prefix (a dual-stack tunnel); the kernel adds the connected
/// route when the device is up (`set_ipv4`, after this). The device gets no link-local
/// address (`addr_gen_mode` 1), so the kernel sends no router solicitations from it, and a
/// TUN device (NOARP) joins no solicited-node group: nothing but the tunnel's own traffic
/// goes in.
pub fn set_ipv6(name: &str, addr: Ipv6Addr, prefix: u8) -> io::Result<()> {
    let conf = |key: &str, v: &str| {
        let path = format!("/proc/sys/net/ipv6/conf/{}/{key}", name);
        std::fs::write(&path, v).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot enable IPv6 on {} ({path}): {e}", name),
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
        ifr6_ifindex: ifindex(name)?,
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
                format!("cannot set {addr}/{prefix} on {}: {e}", name),
            )),
        },
    }
}

/// Route `lan` into this device (SIOCADDRT; a route that is already there is fine): the
/// server's routes to its clients' site LANs (routed LANs), IPv4 or IPv6.
pub fn add_route(name: &str, lan: &Prefix) -> io::Result<()> {
    route(name, libc::SIOCADDRT, lan)
}

/// Take the route `lan` out of this device (SIOCDELRT; one that is not there is fine): a
/// site LAN no client may announce any longer (a reload).
pub fn del_route(name: &str, lan: &Prefix) -> io::Result<()> {
    route(name, libc::SIOCDELRT, lan)
}

fn route(name: &str, op: libc::c_ulong, lan: &Prefix) -> io::Result<()> {
    let done = match lan.addr {
        IpAddr::V4(net) => route4(name, op, net, lan.len),
        IpAddr::V6(net) => route6(name, op, net, lan.len),
    };
    match done {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) && op == libc::SIOCADDRT => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) && op == libc::SIOCDELRT => Ok(()),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("cannot change the route {lan} of {}: {e}", name),
        )),
        Ok(()) => Ok(()),
    }
}

/// The IPv4 route ioctl (struct rtentry).
fn route4(name: &str, op: libc::c_ulong, net: Ipv4Addr, len: u8) -> io::Result<()> {
    let sockaddr = |a: Ipv4Addr| {
        // SAFETY: sockaddr_in and sockaddr are plain C structs of the same size; all-zero
        // is a valid value of both.
        let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sin.sin_family = libc::AF_INET as libc::sa_family_t;
        sin.sin_addr.s_addr = u32::from(a).to_be();
        unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
    };
    let dev = std::ffi::CString::new(name.to_string())
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
fn route6(name: &str, op: libc::c_ulong, net: Ipv6Addr, len: u8) -> io::Result<()> {
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
        ifindex: ifindex(name)?,
    };
    let s6 = socket_of(libc::AF_INET6)?;
    // SAFETY: `msg` has the layout of the kernel's struct in6_rtmsg, which SIOCADDRT /
    // SIOCDELRT read on an AF_INET6 socket.
    let rc = unsafe { libc::ioctl(s6.as_raw_fd(), op as _, &msg) };
    os_result(rc)
}

/// The device's interface index (IPv6 ioctls name the device by it).
fn ifindex(name: &str) -> io::Result<libc::c_int> {
    let s = ctl_socket()?;
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFINDEX, &mut r)?;
    Ok(r.int())
}

/// Up, and without IFF_MULTICAST: the tunnel carries unicast only (a multicast destination
/// has no session), and a multicast device gets the kernel's group reports written into it,
/// e.g. an MLD report from `::` to ff02::16 as soon as IPv6 forwarding is turned on, which
/// the peer could only drop and count (`spoofed_source`, `no_route`).
fn up(name: &str, s: &OwnedFd) -> io::Result<()> {
    let mut r = IfReq::new(name)?;
    ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r)?;
    let flags = (r.short() | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short)
        & !(libc::IFF_MULTICAST as libc::c_short);
    r.set_short(flags);
    ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &mut r)
}
