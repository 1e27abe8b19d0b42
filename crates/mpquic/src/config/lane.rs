//! The MPTCP lane's keys (docs/CONFIG.md "The MPTCP lane"): a class's `tcp_lane` (client; the
//! top-level one is the implicit class's), the server's port for it (`tcp_lane_port`, client)
//! and where the server takes lane connections (`tcp_lane_listen`, server).

use std::net::SocketAddr;

use super::checker::Checker;
use super::{ClientConfig, RawConfig};

/// `tcp_lane: mptcp | off` at `at`.
pub(super) fn lane(value: Option<&str>, at: &str, c: &mut Checker) -> bool {
    match value {
        None | Some("off") => false,
        Some("mptcp") => true,
        Some(other) => {
            c.unknown_value(at, "lane", other, &["mptcp", "off"]);
            false
        }
    }
}

/// The server's `tcp_lane_listen` (`None`: no lane), and the client keys refused there.
pub(super) fn server(raw: &RawConfig, c: &mut Checker) -> Option<SocketAddr> {
    for (key, set) in [
        ("tcp_lane", raw.tcp_lane.is_some()),
        ("tcp_lane_port", raw.tcp_lane_port.is_some()),
    ] {
        if set {
            c.at(
                key,
                format!("`{key}` is a client option"),
                Some("the server takes lane connections on tcp_lane_listen".into()),
            );
        }
    }
    let text = raw.tcp_lane_listen.as_deref()?;
    match text.parse::<SocketAddr>() {
        Ok(a) if a.port() != 0 => Some(a),
        _ => {
            c.at(
                "tcp_lane_listen",
                format!("`tcp_lane_listen: {text}`: an address and a TCP port"),
                Some("e.g. tcp_lane_listen: 0.0.0.0:45018".into()),
            );
            None
        }
    }
}

/// The client's `tcp_lane_port` (default: the server's QUIC port + 1), and the server key
/// refused there.
pub(super) fn client_port(raw: &RawConfig, quic_port: u16, c: &mut Checker) -> u16 {
    if raw.tcp_lane_listen.is_some() {
        c.at(
            "tcp_lane_listen",
            "`tcp_lane_listen` is a server option".into(),
            Some(
                "a client's classes say `tcp_lane: mptcp`; its server's port is tcp_lane_port"
                    .into(),
            ),
        );
    }
    raw.tcp_lane_port.unwrap_or(quic_port.wrapping_add(1))
}

/// What the lane cannot be combined with, once the client's classes are known.
pub(super) fn client_checks(raw: &RawConfig, cl: &ClientConfig, c: &mut Checker) {
    if raw.tcp_lane.is_some() && !raw.classes.is_empty() {
        c.at(
            "tcp_lane",
            "with `classes:`, `tcp_lane` is a class's key".into(),
            Some("move it under the class whose TCP connections take the lane".into()),
        );
    }
    // The lane's subflows are the kernel's: no pacer of ours sees them, and the kernel has no
    // cap per subflow. Said, not refused: a backup flag keeps them off such a path meanwhile.
    if cl.classes.iter().any(|k| k.tcp_lane) {
        for p in (cl.paths.iter()).filter(|p| p.rate_limit.is_some() || p.data_budget.is_some()) {
            c.warn(format!(
                "path {}: rate_limit and data_budget hold for the tunnel, not for the MPTCP lane's subflows on it (the kernel's: not capped, not counted){}",
                p.name,
                match p.role.is_backup() {
                    true => "; as a backup it carries lane traffic only while no other path works",
                    false => "; `role: backup` keeps lane traffic off it while another path works",
                }
            ));
        }
    }
    if cl.masque.is_some() && cl.classes.iter().any(|k| k.tcp_lane) {
        c.at(
            "tcp_lane",
            "the MPTCP lane goes to an mpquic server: not with `protocol: masque`".into(),
            None,
        );
    }
}
