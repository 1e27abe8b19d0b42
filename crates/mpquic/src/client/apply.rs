//! A reload at the client: the new file's paths, policy, classes and TLS applied to the running
//! client (`control/reload.rs` says which keys may change live).

use std::sync::Arc;

use anyhow::Result;
use tracing::warn;

use super::paths::LivePath;
use super::Client;
use crate::config::{Config, PathConfig, RoleConfig};
use crate::control::reload::PathChanges;

impl Client {
    /// Apply a reloaded configuration (`reload::read` has checked that only what applies live
    /// changed): the paths that differ are removed, reconnected or added; the others are left
    /// alone.
    pub(super) fn apply(self: &Arc<Self>, new: Config) -> Result<String, String> {
        let RoleConfig::Client(nc) = &new.role else {
            return Err("the file is no longer a client's".into());
        };
        // TLS first (its files read again: a rotated certificate, key or CA), so an unreadable
        // one refuses the reload whole.
        let lane = match self.lane.get() {
            Some(l) => Some((l, l.prepare(&new, nc).map_err(|e| format!("{e:#}"))?)),
            None => None,
        };
        (self.dialer)
            .reload_tls(&new, nc)
            .map_err(|e| format!("{e:#}"))?;
        *self.certificates.write().unwrap_or_else(|e| e.into_inner()) =
            crate::tls::loaded(new.cert_file.as_deref(), nc.ca_file.as_deref());
        let RoleConfig::Client(nc) = new.role else {
            return Err("the file is no longer a client's".into());
        };
        let mut paths = self.lock_paths();
        let old: Vec<PathConfig> = paths.iter().map(|l| (**l.cfg.borrow()).clone()).collect();
        let changes = PathChanges::between(&old, &nc.paths);
        // Without `classes:` the top-level policy is the one lane's (with them, a class's
        // policy is fixed at start: `reload::read`).
        let implicit = self.classes.iter().any(|k| !k.cfg.explicit);
        let policy = Some(self.tunnel.policy()).filter(|now| implicit && *now != nc.policy);
        if policy.is_some() {
            self.tunnel.set_policy(nc.policy)?;
        }
        let rules = *self.classifier() != nc.classifier;
        for p in changes.added.iter().chain(&changes.changed) {
            let mtu = self.platform.link_mtu(&p.bind);
            if mtu < self.link_mtu {
                warn!(path = %p.name, link_mtu = mtu, tun_mtu = self.mtu, "the path's link MTU is below the one the TUN MTU was derived from at start; its packets are sized by the MTU watch (a restart sizes the TUN device for it)");
            }
        }
        // New paths first: a failure leaves the running set as it was.
        let mut lane_message = None;
        let mut added = Vec::new();
        for p in &changes.added {
            added.push(
                self.start_path(p.clone())
                    .map_err(|e| format!("path {}: {e:#}", p.name))?,
            );
        }
        // The classes' rules: packets are classified by them from the next batch read on (the
        // classes themselves, and which is the default, are fixed at start: `reload::read`).
        if let Some((l, prepared)) = lane {
            // The tunnel's part is in place already: the lane's failure is told, not undone.
            match l.apply(prepared, &nc.classifier) {
                Ok(m) => lane_message = Some(m),
                Err(e) => {
                    warn!(error = %format!("{e:#}"), "MPTCP lane: the reload is applied in part");
                    lane_message = Some(format!("MPTCP lane not changed in full: {e:#}"));
                }
            }
        }
        if rules {
            *self.classifier.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(nc.classifier);
        }
        for name in &changes.removed {
            paths.retain(|l| l.cfg.borrow().name != *name);
            if let Some(id) = self.tunnel.path_id(name) {
                self.tunnel.retire(id, None);
            }
        }
        for p in &changes.changed {
            if let Some(l) = paths.iter().find(|l| l.cfg.borrow().name == p.name) {
                // Its tasks reconnect it (`supervise`).
                l.cfg.send_replace(Arc::new(p.clone()));
            }
        }
        if policy.is_some() {
            // The server learns the policy from the hellos: every path reconnects (each new
            // connection made before its old one closes).
            for l in paths.iter() {
                l.cfg.send_modify(|_| {});
            }
        }
        paths.extend(added);
        // Config order, as status lists them.
        let order = |l: &LivePath| nc.paths.iter().position(|p| p.name == l.cfg.borrow().name);
        paths.sort_by_key(order);
        let mut what = Vec::new();
        if let Some(before) = policy {
            what.push(format!(
                "multipath_policy {} -> {}",
                before.as_str(),
                nc.policy.as_str()
            ));
        }
        if rules {
            what.push("classes: match rules changed".to_string());
        }
        if what.is_empty() || !changes.is_empty() {
            what.push(changes.summary());
        }
        what.push("TLS certificate, key and CA read again".into());
        what.extend(lane_message);
        Ok(what.join("; "))
    }
}
