//! Taking a lane class's TCP connections from the LAN (nftables TPROXY): the kernel answers
//! the LAN host's SYN itself and hands the connection to our transparent listener, whose
//! accepted sockets carry the original destination as their local address (the site's
//! addresses are not rewritten). Three pieces, all removed when `Taken` is dropped: the
//! nftables table (`nft.rs`, loaded with `nft -f`: nftables has no stable netlink library),
//! a policy rule for the mark, and its table's local default route (netlink).

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use mpquic_core::classify::Classifier;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;

use super::netlink::{attr, Netlink, NETLINK_ROUTE, NLM_F_CREATE, NLM_F_EXCL};
use super::nft::Table;

const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_NEWRULE: u16 = 32;
const RTM_DELRULE: u16 = 33;
const RTA_OIF: u16 = 4;
const RTA_TABLE: u16 = 15;
const FRA_PRIORITY: u16 = 6;
const FRA_FWMARK: u16 = 10;
const FRA_TABLE: u16 = 15;
const RTN_LOCAL: u8 = 2;
const RT_SCOPE_HOST: u8 = 254;
const RTPROT_STATIC: u8 = 4;
const FR_ACT_TO_TBL: u8 = 1;
/// The policy rule's priority: before `main` (32766), after `local` (0).
const RULE_PRIORITY: u32 = 100;

/// The transparent listener TPROXY hands connections to (any address, a port of its own).
pub fn listener() -> Result<(TcpListener, u16)> {
    let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    s.set_ip_transparent(true)
        .context("IP_TRANSPARENT (the lane needs CAP_NET_ADMIN)")?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::from(([0, 0, 0, 0], 0)).into())?;
    s.listen(1024)?;
    let l = TcpListener::from_std(s.into())?;
    let port = l.local_addr()?.port();
    Ok((l, port))
}

/// The kernel's setup for one instance's lane; removed on drop.
pub struct Taken {
    table: String,
    mark: u32,
    routed: bool,
    ruled: bool,
}

/// Take the TCP connections of `table`'s classes (of `classifier`) arriving on any device but
/// the tunnel's and the paths' (`not_from`): the policy rule and local route for its mark, and
/// the nftables table.
pub fn take(table: &Table, not_from: &[String], classifier: &Classifier) -> Result<Taken> {
    let mark = table.mark;
    let mut taken = Taken {
        table: table.name(),
        mark,
        routed: false,
        ruled: false,
    };
    let lo = ifindex("lo")?;
    let mut nl = Netlink::open(NETLINK_ROUTE).context("routing netlink socket")?;
    // What a process that did not end cleanly left goes first.
    let _ = nl.request(RTM_DELRULE, 0, &rule_body(mark));
    let _ = nl.request(RTM_DELROUTE, 0, &route_body(mark, lo));
    nl.request(
        RTM_NEWROUTE,
        NLM_F_CREATE | NLM_F_EXCL,
        &route_body(mark, lo),
    )
    .with_context(|| format!("the lane's local route (table {mark})"))?;
    taken.routed = true;
    nl.request(RTM_NEWRULE, NLM_F_CREATE | NLM_F_EXCL, &rule_body(mark))
        .context("the lane's policy rule")?;
    taken.ruled = true;
    rules(table, not_from, classifier)?;
    Ok(taken)
}

/// Load `table` (in one transaction: it replaces the one there).
pub fn rules(table: &Table, not_from: &[String], classifier: &Classifier) -> Result<()> {
    nft(&table.ruleset(not_from, classifier)).context("loading the lane's nftables rules")
}

impl Drop for Taken {
    fn drop(&mut self) {
        let _ = nft(&format!("delete table ip {}\n", self.table));
        if let (Ok(mut nl), Ok(lo)) = (Netlink::open(NETLINK_ROUTE), ifindex("lo")) {
            if self.ruled {
                let _ = nl.request(RTM_DELRULE, 0, &rule_body(self.mark));
            }
            if self.routed {
                let _ = nl.request(RTM_DELROUTE, 0, &route_body(self.mark, lo));
            }
        }
    }
}

/// `nft -f -` with `rules`; its complaint in the error.
fn nft(rules: &str) -> Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (install nftables)")?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(rules.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("nft: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A device's index.
pub(super) fn ifindex(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        bail!("no device {name}");
    }
    Ok(i)
}

/// `ip rule add fwmark MARK lookup MARK priority RULE_PRIORITY` (IPv4).
fn rule_body(mark: u32) -> Vec<u8> {
    let hdr = [
        libc::AF_INET as u8,
        0,
        0,
        0,
        0,
        0,
        0,
        FR_ACT_TO_TBL,
        0,
        0,
        0,
        0,
    ];
    [
        &hdr[..],
        &attr(FRA_FWMARK, &mark.to_ne_bytes()),
        &attr(FRA_TABLE, &mark.to_ne_bytes()),
        &attr(FRA_PRIORITY, &RULE_PRIORITY.to_ne_bytes()),
    ]
    .concat()
}

/// `ip route add local 0.0.0.0/0 dev lo table MARK`.
fn route_body(table: u32, lo: u32) -> Vec<u8> {
    let hdr = [
        libc::AF_INET as u8,
        0,
        0,
        0,
        0,
        RTPROT_STATIC,
        RT_SCOPE_HOST,
        RTN_LOCAL,
        0,
        0,
        0,
        0,
    ];
    [
        &hdr[..],
        &attr(RTA_TABLE, &table.to_ne_bytes()),
        &attr(RTA_OIF, &lo.to_ne_bytes()),
    ]
    .concat()
}
