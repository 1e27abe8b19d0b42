//! The client's side of one path at a time (`protocol: masque` to a server that does not bond;
//! the rules: core `standby.rs`):
//! every path's standing, which their tasks wait on, and the watch that sees the carrying
//! connection die.

use std::time::{Duration, Instant};

use mpquic_core::path::ackwatch::{self, AckWatch};
use mpquic_core::path::standby::{self, Rank, Standing};
use mpquic_core::PathId;
use tokio::sync::watch;

use crate::transport::PathTransport;

/// Every path's standing, shared by their tasks.
pub(super) struct Turns {
    states: watch::Sender<standby::Standby>,
}

impl Turns {
    pub(super) fn new() -> Turns {
        Turns {
            states: watch::Sender::new(standby::Standby::default()),
        }
    }

    pub(super) fn set(&self, id: PathId, priority: u32, standing: Standing) {
        let rank = Rank { priority, id };
        self.states.send_modify(|s| s.set(rank, standing));
    }

    /// No turns from now on (the server bonds): the paths waiting for theirs dial.
    pub(super) fn end(&self) {
        self.states.send_modify(|s| s.end());
    }

    /// Whether the paths still take turns.
    pub(super) fn taking(&self) -> bool {
        self.states.borrow().taking_turns()
    }

    /// `id`'s rank changed (a reload), its standing not.
    pub(super) fn rerank(&self, id: PathId, priority: u32) {
        let standing = self.states.borrow().standing(id);
        if let Some(s) = standing {
            self.set(id, priority, s);
        }
    }

    /// Path `id` takes turns until the returned guard is dropped (its task ends).
    pub(super) fn member(&self, id: PathId) -> Member<'_> {
        Member { turns: self, id }
    }

    /// Returns once path `id` may dial.
    pub(super) async fn turn(&self, id: PathId) {
        let mut rx = self.states.subscribe();
        // The sender lives as long as the client (which owns it and this call's caller).
        let _ = rx.wait_for(|s| s.may_dial(id)).await;
    }

    /// Returns once a better path than `id` is connected.
    pub(super) async fn outranked(&self, id: PathId) {
        let mut rx = self.states.subscribe();
        let _ = rx.wait_for(|s| s.outranked(id)).await;
    }

    /// Returns once another path than `id` is connected.
    pub(super) async fn another_connected(&self, id: PathId) {
        let mut rx = self.states.subscribe();
        let _ = rx.wait_for(|s| s.connected().any(|c| c != id)).await;
    }

    /// Path `id` stands by: ready for its turn, or failed but held back by a better path that
    /// carries or is trying (e.g. a standard server ended this one's session when the better
    /// one came back).
    pub(super) fn standing_by(&self, id: PathId) -> bool {
        let s = self.states.borrow();
        s.standing(id) == Some(Standing::Ready) || (s.standing(id).is_some() && !s.may_dial(id))
    }

    pub(super) fn is_outranked(&self, id: PathId) -> bool {
        self.states.borrow().outranked(id)
    }

    /// Another path is configured that could carry instead of `id`.
    pub(super) fn has_others(&self, id: PathId) -> bool {
        self.states.borrow().others(id) > 0
    }
}

/// A path in the turns; dropped with its task, it leaves them (a removed path must not hold
/// the worse ones back).
pub(super) struct Member<'a> {
    turns: &'a Turns,
    id: PathId,
}

impl Drop for Member<'_> {
    fn drop(&mut self) {
        let id = self.id;
        self.turns.states.send_modify(|s| s.forget(id));
    }
}

/// How often the carrying connection is looked at: a fraction of `standby::MIN_SILENCE`.
pub(super) const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The carrying connection's ACK watch, fed by sampling its counters (the server sends no
/// probes; the connection's keep-alives give an idle path something to acknowledge:
/// `quic::client_transport`).
#[derive(Default)]
pub(super) struct Liveness {
    watch: AckWatch,
    /// The connection's RTT estimate at the last sample.
    rtt: Option<Duration>,
    /// The largest UDP payload it has reached (its MTU discovery), when above QUIC's smallest.
    payload: Option<u16>,
}

impl Liveness {
    /// Look at `t` now: how long it has left data unacknowledged, once that is longer than a
    /// live path could (`ackwatch::bound` from its RTT, its deviation taken as half of it as
    /// before any sample, RFC 6298; and its loss so far; never below `standby::MIN_SILENCE`).
    pub(super) fn dead_for(&mut self, t: &dyn PathTransport, now: Instant) -> Option<Duration> {
        let st = t.stats();
        self.rtt = st.rtt.or(self.rtt);
        let reached = st
            .udp_payload
            .filter(|p| *p > mpquic_core::path::pmtu::FLOOR);
        self.payload = self.payload.max(reached);
        let acks = st.acks?;
        self.watch.on_sample(acks, t.load().in_flight > 0, now);
        let rtt = st.rtt?;
        let loss = st.lost_packets as f64 / st.sent_packets.max(1) as f64;
        let bound = ackwatch::bound(rtt, rtt / 2, loss).max(standby::MIN_SILENCE);
        let silent = self.watch.silent_for(now);
        (silent > bound).then_some(silent)
    }

    /// The connection's RTT as last sampled.
    pub(super) fn rtt(&self) -> Option<Duration> {
        self.rtt
    }

    /// The largest packets it has reached (a redial starts there).
    pub(super) fn payload(&self) -> Option<u16> {
        self.payload
    }
}
