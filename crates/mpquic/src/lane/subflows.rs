//! The lane's subflows now, by the local address they leave from: MPTCP subflows are TCP
//! sockets, listed in /proc/net/tcp (IPv4) with the lane server as their peer.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};

/// Established TCP sockets to `server` in a /proc/net/tcp text, by local address.
pub fn count(proc_net_tcp: &str, server: SocketAddr) -> HashMap<Ipv4Addr, u64> {
    let SocketAddr::V4(server) = server else {
        return HashMap::new();
    };
    let mut out = HashMap::new();
    for line in proc_net_tcp.lines().skip(1) {
        let mut f = line.split_whitespace().skip(1);
        let (Some(local), Some(remote), Some(state)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if state != "01" {
            continue;
        }
        let (Some(l), Some(r)) = (endpoint(local), endpoint(remote)) else {
            continue;
        };
        if r == (*server.ip(), server.port()) {
            *out.entry(l.0).or_default() += 1;
        }
    }
    out
}

/// `0100007F:1F90` (the address as the host stores it, the port big-endian).
fn endpoint(s: &str) -> Option<(Ipv4Addr, u16)> {
    let (a, p) = s.split_once(':')?;
    let a = u32::from_str_radix(a, 16).ok()?;
    let p = u16::from_str_radix(p, 16).ok()?;
    Some((Ipv4Addr::from(a.to_ne_bytes()), p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subflows_to_the_server_are_counted_by_local_address() {
        let a =
            |ip: Ipv4Addr, port: u16| format!("{:08X}:{port:04X}", u32::from_ne_bytes(ip.octets()));
        let server = Ipv4Addr::new(10, 99, 0, 1);
        let (w1, w2) = (Ipv4Addr::new(10, 1, 1, 2), Ipv4Addr::new(10, 1, 2, 2));
        let row = |l: String, r: String, st: &str| {
            format!("   0: {l} {r} {st} 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 20 4 30 10 -1")
        };
        let text = [
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode".to_string(),
            row(a(w1, 40000), a(server, 45018), "01"),
            row(a(w2, 40001), a(server, 45018), "01"),
            row(a(w2, 40002), a(server, 45018), "01"),
            row(a(w2, 40003), a(server, 45018), "06"),
            row(a(w1, 40004), a(server, 45017), "01"),
        ]
        .join("\n");
        let got = count(&text, SocketAddr::from((server, 45018)));
        assert_eq!(got.get(&w1), Some(&1));
        assert_eq!(
            got.get(&w2),
            Some(&2),
            "a socket in TIME_WAIT is not counted"
        );
    }
}
