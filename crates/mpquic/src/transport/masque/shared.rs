//! What the CONNECT-IP endpoint's connection drivers share (`listen.rs` makes it, `serve.rs`
//! uses it): the rules a request is judged by, and the refusal counter with its log.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use mpquic_core::connect_ip::{Template, TokenHash};
use tracing::warn;

use crate::transport::admit::Refused;

/// A refusal's cause is logged at most once in this long (with how many since), so a client
/// retrying with a wrong token cannot fill the log.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// What a request is judged against: swapped whole by a reload.
pub(super) struct Rules {
    pub(super) template: Template,
    pub(super) tokens: Vec<(String, TokenHash)>,
}

/// What the connection drivers share.
pub(super) struct Shared {
    pub(super) rules: RwLock<Arc<Rules>>,
    pub(super) refused: Refused,
    /// Per refusal cause: when it was last logged, and how many since.
    pub(super) logged: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl Shared {
    pub(super) fn rules(&self) -> Arc<Rules> {
        self.rules.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Count a refusal by `reason`, and log it unless the same cause was logged lately.
    pub(super) fn refuse(&self, reason: &'static str, log: impl FnOnce(u64)) {
        (self.refused)(reason);
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let entry = logged.entry(reason).or_insert((now - LOG_EVERY, 0));
        entry.1 += 1;
        if now.duration_since(entry.0) >= LOG_EVERY {
            log(entry.1);
            *entry = (now, 0);
        }
    }
}

/// Logged once per cause (`Shared::refuse`).
pub(super) fn log_refusal(reason: &str, detail: &str, remote: std::net::SocketAddr, count: u64) {
    warn!(%remote, reason, detail, refused_since_last_log = count, "CONNECT-IP request refused");
}
