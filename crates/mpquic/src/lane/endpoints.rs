//! The kernel's MPTCP endpoints for the client's paths (generic netlink, family `mptcp_pm`,
//! as `ip mptcp endpoint add ADDR dev IF subflow [backup]` does): one `subflow` endpoint per
//! path, so every lane connection opens a subflow from each path's address, bound to its
//! device; `role: backup` paths get the backup flag (the kernel sends on them only when no
//! other subflow works). The limits are raised to take a subflow per path. A reload changes
//! only the endpoints whose path changed (`Installed::update`: removing an endpoint closes its
//! subflows); all are removed again when `Installed` is dropped.
//!
//! The messages are built and read here (`message`, `attrs`), the socket is the kernel's.

use std::net::IpAddr;

use anyhow::{Context, Result};

use super::netlink::{attr, genl, Netlink, NETLINK_GENERIC, NLA_F_NESTED};

const MPTCP_PM_NAME: &str = "mptcp_pm";
const MPTCP_PM_VER: u8 = 1;
const CMD_ADD_ADDR: u8 = 1;
const CMD_DEL_ADDR: u8 = 2;
const CMD_SET_LIMITS: u8 = 5;
const ATTR_ADDR: u16 = 1;
const ATTR_RCV_ADD_ADDRS: u16 = 2;
const ATTR_SUBFLOWS: u16 = 3;
const ADDR_FAMILY: u16 = 1;
const ADDR_ID: u16 = 2;
const ADDR_ADDR4: u16 = 3;
const ADDR_ADDR6: u16 = 4;
const ADDR_FLAGS: u16 = 6;
const ADDR_IF_IDX: u16 = 7;
const FLAG_SUBFLOW: u32 = 1 << 1;
const FLAG_BACKUP: u32 = 1 << 2;

/// Endpoint ids this process uses (the kernel's own run from 1 up): one per path.
const FIRST_ID: u8 = 200;
/// Paths a client has at most on the lane (ids `FIRST_ID..FIRST_ID + MAX_ENDPOINTS`).
const MAX_ENDPOINTS: usize = 32;

/// A path's endpoint: its address on its device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: IpAddr,
    /// Its device (`None`: the kernel's routing picks one).
    pub ifindex: Option<u32>,
    pub backup: bool,
}

/// Endpoints in the kernel, with their ids; removed on drop.
pub struct Installed {
    sock: Netlink,
    family: u16,
    ids: Vec<(u8, Endpoint)>,
}

/// The path manager's socket and family id.
fn path_manager() -> Result<(Netlink, u16)> {
    let mut sock = Netlink::open(NETLINK_GENERIC).context("generic netlink socket")?;
    let family = sock
        .family(MPTCP_PM_NAME)
        .context("the kernel's MPTCP path manager (is MPTCP built in?)")?;
    Ok((sock, family))
}

/// Let each MPTCP connection have `subflows` more subflows and take as many addresses its
/// peer announces (the server: a subflow per client path).
pub fn set_limits(subflows: u32) -> Result<()> {
    let (mut sock, family) = path_manager()?;
    limits(&mut sock, family, subflows)
}

fn limits(sock: &mut Netlink, family: u16, subflows: u32) -> Result<()> {
    let limits = [
        attr(ATTR_SUBFLOWS, &subflows.to_ne_bytes()),
        attr(ATTR_RCV_ADD_ADDRS, &subflows.to_ne_bytes()),
    ]
    .concat();
    sock.request(family, 0, &genl(CMD_SET_LIMITS, MPTCP_PM_VER, &limits))
        .context("setting the MPTCP limits")?;
    Ok(())
}

/// Add one endpoint per path, the limits raised to a subflow per endpoint.
pub fn install(endpoints: &[Endpoint]) -> Result<Installed> {
    let (sock, family) = path_manager()?;
    let mut installed = Installed {
        sock,
        family,
        ids: Vec::new(),
    };
    installed.update(endpoints)?;
    Ok(installed)
}

impl Installed {
    /// Make the kernel's endpoints `endpoints`: the ones already there stay (their subflows
    /// with them), the others are removed and added. How many were (removed, added).
    pub fn update(&mut self, endpoints: &[Endpoint]) -> Result<(usize, usize)> {
        limits(&mut self.sock, self.family, endpoints.len().max(2) as u32)?;
        let gone: Vec<u8> = (self.ids.iter())
            .filter(|(_, e)| !endpoints.contains(e))
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            let _ = self.sock.request(self.family, 0, &del(*id));
        }
        self.ids.retain(|(id, _)| !gone.contains(id));
        let mut added = 0;
        for e in endpoints {
            if self.ids.iter().any(|(_, have)| have == e) {
                continue;
            }
            let id = (0..MAX_ENDPOINTS as u8)
                .map(|i| FIRST_ID + i)
                .find(|id| !self.ids.iter().any(|(have, _)| have == id))
                .context("more paths than the lane takes endpoints for")?;
            // One left by a process that did not end cleanly goes first.
            let _ = self.sock.request(self.family, 0, &del(id));
            self.sock
                .request(
                    self.family,
                    0,
                    &genl(CMD_ADD_ADDR, MPTCP_PM_VER, &endpoint(id, e)),
                )
                .with_context(|| format!("adding the MPTCP endpoint {}", e.addr))?;
            self.ids.push((id, e.clone()));
            added += 1;
        }
        Ok((gone.len(), added))
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        for &(id, _) in &self.ids {
            let _ = self.sock.request(self.family, 0, &del(id));
        }
    }
}

/// The ADD_ADDR attributes of `e` with `id`.
fn endpoint(id: u8, e: &Endpoint) -> Vec<u8> {
    let (family, addr) = match e.addr {
        IpAddr::V4(a) => (libc::AF_INET as u16, attr(ADDR_ADDR4, &a.octets())),
        IpAddr::V6(a) => (libc::AF_INET6 as u16, attr(ADDR_ADDR6, &a.octets())),
    };
    let flags = FLAG_SUBFLOW | if e.backup { FLAG_BACKUP } else { 0 };
    let device = e
        .ifindex
        .map(|i| attr(ADDR_IF_IDX, &(i as i32).to_ne_bytes()))
        .unwrap_or_default();
    let inner = [
        attr(ADDR_FAMILY, &family.to_ne_bytes()),
        attr(ADDR_ID, &[id]),
        addr,
        attr(ADDR_FLAGS, &flags.to_ne_bytes()),
        device,
    ]
    .concat();
    attr(ATTR_ADDR | NLA_F_NESTED, &inner)
}

/// DEL_ADDR of endpoint `id`.
fn del(id: u8) -> Vec<u8> {
    let addr = attr(ATTR_ADDR | NLA_F_NESTED, &attr(ADDR_ID, &[id]));
    genl(CMD_DEL_ADDR, MPTCP_PM_VER, &addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_the_attributes_ip_mptcp_sends() {
        let e = Endpoint {
            addr: "10.1.2.3".parse().unwrap(),
            ifindex: Some(7),
            backup: true,
        };
        let m = endpoint(200, &e);
        let outer = super::super::netlink::attrs(&m);
        assert_eq!(outer.len(), 1);
        assert_eq!(outer[0].0, ATTR_ADDR);
        let inner = super::super::netlink::attrs(outer[0].1);
        let get = |k| inner.iter().find(|(t, _)| *t == k).map(|(_, v)| v.to_vec());
        assert_eq!(
            get(ADDR_FAMILY),
            Some((libc::AF_INET as u16).to_ne_bytes().to_vec())
        );
        assert_eq!(get(ADDR_ID), Some(vec![200]));
        assert_eq!(get(ADDR_ADDR4), Some(vec![10, 1, 2, 3]));
        assert_eq!(
            get(ADDR_FLAGS),
            Some((FLAG_SUBFLOW | FLAG_BACKUP).to_ne_bytes().to_vec())
        );
        assert_eq!(get(ADDR_IF_IDX), Some(7i32.to_ne_bytes().to_vec()));
    }
}
