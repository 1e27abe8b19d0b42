//! One path at a time, for a client whose server does not bond (`protocol: masque`: a standard
//! CONNECT-IP server makes each connection a session of its own, with its own address). The
//! client starts so over CONNECT-IP until the first answer says the server is an mpquic one
//! (`TunnelCore::peer_speaks_mpquic`): then the turns end and every path dials. The client carries on the best
//! path that is connected (lowest `priority`, then configuration order); the others stand by
//! without a connection. A path dials when no better path is connected or about to be, so the
//! first choice is tried first and the next one only once it has failed; a better path that
//! connects again takes over, and the one it outranks closes and stands by.
//!
//! Which path that is follows from each path's state alone (`Standby`); the client's shell keeps
//! the states and waits on them. Such a server sends no probes, so the carrying connection's
//! death is seen from its ACKs (`ackwatch.rs`, fed by sampling: `AckWatch::on_sample`).

use std::time::Duration;

use crate::path::PathId;

/// A false verdict of the carrying path's ACK watch costs a new session (a redial, and at a
/// standard server perhaps a new address), not just a move to another live path as in the
/// native protocol, so the watch waits at least this long (a LAN-short path's bound is 50 ms,
/// which a peer descheduled for a moment exceeds).
pub const MIN_SILENCE: Duration = Duration::from_millis(200);

/// Where a path stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Not known to fail: it dials when its turn comes (at start, and after a better path took
    /// over from it).
    Ready,
    /// Connected: it carries, unless a better one is connected too (which it then hands over to).
    Connected,
    /// Its connection was lost or its last attempt failed: it keeps trying, but the paths after
    /// it do not wait for it.
    Failed,
}

/// The order of preference: lower `priority` first, then configuration order (the path's id
/// is given in that order when the client starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    pub priority: u32,
    pub id: PathId,
}

/// Every path's rank and standing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standby {
    paths: Vec<(Rank, Standing)>,
    /// The server bonds: every path may dial, none outranks another (`end`).
    ended: bool,
}

impl Standby {
    /// Path `rank.id` now stands so (added if new; its rank updated: a reload may change its
    /// priority).
    pub fn set(&mut self, rank: Rank, standing: Standing) {
        self.paths.retain(|(r, _)| r.id != rank.id);
        self.paths.push((rank, standing));
    }

    /// Path `id` is gone (removed by a reload).
    pub fn forget(&mut self, id: PathId) {
        self.paths.retain(|(r, _)| r.id != id);
    }

    fn better_than(&self, id: PathId) -> impl Iterator<Item = Standing> + '_ {
        let me = self.paths.iter().find(|(r, _)| r.id == id).map(|(r, _)| *r);
        (self.paths.iter())
            .filter(move |(r, _)| me.is_some_and(|m| *r < m))
            .map(|(_, s)| *s)
    }

    /// No turns from now on: the server turned out to bond (an mpquic server).
    pub fn end(&mut self) {
        self.ended = true;
    }

    /// Whether the paths still take turns.
    pub fn taking_turns(&self) -> bool {
        !self.ended
    }

    /// Path `id` may dial: no better path is connected or about to try (or the turns ended).
    pub fn may_dial(&self, id: PathId) -> bool {
        self.ended || self.better_than(id).all(|s| s == Standing::Failed)
    }

    /// Path `id` is connected, but so is a better one: it hands over and stands by.
    pub fn outranked(&self, id: PathId) -> bool {
        !self.ended && self.better_than(id).any(|s| s == Standing::Connected)
    }

    /// The paths connected now.
    pub fn connected(&self) -> impl Iterator<Item = PathId> + '_ {
        (self.paths.iter())
            .filter(|(_, s)| *s == Standing::Connected)
            .map(|(r, _)| r.id)
    }

    /// How many other paths there are besides `id`.
    pub fn others(&self, id: PathId) -> usize {
        self.paths.iter().filter(|(r, _)| r.id != id).count()
    }

    /// Path `id`'s standing (`None`: not known).
    pub fn standing(&self, id: PathId) -> Option<Standing> {
        (self.paths.iter())
            .find(|(r, _)| r.id == id)
            .map(|(_, s)| *s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Standing::*;

    fn three() -> (Standby, Vec<Rank>) {
        let ids: Vec<PathId> = (0..3).map(PathId::nth).collect();
        // p2 is preferred over p1 by its priority; p0 and p1 tie and go in order.
        let ranks = vec![
            Rank {
                priority: 2,
                id: ids[0],
            },
            Rank {
                priority: 2,
                id: ids[1],
            },
            Rank {
                priority: 1,
                id: ids[2],
            },
        ];
        let mut s = Standby::default();
        for r in &ranks {
            s.set(*r, Ready);
        }
        (s, ranks)
    }

    #[test]
    fn the_best_path_dials_first_and_the_next_only_once_it_failed() {
        let (mut s, r) = three();
        let order = |s: &Standby| r.iter().map(|x| s.may_dial(x.id)).collect::<Vec<_>>();
        assert_eq!(order(&s), [false, false, true]);
        s.set(r[2], Connected);
        assert_eq!(order(&s), [false, false, true]);
        // The best one lost its connection: it keeps trying, and the next one dials beside it.
        s.set(r[2], Failed);
        assert_eq!(order(&s), [true, false, true]);
        s.set(r[0], Failed);
        assert_eq!(order(&s), [true, true, true]);
    }

    #[test]
    fn a_better_path_that_connects_takes_over() {
        let (mut s, r) = three();
        s.set(r[2], Failed);
        s.set(r[0], Connected);
        assert!(!s.outranked(r[0].id));
        assert!(
            !s.may_dial(r[1].id),
            "the carrying path holds the worse ones back"
        );
        s.set(r[2], Connected);
        assert!(s.outranked(r[0].id));
        assert!(!s.outranked(r[2].id));
        // It stands by, ready to dial once the better one fails.
        s.set(r[0], Ready);
        assert!(!s.may_dial(r[0].id));
        s.set(r[2], Failed);
        assert!(s.may_dial(r[0].id));
    }

    #[test]
    fn a_server_that_bonds_ends_the_turns() {
        let (mut s, r) = three();
        s.set(r[2], Connected);
        s.set(r[0], Connected);
        assert!(s.taking_turns() && s.outranked(r[0].id) && !s.may_dial(r[1].id));
        s.end();
        assert!(!s.taking_turns());
        assert!(r.iter().all(|x| s.may_dial(x.id) && !s.outranked(x.id)));
    }

    #[test]
    fn a_reload_reorders_and_removes() {
        let (mut s, r) = three();
        s.set(
            Rank {
                priority: 9,
                ..r[2]
            },
            Ready,
        );
        assert!(s.may_dial(r[0].id) && !s.may_dial(r[2].id));
        s.forget(r[0].id);
        assert!(s.may_dial(r[1].id));
        assert_eq!(s.standing(r[0].id), None);
        // A path it does not know has nothing better.
        s.forget(r[1].id);
        assert!(s.may_dial(r[1].id) && !s.outranked(r[1].id));
    }
}
