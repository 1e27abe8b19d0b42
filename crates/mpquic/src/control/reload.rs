//! Live reload: SIGHUP or `mpquic reload` (POST /reload on the control socket) reads the
//! configuration file again and applies what changed while everything else keeps running.
//!
//! What applies live: a client's paths (added, removed, or changed: each changed path gets a new
//! connection made before its old one is closed; the others are not touched), its
//! `multipath_policy` within its kind (failover <-> balanced, or among the per-packet ones:
//! every path reconnects, so the server learns it from the hellos), the match rules of its
//! traffic classes (packets follow them from the next batch read; the classes themselves and
//! which one is the default stay), a server's
//! `clients:` list (fixed addresses and allowed LAN routes; sessions whose rules changed are
//! closed and rejoin under the new ones). Every other key is fixed for the life of the process:
//! a new file that changes one is refused as a whole, naming the keys, and the running
//! configuration stays, as it does for a file that does not load. The outcome goes to the log,
//! to `mpquic status` and to the metrics (`Record`).
//!
//! The roles do the applying (`client/apply.rs`, `server/apply.rs`); this module is what they share: the
//! trigger, what may change, the diff of the paths, and the record.

use std::fmt::Debug;
use std::sync::Mutex;

use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::config::{ClientConfig, Config, PathConfig, RoleConfig};
use crate::status::ReloadStatus;

/// A reload asked for, with where to answer (`mpquic reload` waits for the outcome; SIGHUP
/// does not).
pub type Request = Option<oneshot::Sender<Result<String, String>>>;

/// Asks the running instance for a reload.
#[derive(Clone)]
pub struct Trigger(mpsc::Sender<Request>);

/// The instance's end: requests, applied one at a time by its main loop.
pub type Requests = mpsc::Receiver<Request>;

pub fn channel() -> (Trigger, Requests) {
    // A few waiting requests are plenty: they all read the same file.
    let (tx, rx) = mpsc::channel(4);
    (Trigger(tx), rx)
}

impl Trigger {
    /// Reload and wait for the outcome: what changed, or why the new file was refused.
    pub async fn reload(&self) -> Result<String, String> {
        let (tx, rx) = oneshot::channel();
        self.0
            .send(Some(tx))
            .await
            .map_err(|_| "the instance is stopping".to_string())?;
        rx.await
            .map_err(|_| "the instance is stopping".to_string())?
    }

    /// A reload nobody waits for (SIGHUP); dropped if several are waiting already.
    pub fn hangup(&self) {
        let _ = self.0.try_send(None);
    }
}

/// Apply the reloads asked for (`requests`) to the instance running `running`, one at a time
/// (`apply` takes a new configuration `read` accepted, and says what it changed), recording each
/// outcome, until `until` resolves; returns its output. The main loop of both roles.
pub async fn serve_until<T>(
    mut requests: Requests,
    running: &Config,
    record: &Record,
    apply: impl Fn(Config) -> Result<String, String>,
    until: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(until);
    loop {
        tokio::select! {
            out = &mut until => return out,
            Some(reply) = requests.recv() => {
                record.finish(read(running).and_then(&apply), reply);
            }
        }
    }
}

/// The last reload's outcome, for status and metrics.
#[derive(Default)]
pub struct Record(Mutex<Option<ReloadStatus>>);

impl Record {
    /// Log and keep the outcome of a reload, and answer whoever asked for it.
    pub fn finish(&self, outcome: Result<String, String>, reply: Request) {
        match &outcome {
            Ok(what) => info!(changes = %what, "configuration reloaded"),
            Err(e) => {
                warn!(error = %e, "configuration reload refused; the running configuration stays")
            }
        }
        let at_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (ok, message) = match &outcome {
            Ok(m) => (true, m.clone()),
            Err(e) => (false, e.clone()),
        };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(ReloadStatus {
            ok,
            at_unix,
            message,
        });
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
    }

    pub fn last(&self) -> Option<ReloadStatus> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The configuration in `running.file` now, if it can replace `running` live: it loads, is for
/// the same role, and changes only what applies live (module doc).
pub fn read(running: &Config) -> Result<Config, String> {
    let new = Config::load(&running.file).map_err(|e| e.to_string().trim_end().to_string())?;
    let fixed = restart_needed(running, &new);
    if !fixed.is_empty() {
        return Err(format!(
            "{}: {} cannot change while running (restart the instance for that); nothing was applied",
            running.file.display(),
            fixed.join(", ")
        ));
    }
    for w in &new.warnings {
        warn!("{}: {w}", running.file.display());
    }
    Ok(new)
}

/// The keys (as the file names them) that differ between `old` and `new` and apply only at
/// start.
fn restart_needed(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut differ = |key: &'static str, a: &dyn Debug, b: &dyn Debug| {
        if format!("{a:?}") != format!("{b:?}") {
            keys.push(key);
        }
    };
    differ("tun_name", &old.tun_name, &new.tun_name);
    differ("tun_mtu", &old.tun_mtu, &new.tun_mtu);
    differ("log_level", &old.log_level, &new.log_level);
    differ("log_format", &old.log_json, &new.log_json);
    differ("tls_cert_file", &old.cert_file, &new.cert_file);
    differ("tls_key_file", &old.key_file, &new.key_file);
    differ(
        "tls_post_quantum",
        &old.tls_post_quantum,
        &new.tls_post_quantum,
    );
    differ("congestion_algorithm", &old.congestion, &new.congestion);
    differ("control_socket", &old.control_socket, &new.control_socket);
    differ("metrics_listen", &old.metrics_listen, &new.metrics_listen);
    differ(
        "dashboard_listen / dashboard_token",
        &old.dashboard,
        &new.dashboard,
    );
    differ("worker_threads", &old.worker_threads, &new.worker_threads);
    differ("tun_offload", &old.tun_offload, &new.tun_offload);
    match (&old.role, &new.role) {
        (RoleConfig::Client(a), RoleConfig::Client(b)) => {
            // Within its kind the policy changes live (`Bond::set_policy`).
            differ(
                "multipath_policy (between a per-packet policy and another)",
                &a.policy.per_packet(),
                &b.policy.per_packet(),
            );
            differ("tun_cidr", &a.requested, &b.requested);
            differ("lan_prefixes", &a.lan_prefixes, &b.lan_prefixes);
            differ("tls_server_name", &a.server_name, &b.server_name);
            differ("tls_ca_file", &a.ca_file, &b.ca_file);
            differ(
                "tls_insecure_skip_verify",
                &a.insecure_skip_verify,
                &b.insecure_skip_verify,
            );
            differ("fec", &a.fec, &b.fec);
            differ("stripe_port", &a.stripe_port, &b.stripe_port);
            differ("tcp_lane_port", &a.tcp_lane_port, &b.tcp_lane_port);
            // Without `classes:`, the one implicit class holds transport_mode (its policy,
            // congestion and FEC are the keys above); with them, everything of each class.
            match a.classes.iter().any(|k| k.explicit) || b.classes.iter().any(|k| k.explicit) {
                true => differ("classes", &a.classes, &b.classes),
                false => {
                    let modes =
                        |c: &ClientConfig| c.classes.iter().map(|k| k.mode).collect::<Vec<_>>();
                    differ("transport_mode", &modes(a), &modes(b));
                    let lane =
                        |c: &ClientConfig| c.classes.iter().map(|k| k.tcp_lane).collect::<Vec<_>>();
                    differ("tcp_lane", &lane(a), &lane(b))
                }
            }
            // The rules change live (`Client::apply`), not which class is the default: the
            // server sends the flows it has not seen in that one (the hellos say which).
            differ(
                "classes (the default class)",
                &a.classifier.default_class(),
                &b.classifier.default_class(),
            );
        }
        (RoleConfig::Server(a), RoleConfig::Server(b)) => {
            differ("bind_ip / remote_port (listen)", &a.listen, &b.listen);
            differ(
                "tun_cidr",
                &(a.tun_addr, a.prefix, a.ipv6),
                &(b.tun_addr, b.prefix, b.ipv6),
            );
            differ("tls_ca_file", &a.client_ca_file, &b.client_ca_file);
            differ("stripe_enabled / stripe_port", &a.stripe, &b.stripe);
            // The template and the tokens change live; the endpoint does not.
            let masque = |c: &crate::config::ServerConfig| c.masque.as_ref().map(|m| m.listen);
            differ("masque_listen", &masque(a), &masque(b));
            differ("tcp_lane_listen", &a.tcp_lane, &b.tcp_lane);
        }
        _ => keys.push("role"),
    }
    keys
}

/// How a client's paths changed between two configurations (matched by name).
#[derive(Debug, Default, PartialEq)]
pub struct PathChanges {
    pub added: Vec<PathConfig>,
    pub removed: Vec<String>,
    /// In their new form.
    pub changed: Vec<PathConfig>,
}

impl PathChanges {
    pub fn between(old: &[PathConfig], new: &[PathConfig]) -> PathChanges {
        let mut c = PathChanges::default();
        for p in new {
            match old.iter().find(|o| o.name == p.name) {
                None => c.added.push(p.clone()),
                Some(o) if o != p => c.changed.push(p.clone()),
                Some(_) => {}
            }
        }
        c.removed = (old.iter())
            .filter(|o| !new.iter().any(|p| p.name == o.name))
            .map(|o| o.name.clone())
            .collect();
        c
    }

    /// No path added, removed or changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }

    /// "paths: added wan3; removed wan1; changed wan2" (or "no change").
    pub fn summary(&self) -> String {
        fn names(v: &[PathConfig]) -> Vec<&str> {
            v.iter().map(|p| p.name.as_str()).collect()
        }
        let parts: Vec<String> = [
            ("added", names(&self.added)),
            ("removed", self.removed.iter().map(String::as_str).collect()),
            ("changed", names(&self.changed)),
        ]
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(what, v)| format!("{what} {}", v.join(", ")))
        .collect();
        match parts.is_empty() {
            true => "no change".into(),
            false => format!("paths: {}", parts.join("; ")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const CLIENT: &str = "role: client
tun_name: mpq0
tls_ca_file: ca.crt
tls_cert_file: c.crt
tls_key_file: c.key
remote_addr: 192.0.2.1
multipath_policy: failover
multipath_paths:
- {name: wan1, bind_ip: if:eth1, priority: 1}
- {name: wan2, bind_ip: if:eth2, priority: 2}
";

    fn client(text: &str) -> Config {
        Config::parse(text, Path::new("c.yaml")).unwrap()
    }

    fn paths(c: &Config) -> Vec<PathConfig> {
        match &c.role {
            RoleConfig::Client(c) => c.paths.clone(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn paths_are_matched_by_name() {
        let old = client(CLIENT);
        let new = client(&CLIENT.replace(
            "- {name: wan2, bind_ip: if:eth2, priority: 2}",
            "- {name: wan2, bind_ip: if:eth2, priority: 2, weight: 3}\n- {name: wan3, bind_ip: if:eth3}",
        ));
        let c = PathChanges::between(&paths(&old), &paths(&new));
        assert_eq!(c.summary(), "paths: added wan3; changed wan2");
        assert_eq!(c.changed[0].weight, 3);
        let gone = client(&CLIENT.replace("- {name: wan1, bind_ip: if:eth1, priority: 1}\n", ""));
        let c = PathChanges::between(&paths(&old), &paths(&gone));
        assert_eq!(c.summary(), "paths: removed wan1");
        let same = PathChanges::between(&paths(&old), &paths(&old));
        assert_eq!(same.summary(), "no change");
    }

    #[test]
    fn keys_fixed_at_start_are_named() {
        let old = client(CLIENT);
        let new = client(
            &CLIENT
                .replace("multipath_policy: failover", "multipath_policy: balanced")
                .replace("tun_name: mpq0", "tun_name: mpq1"),
        );
        assert_eq!(
            restart_needed(&old, &new),
            // The control socket's default follows tun_name.
            ["tun_name", "control_socket"]
        );
        // Paths, and a policy within its kind, apply live.
        let new = client(&CLIENT.replace("priority: 2}", "priority: 2, weight: 4}"));
        assert!(restart_needed(&old, &new).is_empty());
        let wlb = client(&CLIENT.replace("multipath_policy: failover", "multipath_policy: wlb"));
        assert_eq!(
            restart_needed(&old, &wlb),
            ["multipath_policy (between a per-packet policy and another)"]
        );
    }

    #[test]
    fn class_rules_change_live_and_the_classes_do_not() {
        let classes = "classes:\n- name: critical\n  match:\n  - protocol: udp\n    port: 5060\n- name: default\n";
        let old = client(&format!("{CLIENT}{classes}"));
        let rules = client(&format!("{CLIENT}{}", classes.replace("5060", "5060-5070")));
        assert!(restart_needed(&old, &rules).is_empty());
        let mode = client(&format!(
            "{CLIENT}{}",
            classes.replace(
                "- name: default\n",
                "- name: default\n  transport_mode: datagram\n"
            )
        ));
        assert_eq!(restart_needed(&old, &mode), ["classes"]);
        // The rules moved to the other class: the default class changed.
        let swapped = client(&format!(
            "{CLIENT}classes:\n- name: critical\n- name: default\n  match:\n  - protocol: udp\n"
        ));
        assert_eq!(
            restart_needed(&old, &swapped),
            ["classes (the default class)"]
        );
    }
}
