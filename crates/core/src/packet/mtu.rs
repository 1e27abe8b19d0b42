//! The tunnel's size arithmetic in one place: from a link's MTU to the UDP payload the transport
//! may use, the TUN device's MTU and the TCP MSS the shell clamps SYNs to. Keeping every inner
//! packet inside one outer datagram is what lets datagram mode work without fragmentation.

/// Bytes the tunnel adds around an inner packet, worst case: outer IPv6 (40) + UDP (8) + QUIC
/// short header (1 + 20-byte CID + 4-byte packet number) + AEAD tag (16) + DATAGRAM frame header
/// (3) = 92, rounded up.
pub const TUNNEL_OVERHEAD: u32 = 96;
/// The smallest TUN MTU we set (IPv4's minimum reassembly size).
pub const MIN_TUN_MTU: u32 = 576;
/// Outer IPv4 + UDP headers.
const OUTER_IPV4_UDP: u32 = 28;
/// QUIC needs at least 1200-byte datagrams; 65,000 keeps clear of the 16-bit UDP length.
const MIN_UDP_PAYLOAD: u32 = 1200;
const MAX_UDP_PAYLOAD: u32 = 65_000;
/// IPv4 + TCP headers without options (IPv6 SYNs get the same value: 20 bytes conservative).
const IPV4_TCP_HEADERS: u32 = 40;

/// UDP payload the transport may use on a link with this MTU.
pub fn udp_payload(link_mtu: u32) -> u16 {
    link_mtu
        .saturating_sub(OUTER_IPV4_UDP)
        .clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD) as u16
}

/// The link MTU whose UDP payload is `payload` (the inverse of `udp_payload` within its bounds):
/// a path whose route carries less than its link (`pmtu.rs`) is set up as if its link were this.
pub fn link_mtu_for_payload(payload: u16) -> u32 {
    u32::from(payload) + OUTER_IPV4_UDP
}

/// TUN MTU for a tunnel whose smallest link MTU is `link_mtu`: every inner packet then fits one
/// outer datagram.
pub fn tun_mtu(link_mtu: u32) -> u32 {
    link_mtu.saturating_sub(TUNNEL_OVERHEAD).max(MIN_TUN_MTU)
}

/// TCP MSS that fits a TUN MTU.
pub fn tcp_mss(tun_mtu: u32) -> u16 {
    tun_mtu
        .saturating_sub(IPV4_TCP_HEADERS)
        .min(u32::from(u16::MAX)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ethernet_and_small_links() {
        assert_eq!(udp_payload(1500), 1472);
        assert_eq!(tun_mtu(1500), 1404);
        assert_eq!(tcp_mss(tun_mtu(1500)), 1364);
        // An inner packet of the TUN MTU plus the overhead fits the link.
        assert!(tun_mtu(1500) + TUNNEL_OVERHEAD <= 1500);
        // Tiny or absurd links are clamped, never wrap.
        assert_eq!(udp_payload(100), 1200);
        assert_eq!(tun_mtu(100), MIN_TUN_MTU);
        assert_eq!(udp_payload(u32::MAX), 65_000);
        assert_eq!(udp_payload(link_mtu_for_payload(1360)), 1360);
        assert_eq!(tcp_mss(u32::MAX), u16::MAX);
    }
}
