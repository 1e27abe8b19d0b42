//! A reload at the server: the new file's clients, TLS, revocations, routed LANs and limits
//! applied to the running server (`control/reload.rs` says which keys may change live).

use std::sync::Arc;

use anyhow::Result;
use mpquic_core::classify::Prefix;
use tracing::warn;

use super::{route, Server, Session};
use crate::config::{Config, RoleConfig, ServerConfig};
use crate::transport::masque::MasqueListener;
use crate::transport::quic::QuicListener;
use crate::tunnel::close;

impl Server {
    /// Apply a reloaded configuration (`reload::read` has checked that only `clients:`
    /// differs): new LAN routes into the device first (a failure changes nothing), then the new
    /// rules, then the old routes out, and the sessions whose rules changed closed.
    pub(super) fn apply(
        &self,
        new: Config,
        listener: &QuicListener,
        masque: Option<&MasqueListener>,
    ) -> Result<String, String> {
        let RoleConfig::Server(snew) = &new.role else {
            return Err("the file is no longer a server's".into());
        };
        // TLS built before anything changes (its files read again: a rotated certificate, key
        // or CA), so an unreadable one refuses the reload whole.
        let tls = crate::transport::quic::server_quic(&new, snew, crate::tls::Served::Native)
            .map_err(|e| format!("{e:#}"))?;
        let masque_tls = match (masque, &snew.masque) {
            (Some(_), Some(_)) => {
                Some(crate::transport::masque::settings(&new, snew).map_err(|e| format!("{e:#}"))?)
            }
            _ => None,
        };
        let lane_tls = match &self.lane {
            Some(_) => Some(crate::lane::serve::tls(&new, snew).map_err(|e| format!("{e:#}"))?),
            None => None,
        };
        let new = snew.clone();
        let old = self.scfg();
        let lans = |c: &ServerConfig| -> Vec<Prefix> {
            let mut v: Vec<Prefix> = c.routes.iter().map(|(_, p)| *p).collect();
            v.dedup();
            v
        };
        let (before, after) = (lans(&old), lans(&new));
        let added: Vec<Prefix> = after
            .iter()
            .filter(|p| !before.contains(p))
            .copied()
            .collect();
        let gone: Vec<Prefix> = before
            .iter()
            .filter(|p| !after.contains(p))
            .copied()
            .collect();
        for (i, p) in added.iter().enumerate() {
            if let Err(e) = route(&self.queues[0], p, true) {
                for q in &added[..i] {
                    let _ = route(&self.queues[0], q, false);
                }
                return Err(e.to_string());
            }
        }
        *self.scfg.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new.clone());
        listener.install(tls);
        if let (Some(l), Some(settings), Some(m)) = (masque, masque_tls, &new.masque) {
            l.install(settings, m);
        }
        let lane_closed = match (&self.lane, lane_tls) {
            (Some(l), Some(tls)) => l.install(tls, &new.revoked),
            _ => 0,
        };
        *self.certificates.write().unwrap_or_else(|e| e.into_inner()) =
            crate::tls::loaded(self.cfg.cert_file.as_deref(), Some(&new.client_ca_file));
        for p in &gone {
            if let Err(e) = route(&self.queues[0], p, false) {
                warn!(error = %e, "a LAN route no client may announce any more is still there");
            }
        }
        // A session's rules: the `clients:` entries naming it (by session name or identity).
        let rules = |c: &'_ ServerConfig, name: &str, identity: &str| {
            let mine = |n: &String| n == name || n == identity;
            let fixed: Vec<_> = c.clients.iter().filter(|(n, _)| mine(n)).cloned().collect();
            let routes: Vec<_> = c.routes.iter().filter(|(n, _)| mine(n)).cloned().collect();
            (fixed, routes)
        };
        let mut registry = self.write();
        // Revoked: closed now; their next handshake is refused. A CONNECT-IP client's token
        // taken out of `masque_tokens` is revoked likewise (its next request is refused).
        let tokens: Vec<&str> = (new.masque.iter())
            .flat_map(|m| m.tokens.iter().map(|(n, _)| n.as_str()))
            .collect();
        let revoked: Vec<String> = (registry.sessions().into_iter())
            .filter(|(_, _, s)| s.revoked_by(&new.revoked) || s.token_gone(&tokens))
            .map(|(name, _, _)| name.to_string())
            .collect();
        let revoked_sessions: Vec<Arc<Session>> =
            revoked.iter().filter_map(|n| registry.remove(n)).collect();
        let affected: Vec<String> = (registry.sessions().into_iter())
            .filter(|(name, _, s)| rules(&old, name, &s.identity) != rules(&new, name, &s.identity))
            .map(|(name, _, _)| name.to_string())
            .collect();
        let closed: Vec<Arc<Session>> =
            affected.iter().filter_map(|n| registry.remove(n)).collect();
        drop(registry);
        for s in &revoked_sessions {
            warn!(client = %s.identity, "certificate revoked or token taken out; session closed");
            s.close_all(close::REVOKED, "credentials revoked");
        }
        for s in &closed {
            s.close_all(
                close::RULES_CHANGED,
                "the server's rules for this client changed",
            );
        }
        let show = |v: &[Prefix]| {
            v.iter()
                .map(Prefix::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !added.is_empty() {
            parts.push(format!("LAN routes added {}", show(&added)));
        }
        if !gone.is_empty() {
            parts.push(format!("LAN routes removed {}", show(&gone)));
        }
        if !affected.is_empty() {
            parts.push(format!(
                "sessions rejoining under the new rules: {}",
                affected.join(", ")
            ));
        }
        if !revoked.is_empty() {
            parts.push(format!(
                "sessions closed, certificate revoked or token taken out: {}",
                revoked.join(", ")
            ));
        }
        if old.clients != new.clients || old.routes != new.routes {
            parts.push("clients: updated".into());
        }
        if old.revoked != new.revoked {
            parts.push(format!("revoked: {} entries", new.revoked.len()));
        }
        if lane_closed > 0 {
            warn!(
                connections = lane_closed,
                "certificate revoked; MPTCP lane connections closed"
            );
            parts.push(format!(
                "MPTCP lane connections closed, certificate revoked: {lane_closed}"
            ));
        }
        parts.push("TLS certificate, key and CA read again".into());
        Ok(parts.join("; "))
    }
}
