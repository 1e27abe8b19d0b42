//! QUIC engine settings and UDP sockets. One place decides the transport parameters for both
//! sides, so client and server cannot disagree on windows, MTU or timeouts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use mpquic_core::cc;
use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
use quinn::{MtuDiscoveryConfig, TransportConfig};
use socket2::{Domain, Protocol, Socket, Type};
use tracing::warn;

use crate::config::{Bind, Congestion};
use crate::tun;

/// Path MTU assumed when it cannot be read from the interface.
pub const DEFAULT_LINK_MTU: u32 = 1500;

/// A connection with no packets at all for this long is closed. Path health decides far sooner
/// (probes every 100 ms); this only bounds how long a dead connection's state is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(15);
/// Datagrams the engine may queue beyond its congestion window: about 40 ms at 100 Mbit/s. Kept
/// small because a deep queue here is latency for every flow on the path.
pub(crate) const DATAGRAM_SEND_BUFFER: usize = 512 * 1024;

pub fn transport(cc: Congestion, link_mtu: u32) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(Some(IDLE_TIMEOUT.try_into().expect("valid idle timeout")));
    let payload = mpquic_core::mtu::udp_payload(link_mtu);
    t.initial_mtu(payload);
    // The link's known payload is also the floor: quinn's black-hole detector reads bursts of
    // lost full-size packets as an MTU black hole and drops to `min_mtu` for a minute, and a
    // tunnel's packets are nearly all full size, so ordinary congestion or radio loss set it
    // off and every full-size inner packet was then refused as `oversized` (issue 9: scenarios
    // 02, 05, 06). A burst with a packet no larger than `min_mtu` is never suspicious. The
    // client also announces this size (`max_udp_payload_size`, `client_endpoint`), which caps
    // what the server sends it.
    t.min_mtu(payload);
    let mut mtud = MtuDiscoveryConfig::default();
    mtud.upper_bound(payload);
    t.mtu_discovery_config(Some(mtud));
    t.datagram_receive_buffer_size(Some(4 << 20));
    t.datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    // Reliable mode: one stream carries a whole path; windows sized for ~100 ms at 1 Gbit/s.
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((32u32 << 20).into());
    t.send_window(32 << 20);
    t.max_concurrent_bidi_streams(4u32.into());
    t.max_concurrent_uni_streams(0u32.into());
    let factory: Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> = match cc {
        Congestion::Cubic => Arc::new(CubicConfig::default()),
        Congestion::Newreno => Arc::new(NewRenoConfig::default()),
        Congestion::QuinnBbr => Arc::new(BbrConfig::default()),
        Congestion::Bbr => core(|mtu| Box::new(cc::Bbr::new(mtu))),
        Congestion::Bbr3 => core(|mtu| Box::new(cc::Bbr3::new(mtu))),
    };
    t.congestion_controller_factory(Arc::new(Tracked(factory)));
    Arc::new(t)
}

/// Any controller, with the bytes in flight kept beside it: the per-packet schedulers need to
/// know whether a path's window has room (`window - in_flight`), and quinn tells only its
/// controller (`on_end_acks`). Read through `window_room`.
struct Tracked(Arc<dyn quinn::congestion::ControllerFactory + Send + Sync>);

impl quinn::congestion::ControllerFactory for Tracked {
    fn build(
        self: Arc<Self>,
        now: std::time::Instant,
        current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(TrackedController {
            inner: self.0.clone().build(now, current_mtu),
            in_flight: 0,
        })
    }
}

struct TrackedController {
    inner: Box<dyn quinn::congestion::Controller>,
    /// As of the last ACK batch, less what was declared lost, plus what was sent since.
    in_flight: u64,
}

/// What `conn`'s controller says now: its window and the bytes in flight in it.
pub fn controller_view(conn: &quinn::Connection) -> (u64, u64) {
    let cc = conn.congestion_state();
    let window = cc.window();
    let in_flight = cc
        .into_any()
        .downcast::<TrackedController>()
        .map_or(0, |t| t.in_flight);
    (window, in_flight)
}

impl quinn::congestion::Controller for TrackedController {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, last_packet_number: u64) {
        self.in_flight += bytes;
        self.inner.on_sent(now, bytes, last_packet_number);
    }
    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }
    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.in_flight = in_flight;
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }
    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.in_flight = self.in_flight.saturating_sub(lost_bytes);
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }
    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu);
    }
    fn window(&self) -> u64 {
        self.inner.window()
    }
    fn metrics(&self) -> quinn::congestion::ControllerMetrics {
        self.inner.metrics()
    }
    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        Box::new(TrackedController {
            inner: self.inner.clone_box(),
            in_flight: self.in_flight,
        })
    }
    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// Builds one of the core's controllers for a datagram size.
type MakeController = Arc<dyn Fn(u16) -> Box<dyn cc::Controller> + Send + Sync>;

fn core(make: fn(u16) -> Box<dyn cc::Controller>) -> Arc<CoreController> {
    Arc::new(CoreController(Arc::new(make)))
}

/// One of the core's controllers (`mpquic_core::cc`) in the QUIC engine: the factory builds one
/// per connection, and `Adapter` forwards the engine's events to it.
struct CoreController(MakeController);

impl quinn::congestion::ControllerFactory for CoreController {
    fn build(
        self: Arc<Self>,
        _now: std::time::Instant,
        current_mtu: u16,
    ) -> Box<dyn quinn::congestion::Controller> {
        Box::new(Adapter {
            inner: (self.0)(current_mtu),
        })
    }
}

struct Adapter {
    inner: Box<dyn cc::Controller>,
}

impl quinn::congestion::Controller for Adapter {
    fn on_sent(&mut self, now: std::time::Instant, bytes: u64, _last_packet_number: u64) {
        self.inner.on_sent(now, bytes);
    }

    fn on_ack(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        bytes: u64,
        app_limited: bool,
        _rtt: &quinn_proto::RttEstimator,
    ) {
        self.inner.on_ack(now, sent, bytes, app_limited);
    }

    fn on_end_acks(
        &mut self,
        now: std::time::Instant,
        in_flight: u64,
        _app_limited: bool,
        _largest_packet_num_acked: Option<u64>,
    ) {
        self.inner.on_end_acks(now, in_flight);
    }

    fn on_congestion_event(
        &mut self,
        now: std::time::Instant,
        sent: std::time::Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_loss(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu(new_mtu);
    }

    fn window(&self) -> u64 {
        self.inner.window()
    }

    fn metrics(&self) -> quinn::congestion::ControllerMetrics {
        let mut m = quinn::congestion::ControllerMetrics::default();
        m.congestion_window = self.inner.window();
        m.pacing_rate = self.inner.pacing_rate().map(|r| r * 8);
        m
    }

    fn clone_box(&self) -> Box<dyn quinn::congestion::Controller> {
        // quinn clones a controller for status (`Connection::congestion_state`) and for a
        // migrated path: the state as it is.
        Box::new(Adapter {
            inner: self.inner.clone_box(),
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// The client's per-path QUIC endpoint settings: it announces the largest UDP payload its links
/// carry, so the server (whose own link MTU says nothing about the client's) never sends more.
pub fn client_endpoint(link_mtu: u32) -> quinn::EndpointConfig {
    let mut c = quinn::EndpointConfig::default();
    c.max_udp_payload_size(mpquic_core::mtu::udp_payload(link_mtu))
        .expect("udp_payload is within QUIC's bounds (1200..=65527)");
    c
}

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
            match (remote.is_ipv4(), tun::interface_v4(name)) {
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

/// MTU of the link a path uses, for deriving the TUN MTU.
pub fn link_mtu(bind: &Bind) -> u32 {
    match bind {
        Bind::Interface(name) => tun::interface_mtu(name).unwrap_or(DEFAULT_LINK_MTU),
        _ => DEFAULT_LINK_MTU,
    }
}
