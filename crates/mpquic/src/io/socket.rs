//! The UDP sockets of paths and listener: bound to the path's interface or address, with
//! kernel buffers large enough for bursts at Gbit/s rates.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;

use anyhow::{Context, Result};
use socket2::{Domain, Protocol, Socket, Type};
use tracing::warn;

use crate::config::Bind;
use crate::io::interface;

/// Path MTU assumed when it cannot be read from the interface.
pub const DEFAULT_LINK_MTU: u32 = 1500;

/// Larger kernel socket buffers absorb bursts at Gbit/s rates; as root the sysctl cap is bypassed.
fn grow_buffers(s: &Socket) {
    let size: libc::c_int = 8 << 20;
    for (force, normal) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: setsockopt with a valid int option value on an owned socket.
        let rc = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                force,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            let _ = if normal == libc::SO_RCVBUF {
                s.set_recv_buffer_size(size as usize)
            } else {
                s.set_send_buffer_size(size as usize)
            };
        }
    }
}

/// The server's listening socket.
pub fn server_socket(listen: SocketAddr) -> Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(listen),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    if listen.is_ipv6() {
        let _ = s.set_only_v6(false);
    }
    grow_buffers(&s);
    s.bind(&listen.into())
        .with_context(|| format!("cannot listen on udp {listen}"))?;
    Ok(s.into())
}

/// A client path's socket: bound to the WAN interface (SO_BINDTODEVICE) or address it names.
pub fn client_socket(bind: &Bind, remote: SocketAddr) -> Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(remote),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    let unspecified = if remote.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let local = match bind {
        Bind::Any => unspecified,
        Bind::Ip(ip) => *ip,
        Bind::Interface(name) => {
            s.bind_device(Some(name.as_bytes()))
                .with_context(|| format!("cannot bind to interface {name} (SO_BINDTODEVICE)"))?;
            match (remote.is_ipv4(), interface::first_ipv4(name)) {
                (true, Ok(a)) => IpAddr::V4(a),
                (true, Err(e)) => {
                    warn!(interface = %name, error = %e, "interface has no IPv4 address; binding to the device only");
                    unspecified
                }
                (false, _) => unspecified,
            }
        }
    };
    grow_buffers(&s);
    s.bind(&SocketAddr::new(local, 0).into())
        .with_context(|| format!("cannot bind udp socket to {local}"))?;
    Ok(s.into())
}

/// A path socket that sends every datagram on its own: no UDP GSO batches. For a path that
/// answered its probes while none of its data arrived (`path/delivery.rs`): a NAT on the client
/// host that changes ports before the kernel segments a GSO batch, on an interface without
/// checksum offload, sends every segment with a wrong UDP checksum (bench/gso-nat.sh), while
/// single datagrams (the probes) pass. It costs CPU at high rates, so only such a path gets it.
#[derive(Debug)]
pub struct Unsegmented(pub std::sync::Arc<dyn quinn::AsyncUdpSocket>);

impl quinn::AsyncUdpSocket for Unsegmented {
    fn create_io_poller(self: std::sync::Arc<Self>) -> std::pin::Pin<Box<dyn quinn::UdpPoller>> {
        self.0.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.0.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut std::task::Context,
        bufs: &mut [std::io::IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        1
    }

    fn max_receive_segments(&self) -> usize {
        self.0.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}
