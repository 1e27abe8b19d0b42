//! QUIC engine settings. One place decides the transport parameters for both sides, so client
//! and server cannot disagree on windows, MTU or timeouts.

use std::sync::Arc;
use std::time::Duration;

use quinn::{MtuDiscoveryConfig, TransportConfig};

use super::controller;
use crate::config::Congestion;
/// A connection with no packets at all for this long is closed. Path health decides far sooner
/// (probes every 100 ms); this only bounds how long a dead connection's state is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(15);
const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// Datagrams quinn may hold beyond its congestion window. Our own bound (`datagram_queue_limit`)
/// refuses packets long before this on all but the fastest paths; it is only the ceiling.
pub(crate) const DATAGRAM_SEND_BUFFER: usize = 4 << 20;
/// The datagram queue we let a path build, in time at its rate, and never less than
/// `DATAGRAM_QUEUE_FLOOR`. A fixed 512 KiB was 14 ms at 300 Mbit/s: one TCP flow spread over
/// a 300 and an 80 Mbit/s path (scenario 12) lost packets to it in every burst and got 0.87-0.90
/// of the links' sum. Bounded at 20 ms of the path's rate (window per RTT) it got 0.86-0.92,
/// at 40 ms 0.94-0.97, at 60 ms 0.93-0.98 (2-4 runs each, alternating): one loss-based flow
/// needs a queue of about its own RTT to keep the links busy through its window's halving, and
/// the flow's RTT over a bond is the slowest path's. 40 ms is about 45 ms at a 300 Mbit/s
/// path's real rate; slow paths stay at the floor (85 ms at 50 Mbit/s, as before: scenario 10's
/// queueing gate unchanged).
const DATAGRAM_QUEUE_TIME: Duration = Duration::from_millis(40);
const DATAGRAM_QUEUE_FLOOR: u64 = 512 * 1024;

/// Bytes of datagrams a path with this window and RTT may hold waiting (`DATAGRAM_QUEUE_TIME`).
pub(crate) fn datagram_queue_limit(window: u64, rtt: Duration) -> u64 {
    let per_time = (rate_per_rtt(window, rtt) / 8)
        .saturating_mul(DATAGRAM_QUEUE_TIME.as_micros() as u64)
        / 1_000_000;
    per_time.clamp(DATAGRAM_QUEUE_FLOOR, DATAGRAM_SEND_BUFFER as u64)
}

/// The smallest initial RTT a dial assumes (`transport`): on a sub-millisecond path the
/// handshake would otherwise resend its first packets every few milliseconds into an outage.
const MIN_INITIAL_RTT: Duration = Duration::from_millis(10);

/// QUIC settings for a connection whose link carries `link_mtu`. `rtt`: the path's RTT known
/// from before (a redial): the handshake's retransmission timer starts at about three of them
/// instead of quinn's one second, so a dial that went out during an outage is answered within
/// a fraction of a second of the path's return rather than after the next of its 1 s, 2 s waits.
pub fn transport(cc: Congestion, link_mtu: u32, rtt: Option<Duration>) -> Arc<TransportConfig> {
    Arc::new(transport_config(cc, link_mtu, rtt))
}

/// A client's keep-alive towards a server that sends no probes (CONNECT-IP): after this long
/// without a packet from the server it sends a PING, so that an idle connection still has
/// something in flight for its ACK watch to wait on (`client/standby.rs`); ten small packets a
/// second, as the native protocol's probes.
const PROBELESS_KEEP_ALIVE: Duration = Duration::from_millis(100);

/// `transport` for a client's connection; `standard`: to a server that sends no probes and
/// may take smaller packets than the link carries (CONNECT-IP: quic-go's servers drop any
/// datagram above 1452 bytes, so a first Initial of the link's 1472 went unanswered). Such a
/// connection starts at QUIC's smallest packets and the engine's own MTU discovery raises them
/// to what the server takes, up to the link's; `known_payload`, a size a connection on the
/// path reached before, is where a redial starts instead (and its floor, as on the native
/// protocol: see `transport_config` on the engine's black-hole detector).
pub fn client_transport(
    cc: Congestion,
    link_mtu: u32,
    rtt: Option<Duration>,
    standard: bool,
    known_payload: Option<u16>,
) -> Arc<TransportConfig> {
    let mut t = transport_config(cc, link_mtu, rtt);
    if standard {
        t.keep_alive_interval(Some(PROBELESS_KEEP_ALIVE));
        let start = known_payload
            .unwrap_or(mpquic_core::path::pmtu::FLOOR)
            .min(mpquic_core::packet::mtu::udp_payload(link_mtu));
        t.initial_mtu(start);
        t.min_mtu(start);
    }
    Arc::new(t)
}

/// `transport`'s settings, for an endpoint that changes a few (the CONNECT-IP one's streams).
pub fn transport_config(cc: Congestion, link_mtu: u32, rtt: Option<Duration>) -> TransportConfig {
    let mut t = TransportConfig::default();
    if let Some(rtt) = rtt {
        t.initial_rtt(rtt.max(MIN_INITIAL_RTT));
    }
    t.max_idle_timeout(Some(IDLE_TIMEOUT.try_into().expect("valid idle timeout")));
    // A stripe path's connection carries nothing once its pipes are registered (probes and data
    // go in stripe packets), yet it is the path's life: keep it from idling out. Other paths'
    // probes every 100 ms make this a no-op for them.
    t.keep_alive_interval(Some(KEEP_ALIVE));
    let payload = mpquic_core::packet::mtu::udp_payload(link_mtu);
    t.initial_mtu(payload);
    // The link's known payload is also the floor: quinn's black-hole detector reads bursts of
    // lost full-size packets as an MTU black hole and drops to `min_mtu` for a minute, and a
    // tunnel's packets are nearly all full size, so ordinary congestion or radio loss set it
    // off and every full-size inner packet was then refused as `oversized` (scenarios
    // 02, 05, 06). A burst with a packet no larger than `min_mtu` is never suspicious. The
    // client also announces this size (`max_udp_payload_size`, `client_endpoint`), which caps
    // what the server sends it.
    t.min_mtu(payload);
    let mut mtud = MtuDiscoveryConfig::default();
    mtud.upper_bound(payload);
    t.mtu_discovery_config(Some(mtud));
    t.datagram_receive_buffer_size(Some(4 << 20));
    t.datagram_send_buffer_size(DATAGRAM_SEND_BUFFER);
    // Reliable mode: one stream carries a whole path (and each traffic class after the first
    // one of its own, unidirectional, and each class a sparse stream beside it: `LaneStreams`);
    // windows sized for ~100 ms at 1 Gbit/s, the connection's shared by its streams.
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((32u32 << 20).into());
    t.send_window(32 << 20);
    t.max_concurrent_bidi_streams(4u32.into());
    t.max_concurrent_uni_streams(((2 * mpquic_core::wire::MAX_LANES - 1) as u32).into());
    t.congestion_controller_factory(controller::tracked(cc));
    t
}

/// A window's worth per round trip, in bits/s: what quinn's pacer lets out.
pub fn rate_per_rtt(window: u64, rtt: Duration) -> u64 {
    (window * 8).saturating_mul(1_000_000) / (rtt.as_micros().max(1) as u64)
}

/// The client's per-path QUIC endpoint settings: it announces the largest UDP payload its links
/// carry, so the server (whose own link MTU says nothing about the client's) never sends more.
pub fn client_endpoint(link_mtu: u32) -> quinn::EndpointConfig {
    let mut c = quinn::EndpointConfig::default();
    c.max_udp_payload_size(mpquic_core::packet::mtu::udp_payload(link_mtu))
        .expect("udp_payload is within QUIC's bounds (1200..=65527)");
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The datagram queue is bounded in time at the path's rate, between the floor and
    /// quinn's buffer.
    #[test]
    fn datagram_queue_is_bounded_in_time() {
        let ms = Duration::from_millis;
        // 500 KB per 10 ms = 400 Mbit/s: 40 ms of it is 2 MB.
        assert_eq!(datagram_queue_limit(500_000, ms(10)), 2_000_000);
        // 50 Mbit/s: 250 KB in 40 ms, below the floor.
        assert_eq!(datagram_queue_limit(125_000, ms(20)), DATAGRAM_QUEUE_FLOOR);
        assert_eq!(
            datagram_queue_limit(u64::MAX / 16, ms(1)),
            DATAGRAM_SEND_BUFFER as u64
        );
        assert_eq!(
            datagram_queue_limit(0, Duration::ZERO),
            DATAGRAM_QUEUE_FLOOR
        );
    }
}
