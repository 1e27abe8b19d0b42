//! Deterministic simulator: the real client and server tunnel cores (`TunnelCore`, the state
//! machine the binary runs: router, health, resequencer, FEC, receive dispatch) exchange probes
//! and data over
//! the lab's link model (`mpquic-linkmodel`: delay, jitter, loss, duplication, reordering, rate,
//! one-way black holes) in virtual time, event by event. Hours of link behaviour run in
//! milliseconds and every run with the same inputs is identical, so the properties below are
//! checked over many generated cases. Between the cores sits a minimal model of the transport
//! (QUIC): each datagram carries a per-path packet number and a receiver drops numbers it has
//! seen, as QUIC does; the links may duplicate, so removing that check makes the
//! no-duplicate property fail. The model counts what each side sent and what its links lost
//! (the connection's counters the core's FEC, adaptive recovery and copies follow; a loss
//! counted, as QUIC declares it, once a later packet of the path is acknowledged), and a data packet
//! lost while its path carries on its stream (`transport_mode: auto`) is sent again a round trip
//! later, as QUIC retransmits a stream's lost frames. Every packet that arrives is acknowledged
//! at once by an ACK on the reverse link (which may lose it too): the packets each side has had
//! acknowledged are the count the core's ACK watch follows (one ACK per packet, never repeated).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use mpquic_core::fec::FecMode;
use mpquic_core::packet::PacketInfo;
use mpquic_core::path::delivery::Direction;
use mpquic_core::path::reconfig::{LinkKind, WallClock};
use mpquic_core::recovery::Carry;
use mpquic_core::reorder::reseq::MAX_WAIT;
use mpquic_core::tunnel::{LinkStats, Outgoing, Polled, Recorded, Routing, TunnelCore};
use mpquic_core::wire::{self, Datagram};
use mpquic_core::{HealthConfig, HealthMode, PathId, PathLoad, PathSpec, Policy, Router};
use mpquic_linkmodel::{Link, LinkSpec, LinkState};
use proptest::prelude::*;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Side {
    Client,
    Server,
}

impl Side {
    fn index(self) -> usize {
        self as usize
    }
    fn peer(self) -> Side {
        match self {
            Side::Client => Side::Server,
            Side::Server => Side::Client,
        }
    }
}

/// A datagram on a link: to the peer of the sender, on `path`, with the sender's packet number.
#[derive(Clone, Debug)]
struct Msg {
    to: Side,
    path: PathId,
    pn: u64,
    bytes: Vec<u8>,
    /// An ACK (no bytes): counted by its receiver, not acknowledged.
    ack: bool,
}

struct Sim {
    t0: Instant,
    now: Duration,
    /// Per path, the link from each side: `[client -> server, server -> client]`.
    links: Vec<[Link<Msg>; 2]>,
    client: TunnelCore,
    server: TunnelCore,
    /// Next packet number per sending side.
    next_pn: [u64; 2],
    /// Packet numbers each side has received, per path (the transport's duplicate check).
    seen: HashSet<(Side, PathId, u64)>,
    /// Duplicates the transport dropped.
    dup_dropped: u64,
    /// (side that received, flow port, sequence) of every delivered data packet.
    delivered: Vec<(Side, u16, u32)>,
    /// The lane (traffic class) of each packet in `delivered`, and when it was delivered.
    delivered_lanes: Vec<usize>,
    delivered_at: Vec<Duration>,
    /// Per-packet bonding: when each bonded packet (side, port, sequence) arrived, and the
    /// longest it was held before delivery.
    bonded_arrival: HashMap<(Side, u16, u32), Duration>,
    longest_hold: Duration,
    arrived: Vec<Msg>,
    polled: Polled,
    /// Per path, each side's (sent, lost) packets: its connection's counters.
    counters: Vec<[(u64, u64); 2]>,
    /// Per path, the ACKs each side received.
    acks: Vec<[u64; 2]>,
    /// Per path, the numbers of each side's packets lost on the link that its connection has
    /// not declared lost yet: QUIC declares a loss when a later packet is acknowledged, so none
    /// during a black hole.
    undeclared: Vec<[Vec<u64>; 2]>,
    /// When each side's core said it next has work (its last `poll`).
    next_poll: [Option<Instant>; 2],
    /// Stream frames lost on a link, to be sent again at the time: (due, side, path, bytes).
    retransmit: Vec<(Duration, Side, PathId, Vec<u8>)>,
    /// Per sending side: a middlebox in front of its links drops every data packet and lets
    /// control messages (probes, replies) pass (as a NAT on the client host that corrupts
    /// every UDP GSO segment, or a box that drops bursts).
    drop_data: [bool; 2],
}

/// A batch of one packet, with the headers the core writes in front of it.
struct OneBatch {
    bytes: Vec<u8>,
    header: usize,
}

impl Outgoing for OneBatch {
    fn packet(&self, _: usize) -> &[u8] {
        &self.bytes[self.header..]
    }
    fn headed(&self, _: usize) -> &[u8] {
        &self.bytes
    }
    fn push_header(&mut self, _: usize, header: &[u8]) -> bool {
        self.bytes.splice(0..0, header.iter().copied());
        self.header += header.len();
        true
    }
    fn headers_writable(&self) -> bool {
        true
    }
}

fn ip_packet(flow_port: u16, seq: u32) -> Vec<u8> {
    // Minimal IPv4/UDP packet; the sequence number rides in the payload.
    let mut p = vec![
        0x45, 0, 0, 32, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
    ];
    p.extend_from_slice(&flow_port.to_be_bytes());
    p.extend_from_slice(&5201u16.to_be_bytes());
    p.extend_from_slice(&[0, 12, 0, 0]);
    p.extend_from_slice(&seq.to_be_bytes());
    p
}

/// A link direction from a spec in the lab's syntax (e.g. "delay=20ms,loss=5%").
fn link(spec: &str, seed: u64) -> Link<Msg> {
    Link::new(LinkSpec::parse(spec).expect("valid link spec"), seed)
}

impl Sim {
    /// `links[i]`: path i's spec, the same in both directions.
    fn new(policy: Policy, specs: &[PathSpec], links: &[String], seed: u64) -> Sim {
        Sim::with_fec(policy, FecMode::Off, specs, links, seed)
    }

    /// `fec`: what each side protects its data with (the client's choice, both ways).
    fn with_fec(
        policy: Policy,
        fec: FecMode,
        specs: &[PathSpec],
        links: &[String],
        seed: u64,
    ) -> Sim {
        Sim::build(policy, fec, false, specs, links, seed)
    }

    /// `transport_mode: auto`: each path carries on its stream or as datagrams, as its core
    /// decides.
    fn adaptive(policy: Policy, specs: &[PathSpec], links: &[String], seed: u64) -> Sim {
        Sim::build(policy, FecMode::Off, true, specs, links, seed)
    }

    fn build(
        policy: Policy,
        fec: FecMode,
        adaptive: bool,
        specs: &[PathSpec],
        links: &[String],
        seed: u64,
    ) -> Sim {
        let t0 = Instant::now();
        // As in the product: the client probes, the server follows its view.
        let mut client = TunnelCore::new(policy, HealthMode::Probe, fec, None);
        let mut server = TunnelCore::new(policy, HealthMode::Follow, fec, None);
        // As in the product: the client's hello asks for counted replies (`path/delivery.rs`).
        server.peer_reads_counts();
        if adaptive {
            client = client.adaptive();
            server = server.adaptive();
        }
        let links: Vec<[Link<Msg>; 2]> = links
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let s = seed.wrapping_add(2 * i as u64);
                [link(l, s), link(l, s.wrapping_add(1))]
            })
            .collect();
        for (s, l) in specs.iter().zip(&links) {
            // As in the product: the connection's handshake measured the path's round trip.
            let handshake = LinkStats {
                rtt: Some(l[0].min_delay() + l[1].min_delay()),
                ..LinkStats::default()
            };
            for core in [&mut client, &mut server] {
                let id = core.path(s.clone(), usize::MAX).unwrap();
                core.connected(id, handshake, t0);
            }
        }
        Sim {
            t0,
            now: Duration::ZERO,
            links,
            client,
            server,
            next_pn: [0; 2],
            seen: HashSet::new(),
            dup_dropped: 0,
            delivered: Vec::new(),
            delivered_lanes: Vec::new(),
            delivered_at: Vec::new(),
            bonded_arrival: HashMap::new(),
            longest_hold: Duration::ZERO,
            arrived: Vec::new(),
            polled: Polled::default(),
            counters: vec![[(0, 0); 2]; specs.len()],
            acks: vec![[0; 2]; specs.len()],
            undeclared: vec![[Vec::new(), Vec::new()]; specs.len()],
            next_poll: [None; 2],
            retransmit: Vec::new(),
            drop_data: [false; 2],
        }
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    /// Black-hole (or restore) one direction of path `path` from `from`.
    fn set_blackhole(&mut self, from: Side, path: usize, on: bool) {
        let l = &mut self.links[path][from.index()];
        let mut spec = l.spec().clone();
        spec.state = if on {
            LinkState::Blackhole
        } else {
            LinkState::Up
        };
        l.set_spec(spec);
    }

    fn send(&mut self, from: Side, path: PathId, bytes: Vec<u8>) {
        self.send_as(from, path, bytes, false);
    }

    /// Send `bytes`; `data`: an inner packet, which goes on the path's stream while the
    /// sending core says so, and is then sent again a round trip after the link loses it.
    fn send_as(&mut self, from: Side, path: PathId, bytes: Vec<u8>, data: bool) {
        if data && self.drop_data[from.index()] {
            return;
        }
        let on_stream = data && self.core(from).carry(path) == Some(Carry::Stream);
        self.transmit(from, path, bytes, on_stream);
    }

    /// One packet onto the link; a stream's (`on_stream`) is sent again until it arrives.
    fn transmit(&mut self, from: Side, path: PathId, bytes: Vec<u8>, on_stream: bool) {
        let pn = self.next_pn[from.index()];
        self.next_pn[from.index()] += 1;
        let now = self.at();
        let len = bytes.len();
        let copy = on_stream.then(|| bytes.clone());
        let msg = Msg {
            to: from.peer(),
            path,
            pn,
            bytes,
            ack: false,
        };
        let link = &mut self.links[path.index()][from.index()];
        let dropped = |l: &Link<Msg>| {
            let s = &l.stats;
            s.dropped_state + s.dropped_loss + s.dropped_queue + s.dropped_mtu + s.dropped_codel
        };
        let before = dropped(link);
        link.push(now, msg, len, 0);
        let lost = dropped(link) > before;
        let rtt = link.min_delay() * 2;
        let c = &mut self.counters[path.index()][from.index()];
        c.0 += 1;
        if lost {
            // Declared when a later packet is acknowledged (`undeclared`).
            self.undeclared[path.index()][from.index()].push(pn);
            if let Some(bytes) = copy {
                self.retransmit.push((self.now + rtt, from, path, bytes));
            }
        }
    }

    fn core(&mut self, side: Side) -> &mut TunnelCore {
        match side {
            Side::Client => &mut self.client,
            Side::Server => &mut self.server,
        }
    }

    fn router(&mut self, side: Side) -> &mut Router {
        self.core(side).router_mut()
    }

    /// Send one data packet of flow `port` from `side`, routed, numbered and protected by the
    /// side's core as the shell's batches are; returns the index of the path the policy chose.
    fn send_data(&mut self, side: Side, port: u16, seq: u32) -> Option<usize> {
        self.send_in(side, 0, port, seq)
    }

    /// `send_data` in lane `lane` (a traffic class) of the side's core.
    fn send_in(&mut self, side: Side, lane: usize, port: u16, seq: u32) -> Option<usize> {
        let pkt = ip_packet(port, seq);
        let infos = [PacketInfo::parse(&pkt)];
        let now = self.at();
        self.refresh_loads(side);
        let mut batch = OneBatch {
            bytes: pkt,
            header: 0,
        };
        let mut routing = Routing::default();
        // Every path is connected (the links model its outages).
        self.core(side)
            .route_batch(lane, &[0], &infos, &mut batch, |_| true, now, &mut routing);
        for c in routing.copies.drain(..) {
            self.send(side, c.path, c.bytes);
        }
        let mut chosen = None;
        for (path, share) in routing.paths() {
            if !share.picks.is_empty() {
                self.send_as(side, path, batch.bytes.clone(), true);
                chosen = Some(path.index());
            }
            for r in &share.repairs {
                self.send(side, path, r.clone());
            }
        }
        chosen
    }

    /// What the shell tells the router before routing: each path's rate (the link's), RTT
    /// (twice its delay) and backlog (what waits in the link's queue from this side, at this
    /// sim's packet size).
    fn refresh_loads(&mut self, side: Side) {
        for i in 0..self.links.len() {
            let l = &self.links[i][side.index()];
            let load = PathLoad {
                rate: l.spec().rate_bps,
                rtt: Some(l.min_delay() * 2),
                backlog: (l.queued() * ip_packet(0, 0).len()) as u64,
                // No congestion window here: the schedulers judge room by time at the rate.
                ..PathLoad::default()
            };
            let id = self.router(side).paths().ids().nth(i).unwrap();
            self.router(side).set_load(id, load);
        }
    }

    /// Record a data packet of `lane` handed to the receiving side's TUN.
    fn deliver(&mut self, to: Side, lane: usize, p: &[u8]) {
        let port = u16::from_be_bytes([p[20], p[21]]);
        let seq = u32::from_be_bytes([p[28], p[29], p[30], p[31]]);
        if let Some(at) = self.bonded_arrival.remove(&(to, port, seq)) {
            self.longest_hold = self.longest_hold.max(self.now - at);
        }
        self.delivered.push((to, port, seq));
        self.delivered_lanes.push(lane);
        self.delivered_at.push(self.now);
    }

    /// `n` packets of flow `port` (sequence 0..n) from `side`, one every `gap`, then a second
    /// for the last ones to land.
    fn send_flow(&mut self, side: Side, port: u16, n: u32, gap: Duration) {
        self.send_seqs(side, port, 0..n, gap);
        self.run_until(self.now + Duration::from_secs(1));
    }

    /// Packets `seqs` of flow `port`, one every `gap`.
    fn send_seqs(&mut self, side: Side, port: u16, seqs: std::ops::Range<u32>, gap: Duration) {
        for seq in seqs {
            self.send_data(side, port, seq);
            let next = self.now + gap;
            self.run_until(next);
        }
    }

    /// Packets `side`'s FEC decoders rebuilt.
    fn recovered(&self, side: Side) -> u64 {
        let c = match side {
            Side::Client => &self.client,
            Side::Server => &self.server,
        };
        let ids = c.router().paths().ids();
        ids.filter_map(|id| Some(c.fec(id)?.dec.counters.recovered))
            .sum()
    }

    /// What a core handed over: packets to record, replies to send back on `path`.
    fn take(&mut self, side: Side, path: Option<PathId>, taken: Recorded) {
        for (p, lane) in taken.delivered.iter().zip(taken.lanes) {
            self.deliver(side, lane, p);
        }
        for a in taken.answers {
            self.send(side, path.expect("replies come from receiving"), a);
        }
    }

    /// The next moment anything has work: a router's timer or a link's delivery.
    fn next_event(&self) -> Option<Duration> {
        let links = self
            .links
            .iter()
            .flat_map(|l| l.iter().filter_map(Link::next_deadline));
        let fec = |c: &TunnelCore| {
            let ids = c.router().paths().ids();
            ids.filter_map(|id| c.fec(id)?.enc.deadline()).min()
        };
        let retransmit = self.retransmit.iter().map(|r| self.t0 + r.0).min();
        [
            self.client.router().next_deadline(),
            self.server.router().next_deadline(),
            fec(&self.client),
            fec(&self.server),
            retransmit,
            self.next_poll[0],
            self.next_poll[1],
        ]
        .into_iter()
        .flatten()
        .chain(links)
        .min()
        .map(|t| t.saturating_duration_since(self.t0))
    }

    /// Run until `until`, event by event: routers' timers (probes), link deliveries.
    fn run_until(&mut self, until: Duration) {
        loop {
            for side in [Side::Client, Side::Server] {
                let now = self.at();
                let mut taken = Recorded::default();
                let mut polled = std::mem::take(&mut self.polled);
                let counters: Vec<(u64, u64, u64, Duration)> = (self.counters.iter())
                    .zip(&self.acks)
                    .zip(&self.links)
                    .map(|((c, a), l)| {
                        let (s, lost) = c[side.index()];
                        (s, lost, a[side.index()], l[side.index()].min_delay() * 2)
                    })
                    .collect();
                // Every path is connected (the links model its outages).
                self.next_poll[side.index()] = self.core(side).poll(
                    now,
                    |id| {
                        let (sent_packets, lost_packets, acks, rtt) = counters[id.index()];
                        Some(LinkStats {
                            sent_packets,
                            lost_packets,
                            acks: Some(acks),
                            rtt: Some(rtt),
                            ..LinkStats::default()
                        })
                    },
                    &mut taken,
                    &mut polled,
                );
                self.take(side, None, taken);
                for p in &polled.probes {
                    self.send(
                        side,
                        p.path,
                        wire::encode_probe_view(p.seq, &p.view).to_vec(),
                    );
                }
                for (path, repairs) in polled.repairs.drain(..) {
                    for r in repairs {
                        self.send(side, path, r);
                    }
                }
                self.polled = polled;
            }
            let due: Vec<_> = {
                let now = self.now;
                let (due, later) = std::mem::take(&mut self.retransmit)
                    .into_iter()
                    .partition(|r| r.0 <= now);
                self.retransmit = later;
                due
            };
            for (_, side, path, bytes) in due {
                self.transmit(side, path, bytes, true);
            }
            let now = self.at();
            let mut arrived = std::mem::take(&mut self.arrived);
            for l in self.links.iter_mut().flatten() {
                l.poll(now, &mut arrived);
            }
            for m in arrived.drain(..) {
                self.receive(m);
            }
            self.arrived = arrived;
            // A deadline that does not move on after its poll is a core bug; step past it (a
            // millisecond, the shell's timer resolution) so the properties fail rather than the
            // simulator hang.
            let next = match self.next_event() {
                Some(t) if t <= self.now => self.now + Duration::from_millis(1),
                Some(t) => t,
                None => until,
            };
            if next >= until {
                self.now = until;
                return;
            }
            self.now = next;
        }
    }

    fn receive(&mut self, m: Msg) {
        if m.ack {
            self.acks[m.path.index()][m.to.index()] += 1;
            let lost = &mut self.undeclared[m.path.index()][m.to.index()];
            let before = lost.len();
            lost.retain(|&pn| pn >= m.pn);
            let declared = (before - lost.len()) as u64;
            self.counters[m.path.index()][m.to.index()].1 += declared;
            return;
        }
        let ack = Msg {
            to: m.to.peer(),
            path: m.path,
            // The packet it acknowledges (`undeclared`).
            pn: m.pn,
            bytes: Vec::new(),
            ack: true,
        };
        let now = self.at();
        self.links[m.path.index()][m.to.index()].push(now, ack, 40, 0);
        if !self.seen.insert((m.to, m.path, m.pn)) {
            self.dup_dropped += 1;
            return;
        }
        // Per-packet bonding: when each numbered packet arrived, for the longest hold.
        let inner = match wire::decode(&m.bytes) {
            Some(Datagram::FecData { packet, .. }) => wire::decode(packet),
            d => d,
        };
        let inner = match inner {
            Some(Datagram::Classed { inner, .. }) => wire::decode(inner),
            d => d,
        };
        if let Some(Datagram::Bonded { packet, .. }) = inner {
            let port = u16::from_be_bytes([packet[20], packet[21]]);
            let n = u32::from_be_bytes([packet[28], packet[29], packet[30], packet[31]]);
            self.bonded_arrival
                .entry((m.to, port, n))
                .or_insert(self.now);
        }
        let now = self.at();
        let mut taken = Recorded::default();
        let got = self
            .core(m.to)
            .on_datagram(m.path, &m.bytes, now, &mut taken);
        // The shell's wake-up and transition handling have no counterpart here: the sim polls
        // at every event.
        let _ = got;
        self.take(m.to, Some(m.path), taken);
    }
}

fn spec(name: &str, priority: u32, weight: u32) -> PathSpec {
    PathSpec {
        name: name.into(),
        priority,
        weight,
        ..Default::default()
    }
}

fn delay(ms: u64) -> String {
    format!("delay={ms}ms")
}

/// Two paths (primary wan1, backup wan2) with these one-way delays, on the failover policy.
fn failover_sim(delays: (u64, u64), seed: u64) -> Sim {
    let specs = [spec("wan1", 1, 1), spec("wan2", 2, 1)];
    Sim::new(
        Policy::Failover,
        &specs,
        &[delay(delays.0), delay(delays.1)],
        seed,
    )
}

/// Ping-like traffic every 10 ms from both sides on the failover policy; returns, for each side,
/// the time after `fail_at` at which it last sent on path 0, and the time it returned after `repair_at`.
fn failover_case(
    delays: (u64, u64),
    block: (bool, bool),
    fail_at: Duration,
    repair_at: Duration,
    seed: u64,
) -> (Sim, [Option<Duration>; 2], [Option<Duration>; 2]) {
    let mut sim = failover_sim(delays, seed);
    let mut last_on_primary = [None, None];
    let mut back_on_primary = [None, None];
    let end = repair_at + Duration::from_secs(8);
    let mut seq = 0;
    while sim.now < end {
        let failed = sim.now >= fail_at && sim.now < repair_at;
        sim.set_blackhole(Side::Client, 0, failed && block.0);
        sim.set_blackhole(Side::Server, 0, failed && block.1);
        for (i, side) in [Side::Client, Side::Server].into_iter().enumerate() {
            let path = sim.send_data(side, 7, seq);
            if path == Some(0) && sim.now >= fail_at && sim.now < repair_at {
                last_on_primary[i] = Some(sim.now - fail_at);
            }
            if path == Some(0) && sim.now >= repair_at && back_on_primary[i].is_none() {
                back_on_primary[i] = Some(sim.now - repair_at);
            }
        }
        seq += 1;
        let next = sim.now + Duration::from_millis(10);
        sim.run_until(next);
    }
    (sim, last_on_primary, back_on_primary)
}

/// `failover_case`'s outcome: each side left the dead primary within `bound` of the fault, and
/// came back to it within 5 s of the repair.
fn left_and_returned(
    last: [Option<Duration>; 2],
    back: [Option<Duration>; 2],
    bound: Duration,
) -> Result<(), TestCaseError> {
    for side in 0..2 {
        let gap = last[side].unwrap_or_default();
        prop_assert!(
            gap < bound,
            "side {side} stayed on the dead path for {gap:?} (bound {bound:?})"
        );
        let b = back[side].expect("returned to the primary");
        prop_assert!(
            b < Duration::from_secs(5),
            "side {side} took {b:?} to return"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A path that stops working in either or both directions is abandoned by both sides within
    /// 1 s (the acceptance bound), and taken back within 5 s of repair.
    #[test]
    fn failover_leaves_black_hole_fast_and_returns(
        d0 in 2u64..60, d1 in 2u64..120,
        dir in 0usize..3,
        fail_ms in 2_000u64..4_000,
        seed in any::<u64>(),
    ) {
        let block = [(true, true), (true, false), (false, true)][dir];
        let fail_at = Duration::from_millis(fail_ms);
        let repair_at = fail_at + Duration::from_secs(5);
        let (_sim, last, back) = failover_case((d0, d1), block, fail_at, repair_at, seed);
        left_and_returned(last, back, Duration::from_secs(1))?;
    }

    /// Long paths (up to 1 s of round trip: a satellite, an LTE link's full queue) under
    /// traffic (10 ms pings both ways): neither changes state after it comes up, whatever the
    /// other's delay; a black hole on the primary, in either or both directions, is left
    /// within its own bound (1 s, or on a long path the round trip its last replies may take
    /// to arrive, two round trips and a probe interval), and the primary is taken back after
    /// the repair, once (a path back from an outage was judged stalled a round trip later:
    /// the replies in flight carried the peer's counts from before).
    #[test]
    fn long_paths_stay_up_and_fail_over_within_their_own_bound(
        d0 in 2u64..500, d1 in 2u64..500,
        dir in 0usize..3,
        fail_ms in 4_000u64..6_000,
        seed in any::<u64>(),
    ) {
        let block = [(true, true), (true, false), (false, true)][dir];
        let fail_at = Duration::from_millis(fail_ms);
        let repair_at = fail_at + Duration::from_secs(5);
        let (sim, last, back) = failover_case((d0, d1), block, fail_at, repair_at, seed);
        // The client's paths (the prober decides): up once each, the primary down and up
        // again once for its black hole. (The server may flip once more when its own ACK
        // watch sees the fault before the client's probes say so.)
        let transitions = |core: &TunnelCore| -> Vec<u64> {
            (core.router().paths().ids())
                .map(|id| core.router().paths().get(id).health.as_ref().unwrap().transitions)
                .collect()
        };
        prop_assert_eq!(transitions(&sim.client), vec![3, 1], "delays {:?}", (d0, d1));
        prop_assert_eq!(transitions(&sim.server)[1], 1, "delays {:?}", (d0, d1));
        let rtt = Duration::from_millis(2 * d0);
        // Replies to the probes sent before the fault arrive for up to a round trip after it
        // (client to server dark), then its silence bound (two round trips and a probe
        // interval) runs.
        let bound = Duration::from_secs(1).max(rtt * 3 + Duration::from_millis(200));
        left_and_returned(last, back, bound)?;
    }

    /// Failover from the data: under traffic (10 ms pings both ways), a primary of up to 20 ms
    /// RTT that stops acknowledging, in either or both directions, is left by both sides within
    /// 100 ms (its probes alone took 270 ms here), and taken back after the repair.
    #[test]
    fn traffic_leaves_a_black_hole_within_100ms(
        d0 in 1u64..10, d1 in 2u64..60,
        dir in 0usize..3,
        fail_ms in 2_000u64..4_000,
        seed in any::<u64>(),
    ) {
        let block = [(true, true), (true, false), (false, true)][dir];
        let fail_at = Duration::from_millis(fail_ms);
        let repair_at = fail_at + Duration::from_secs(3);
        let (sim, last, back) = failover_case((d0, d1), block, fail_at, repair_at, seed);
        for side in 0..2 {
            let gap = last[side].unwrap_or_default();
            prop_assert!(gap <= Duration::from_millis(100), "side {side} stayed on the dead path for {gap:?}");
            prop_assert!(back[side].is_some(), "side {side} did not return");
        }
        let silences: u64 = (sim.client.router().paths().ids())
            .map(|id| sim.client.ack_watch(id).unwrap().silences)
            .sum();
        prop_assert!(silences >= 1, "the client's data did not notice");
    }

    /// Random loss is not silence: a primary losing up to 20% both ways under 10 ms pings is
    /// not taken out of use by its ACKs (at most once in 20 s, where the probes' loss estimate
    /// trails the loss).
    #[test]
    fn random_loss_does_not_silence_an_active_path(
        loss in 0.0f64..0.2,
        d0 in 1u64..30,
        seed in any::<u64>(),
    ) {
        let specs = [spec("wan1", 1, 1), spec("wan2", 2, 1)];
        let l0 = format!("delay={d0}ms,loss={:.3}%", loss * 100.0);
        let mut sim = Sim::new(Policy::Failover, &specs, &[l0, delay(20)], seed);
        sim.run_until(Duration::from_secs(1));
        for seq in 0..2000u32 {
            sim.send_data(Side::Client, 7, seq);
            sim.send_data(Side::Server, 7, seq);
            let next = sim.now + Duration::from_millis(10);
            sim.run_until(next);
        }
        let count = |c: &TunnelCore| c.ack_watch(c.router().paths().ids().next().unwrap()).unwrap().silences;
        let (cs, ss) = (count(&sim.client), count(&sim.server));
        println!("loss {:.1}% d0 {d0}: silences client {cs} server {ss}", loss * 100.0);
        prop_assert!(cs <= 1 && ss <= 1, "silences: client {cs}, server {ss}");
    }

    /// A quiet tunnel probes slowly, but the first packet wakes it: whatever direction of the
    /// primary died during the quiet spell, and however long before the traffic starts,
    /// nothing either side sends from 1 s after the start on is lost.
    #[test]
    fn a_quiet_tunnel_woken_onto_a_dead_path_recovers_within_a_second(
        d0 in 2u64..60, d1 in 2u64..120,
        dir in 0usize..3,
        fail_ms in 3_000u64..6_000,
        wait_ms in 0u64..3_000,
        seed in any::<u64>(),
    ) {
        let block = [(true, true), (true, false), (false, true)][dir];
        let fail_at = Duration::from_millis(fail_ms);
        let start = fail_at + Duration::from_millis(wait_ms);
        let lost = quiet_failover_case((d0, d1), block, fail_at, start, Duration::from_secs(1), seed);
        prop_assert!(lost[0].is_empty(), "client packets lost after 1 s: {:?}", lost[0]);
        prop_assert!(lost[1].is_empty(), "server packets lost after 1 s: {:?}", lost[1]);
    }

    /// New flows are placed in proportion to weight: each path's flow count stays within one flow
    /// of its exact weight share, and every flow keeps one path (per-flow order is preserved even
    /// with very different path delays).
    #[test]
    fn balanced_follows_weights_and_keeps_flow_order(
        weights in proptest::collection::vec(1u32..6, 2..4),
        delays in proptest::collection::vec(1u64..80, 4),
        flows in 10u16..80,
        seed in any::<u64>(),
    ) {
        let specs: Vec<_> = weights.iter().enumerate().map(|(i, w)| spec(&format!("p{i}"), 1, *w)).collect();
        let links: Vec<String> = (0..specs.len()).map(|i| delay(delays[i])).collect();
        let mut sim = Sim::new(Policy::Balanced, &specs, &links, seed);
        sim.run_until(Duration::from_millis(500));
        let mut placed = vec![0u32; specs.len()];
        let mut path_of = HashMap::new();
        for round in 0..20u32 {
            for f in 0..flows {
                let p = sim.send_data(Side::Client, 1000 + f, round).expect("a path is up");
                if round == 0 {
                    placed[p] += 1;
                    path_of.insert(f, p);
                }
                prop_assert_eq!(path_of[&f], p, "flow moved between paths");
            }
            let next = sim.now + Duration::from_millis(5);
            sim.run_until(next);
        }
        sim.run_until(sim.now + Duration::from_millis(200));
        let total_w: u32 = weights.iter().sum();
        for (i, w) in weights.iter().enumerate() {
            let exact = f64::from(flows) * f64::from(*w) / f64::from(total_w);
            prop_assert!((f64::from(placed[i]) - exact).abs() <= 1.0,
                "path {i} weight {w}: {} flows, exact share {exact:.2}", placed[i]);
        }
        // Per-flow order and no duplicates at the receiver.
        let mut last: HashMap<u16, u32> = HashMap::new();
        let mut seen = HashSet::new();
        for (_, port, seq) in &sim.delivered {
            prop_assert!(seen.insert((*port, *seq)), "delivered twice");
            if let Some(prev) = last.insert(*port, *seq) {
                prop_assert!(*seq > prev, "flow {port} reordered");
            }
        }
        prop_assert_eq!(seen.len(), 20 * flows as usize);
    }

    /// Per-packet bonding over two paths of different rates and delays (and some loss, jitter
    /// or reordering): one flow's packets use both paths, reach the receiver in order (except
    /// those that arrive after their gap was given up, which the resequencer counts as late),
    /// never twice, and none is held longer than the resequencer's bound. A link's own
    /// reordering (jitter up to 10 ms that reorders, or 2% of packets overtaking the rest by
    /// the link's whole delay) is put back in order like the paths' difference.
    #[test]
    fn per_packet_bonding_keeps_each_flow_in_order_and_uses_both_paths(
        per_packet in prop_oneof![Just(Policy::Wlb), Just(Policy::MinRtt)],
        delays in (1u64..40, 1u64..40),
        rates in (1u64..4, 1u64..4),
        loss in prop_oneof![Just(0.0f64), 0.0f64..0.05],
        order in prop_oneof![
            Just(String::new()),
            (1u64..10).prop_map(|j| format!(",jitter={j}ms,keep_order=false")),
            Just(",reorder=2%".to_string()),
        ],
        seed in any::<u64>(),
    ) {
        let specs = [spec("a", 1, 1), spec("b", 1, 1)];
        let links = [
            format!("rate={}mbit,delay={}ms,loss={:.3}%{order}", rates.0, delays.0, loss * 100.0),
            format!("rate={}mbit,delay={}ms,loss={:.3}%{order}", rates.1, delays.1, loss * 100.0),
        ];
        let mut sim = Sim::new(per_packet, &specs, &links, seed);
        sim.run_until(Duration::from_millis(500));
        // Three flows together offer 80% of the two paths' sum, more than either carries
        // (their rates are within 4x of each other), for a second.
        let bits = ip_packet(0, 0).len() as u64 * 8;
        let gap = Duration::from_nanos(bits * 1000 * 10 / (8 * (rates.0 + rates.1)));
        let mut used = [0u32; 2];
        let mut n = 0u32;
        let end = sim.now + Duration::from_secs(1);
        while sim.now < end {
            if let Some(p) = sim.send_data(Side::Client, 1000 + (n % 3) as u16, n / 3) {
                used[p] += 1;
            }
            n += 1;
            let next = sim.now + gap;
            sim.run_until(next);
        }
        sim.run_until(sim.now + Duration::from_secs(2));
        prop_assert!(used[0] > n / 8 && used[1] > n / 8, "both paths used: {used:?}");
        let mut last: HashMap<u16, u32> = HashMap::new();
        let mut seen = HashSet::new();
        let mut out_of_order = Vec::new();
        for ((_, port, seq), at) in sim.delivered.iter().zip(&sim.delivered_at) {
            prop_assert!(seen.insert((*port, *seq)), "delivered twice");
            match last.get(port) {
                Some(prev) if seq < prev => out_of_order.push(*at),
                _ => { last.insert(*port, *seq); }
            }
        }
        let c = sim.server.router().lanes()[0].reseq().counters;
        prop_assert_eq!(out_of_order.len() as u64, c.late,
            "every out-of-order delivery is a counted late one");
        if loss == 0.0 && order.is_empty() {
            prop_assert_eq!(c.late, 0);
        } else if loss == 0.0 {
            // A link that reorders is known as such from its first reordered packet on: only
            // the gaps given up before that may come late, in one burst (a packet that
            // overtakes the rest by the link's whole delay gets every packet in flight on that
            // path given up at once: 150 of 12,500 here, with packets of 40 bytes). After it,
            // only a gap whose wait ran out may still come late, a few packets: such a give-up
            // that turns out early is how the wait learns to stretch (`Stretch`; seen: one
            // packet 580 ms after the burst, 1 timeout).
            if let Some(first) = out_of_order.first() {
                let burst = Duration::from_millis(delays.0.max(delays.1)) + MAX_WAIT;
                let after = out_of_order.iter().filter(|t| **t - *first > burst).count() as u64;
                prop_assert!(after == 0 || (c.timeouts > 0 && after <= u64::from(n) / 200),
                    "late packets from {first:?} to {:?} ({} of {n}; {after} after the first burst, {} give-ups by timeout)",
                    out_of_order.last(), c.late, c.timeouts);
            }
        }
        prop_assert_eq!(sim.server.router().lanes()[0].reseq().holding(), 0);
        prop_assert!(sim.longest_hold <= MAX_WAIT + Duration::from_millis(1),
            "held {:?}", sim.longest_hold);
    }

    /// `redundant` over two lossy paths: every packet goes both ways, the receiver hands each
    /// on once, in order, and loses only what both paths lost.
    #[test]
    fn redundant_delivers_once_and_loses_only_what_both_paths_lose(
        delays in (1u64..40, 1u64..40),
        loss in (0.0f64..0.15, 0.0f64..0.15),
        seed in any::<u64>(),
    ) {
        let specs = [spec("a", 1, 1), spec("b", 1, 1)];
        let links = [
            format!("delay={}ms,loss={:.3}%", delays.0, loss.0 * 100.0),
            format!("delay={}ms,loss={:.3}%", delays.1, loss.1 * 100.0),
        ];
        let mut sim = Sim::new(Policy::Redundant, &specs, &links, seed);
        sim.run_until(Duration::from_millis(500));
        let n = 3000u32;
        sim.send_flow(Side::Client, 1000, n, Duration::from_millis(2));
        let mut seen = HashSet::new();
        let mut last = None;
        let mut out_of_order = 0u64;
        for (_, _, seq) in &sim.delivered {
            prop_assert!(seen.insert(*seq), "delivered twice");
            match last {
                Some(l) if *seq < l => out_of_order += 1,
                _ => last = Some(*seq),
            }
        }
        let c = sim.server.router().lanes()[0].reseq().counters;
        prop_assert_eq!(out_of_order, c.late);
        // Both copies of most packets arrived; the second was dropped, not delivered.
        prop_assert!(c.duplicates as f64 >= 0.5 * f64::from(n), "duplicates {}", c.duplicates);
        // Packets sent while one path was down (a lossy path's probes can take it down for a
        // moment) went on the other alone and are lost at its rate.
        let tx: Vec<u64> = sim.client.router().paths().iter().map(|(_, p)| p.counters.tx_packets).collect();
        let single = f64::from(n) - tx.iter().copied().min().unwrap_or(0) as f64;
        prop_assert!(single <= 0.5 * f64::from(n), "copies on both paths: {tx:?}");
        let lost = f64::from(n) - seen.len() as f64;
        let expected = f64::from(n) * loss.0 * loss.1 + single * loss.0.max(loss.1);
        prop_assert!(lost <= 2.0 * expected + 8.0, "lost {lost}, expected {expected:.1} (single {single})");
    }

    /// Links that lose, duplicate, reorder and jitter never make a packet arrive twice (the
    /// transport's packet numbers catch the link's copies), and every packet that is delivered
    /// belongs to what was sent.
    #[test]
    fn lossy_duplicating_reordering_links_never_deliver_twice(
        loss in 0.0f64..0.2, dup in 0.0f64..0.3, reorder in 0.0f64..0.3,
        fec in prop_oneof![Just("off"), Just("auto"), Just("4/2")],
        seed in any::<u64>(),
    ) {
        let specs = [spec("a", 1, 1), spec("b", 1, 1)];
        let l = format!("delay=20ms,jitter=5ms,loss={:.3}%,dup={:.3}%,reorder={:.3}%",
            loss * 100.0, dup * 100.0, reorder * 100.0);
        let fec = FecMode::parse(fec).unwrap();
        let mut sim = Sim::with_fec(Policy::Balanced, fec, &specs, &[l.clone(), l], seed);
        for seq in 0..2000u32 {
            sim.send_data(Side::Client, (seq % 16) as u16, seq);
            let next = sim.now + Duration::from_millis(2);
            sim.run_until(next);
        }
        sim.run_until(sim.now + Duration::from_millis(500));
        let mut seen = HashSet::new();
        for d in &sim.delivered {
            prop_assert!(seen.insert(*d), "delivered twice: {:?}", d);
            prop_assert!(d.2 < 2000);
        }
        // The links did duplicate (when asked to) and the copies reached the receiver, where
        // the transport dropped them: the property is not vacuous.
        let copies: u64 = sim.links.iter().flatten().map(|l| l.stats.duplicated).sum();
        prop_assert!(dup < 0.05 || (copies > 0 && sim.dup_dropped > 0), "no copies at dup={dup}");
        // With fixed FEC on a lossy link, lost packets were rebuilt (and still delivered once).
        if fec != FecMode::Off && fec != FecMode::Auto && loss > 0.03 {
            prop_assert!(sim.recovered(Side::Server) > 0, "nothing recovered at loss={loss}");
        }
    }

    /// FEC on one lossy path, run by the core's own receive dispatch: data and repair packets
    /// cross the link, the receiver rebuilds what it can, delivers each packet once, and loses
    /// far less than the link (K=10, M=2 leaves well under half of a loss up to 6%).
    #[test]
    fn fec_recovers_most_of_a_lossy_paths_loss(
        loss in 0.01f64..0.06,
        delay in 2u64..40,
        seed in any::<u64>(),
    ) {
        let specs = [spec("a", 1, 1)];
        let l = format!("delay={delay}ms,loss={:.3}%", loss * 100.0);
        let fec = FecMode::parse("10/2").unwrap();
        let mut sim = Sim::with_fec(Policy::Failover, fec, &specs, &[l], seed);
        sim.run_until(Duration::from_millis(500));
        let n = 4000u32;
        sim.send_flow(Side::Client, 9, n, Duration::from_millis(1));
        let mut seen = HashSet::new();
        for d in sim.delivered.iter().filter(|d| d.0 == Side::Server) {
            prop_assert!(seen.insert(d.2), "delivered twice: {:?}", d);
        }
        let lost = f64::from(n - seen.len() as u32) / f64::from(n);
        prop_assert!(sim.recovered(Side::Server) > 0);
        prop_assert!(lost < 0.5 * loss + 0.002, "lost {:.2}% of packets on a link losing {:.2}%",
            lost * 100.0, loss * 100.0);
    }
}

/// `transport_mode: auto` on one path (`failover`), or on two alike paths bonded per packet
/// (`wlb`, busy enough for datagrams when clean at a packet every 0.5 ms), after the paths came
/// up.
fn adaptive_flow(link: &str, bonded: bool, seed: u64) -> Sim {
    let (policy, specs) = match bonded {
        true => (Policy::Wlb, vec![spec("a", 1, 1), spec("b", 1, 1)]),
        false => (Policy::Failover, vec![spec("a", 1, 1)]),
    };
    let links = vec![link.to_string(); specs.len()];
    let mut sim = Sim::adaptive(policy, &specs, &links, seed);
    sim.run_until(Duration::from_millis(500));
    sim
}

fn carry(sim: &Sim, side: Side) -> Carry {
    let c = match side {
        Side::Client => &sim.client,
        Side::Server => &sim.server,
    };
    c.carry(c.router().paths().ids().next().unwrap()).unwrap()
}

/// The sequence numbers of flow `port` that `side` received, each checked to arrive once.
fn received_once(sim: &Sim, side: Side, port: u16) -> Result<HashSet<u32>, TestCaseError> {
    let mut seen = HashSet::new();
    for d in sim.delivered.iter().filter(|d| d.0 == side && d.1 == port) {
        prop_assert!(seen.insert(d.2), "delivered twice: {:?}", d);
    }
    Ok(seen)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A lossy path under `auto` never leaves its stream, so every packet arrives, once.
    #[test]
    fn auto_on_a_lossy_path_loses_nothing(
        loss in 0.005f64..0.2,
        delay in 2u64..40,
        seed in any::<u64>(),
    ) {
        let l = format!("delay={delay}ms,loss={:.3}%", loss * 100.0);
        let mut sim = adaptive_flow(&l, false, seed);
        let n = 3000u32;
        sim.send_flow(Side::Client, 7, n, Duration::from_micros(500));
        let seen = received_once(&sim, Side::Server, 7)?;
        prop_assert_eq!(seen.len() as u32, n, "lost on a path the core knew to be lossy");
        prop_assert_eq!(carry(&sim, Side::Client), Carry::Stream);
    }

    /// One clean path at a rate its stream carries as well (not bonded) stays on the stream:
    /// datagrams would gain nothing there, and loss starting later would reach the inner flows
    /// for a round trip.
    #[test]
    fn auto_keeps_a_single_path_at_a_modest_rate_on_its_stream(
        delay in 2u64..40,
        seed in any::<u64>(),
    ) {
        let mut sim = adaptive_flow(&format!("delay={delay}ms"), false, seed);
        sim.send_seqs(Side::Client, 9, 0..6000, Duration::from_micros(500));
        prop_assert_eq!(carry(&sim, Side::Client), Carry::Stream);
        let id = sim.client.router().paths().ids().next().unwrap();
        prop_assert_eq!(sim.client.recovery(id).unwrap().to_stream, 0);
    }

    /// A clean busy path bonded with another under `auto` carries datagrams after its first
    /// second; loss that starts then moves it to its stream at the first loss, so at most the
    /// packets in flight before that loss was known are lost: the link's share of what the path
    /// sent until a later packet's ACK declared it, bounded here at three times the share of two
    /// round trips, plus a few. Two, not one: what was already on the link when its loss began
    /// and QUIC's time threshold (9/8 of the RTT) come on top of the round trip: over 40
    /// seeds each the losses' median was about twice one round trip's share (12 of 5.9 at 5%
    /// and 27 ms one way, at most 20; 33 of 17.7 at 15%; 7 of 3.2 at 2% and 38 ms), and a
    /// bound on one round trip failed now and then (22 lost, bound 21).
    #[test]
    fn auto_moves_a_path_to_its_stream_at_its_first_loss(
        loss in 0.01f64..0.2,
        delay in 2u64..40,
        seed in any::<u64>(),
    ) {
        let mut sim = adaptive_flow(&format!("delay={delay}ms"), true, seed);
        // Two paths: each takes half, ~2000 packets/s.
        let gap = Duration::from_micros(250);
        sim.send_seqs(Side::Client, 8, 0..8000, gap);
        prop_assert_eq!(carry(&sim, Side::Client), Carry::Datagram, "clean and busy: datagrams");
        let l = &mut sim.links[0][Side::Client.index()];
        let mut s = l.spec().clone();
        s.loss = loss;
        l.set_spec(s);
        sim.send_seqs(Side::Client, 8, 8000..16000, gap);
        sim.run_until(sim.now + Duration::from_secs(1));
        let seen = received_once(&sim, Side::Server, 8)?;
        // Half the flow on this path: 2000 packets/s, for two round trips and a poll's step.
        let exposed = 2000.0 * (4 * delay + 5) as f64 / 1000.0;
        let bound = (3.0 * loss * exposed).ceil() as usize + 3;
        prop_assert!(16000 - seen.len() <= bound, "lost {} packets (bound {})", 16000 - seen.len(), bound);
        prop_assert_eq!(carry(&sim, Side::Client), Carry::Stream);
    }
}

/// A tunnel at rest (quiet: slow probing) whose primary path is black-holed in `block`'s
/// directions at `fail_at`; ping-like traffic from both sides every 10 ms from `start` for 3 s.
/// Returns the sequence numbers each side sent at or after `start + settle` that never arrived.
fn quiet_failover_case(
    delays: (u64, u64),
    block: (bool, bool),
    fail_at: Duration,
    start: Duration,
    settle: Duration,
    seed: u64,
) -> [Vec<u32>; 2] {
    let mut sim = failover_sim(delays, seed);
    sim.run_until(fail_at);
    assert!(
        sim.client.router().paths().iter().all(|(_, p)| {
            p.health.as_ref().unwrap().probe_interval()
                == HealthConfig::default().quiet_probe_interval
        }),
        "the tunnel went quiet before the failure"
    );
    sim.set_blackhole(Side::Client, 0, block.0);
    sim.set_blackhole(Side::Server, 0, block.1);
    sim.run_until(start);
    let mut sent: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
    let mut seq = 0;
    while sim.now < start + Duration::from_secs(3) {
        for (i, side) in [Side::Client, Side::Server].into_iter().enumerate() {
            sim.send_data(side, 7, seq);
            if sim.now >= start + settle {
                sent[i].push(seq);
            }
        }
        seq += 1;
        let next = sim.now + Duration::from_millis(10);
        sim.run_until(next);
    }
    sim.run_until(sim.now + Duration::from_secs(1));
    let arrived = |to: Side| -> HashSet<u32> {
        sim.delivered
            .iter()
            .filter(|d| d.0 == to)
            .map(|d| d.2)
            .collect()
    };
    let (at_server, at_client) = (arrived(Side::Server), arrived(Side::Client));
    [
        sent[0]
            .iter()
            .copied()
            .filter(|s| !at_server.contains(s))
            .collect(),
        sent[1]
            .iter()
            .copied()
            .filter(|s| !at_client.contains(s))
            .collect(),
    ]
}

/// A concrete scenario printed for the reader: the seed's test 4 (14 ms primary, 35 ms secondary).
#[test]
fn seed_failover_scenario_gaps() {
    for (label, block) in [("both", (true, true)), ("down-only", (false, true))] {
        let (sim, last, back) = failover_case(
            (7, 17),
            block,
            Duration::from_secs(3),
            Duration::from_secs(8),
            42,
        );
        println!(
            "{label}: client left primary after {:?}, server after {:?}; back after {:?}/{:?}; transitions {}",
            last[0],
            last[1],
            back[0],
            back[1],
            sim.client.router().paths().iter().next().unwrap().1.health.as_ref().unwrap().transitions
        );
        assert!(last[0].unwrap_or_default() < Duration::from_millis(600));
    }
}

/// A tunnel with traffic classes: lane `k` of both cores schedules by `lanes[k]`, every lane
/// over the same two paths (one prober and health each).
/// A call (a packet every 20 ms each way) on the failover policy over a Starlink path (wan1,
/// 30 ms) and another (wan2, 40 ms), with wan1 losing everything for `burst` from each of
/// Starlink's reconfigurations at 12 and 27 s past the minute. `link`: wan1 is configured as
/// Starlink. Returns the sim and how many packets each side sent.
fn starlink_call(link: LinkKind, burst: Duration, seed: u64) -> (Sim, u32) {
    let mut wan1 = spec("wan1", 1, 1);
    wan1.link = link;
    let bursts = [Duration::from_secs(7), Duration::from_secs(22)];
    let (sim, sent) = call_through_bursts(wan1, &bursts, burst, Duration::from_secs(25), seed);
    (sim, sent[bursts.len() - 1])
}

/// A call (50 packets/s each way, port 9) over two paths, wan1 (`wan1`, 30 ms one way)
/// and wan2 (40 ms, metered: no copies on it all along, so what is copied is the
/// reconfiguration's or the loss's), failover, for `secs`; wan1 loses everything for `burst`
/// from each of `bursts`. The sim starts 5 s past a whole minute of the wall clock: Starlink's
/// reconfigurations fall at 7, 22, 37, 52 s... into it. Returns the sim and how many packets
/// each side had sent by each of `bursts` (the last: in all).
fn call_through_bursts(
    wan1: PathSpec,
    bursts: &[Duration],
    burst: Duration,
    secs: Duration,
    seed: u64,
) -> (Sim, Vec<u32>) {
    let specs = [
        wan1,
        PathSpec {
            metered: true,
            ..spec("wan2", 1, 1)
        },
    ];
    let mut sim = Sim::new(Policy::Failover, &specs, &[delay(30), delay(40)], seed);
    let clock = WallClock::new(sim.t0, Duration::from_secs(1_800_000_005));
    for side in [Side::Client, Side::Server] {
        sim.core(side).set_wall_clock(clock);
    }
    let mut seq = 0;
    let mut sent_by = Vec::new();
    while sim.now < secs {
        let out = bursts.iter().any(|&b| sim.now >= b && sim.now < b + burst);
        sim.set_blackhole(Side::Client, 0, out);
        sim.set_blackhole(Side::Server, 0, out);
        for side in [Side::Client, Side::Server] {
            sim.send_data(side, 9, seq);
        }
        seq += 1;
        sent_by.extend(
            bursts
                .iter()
                .skip(sent_by.len())
                .filter(|&&b| b <= sim.now)
                .map(|_| seq),
        );
        let next = sim.now + Duration::from_millis(20);
        sim.run_until(next);
    }
    let end = sim.now + Duration::from_secs(1);
    sim.run_until(end);
    sent_by.truncate(bursts.len().saturating_sub(1));
    sent_by.push(seq);
    (sim, sent_by)
}

/// The call's packets (port 9) that `side` received from the first `upto` sent.
fn call_received(sim: &Sim, side: Side, upto: std::ops::Range<u32>) -> usize {
    let got = sim.delivered.iter().filter(|d| d.0 == side && d.1 == 9);
    got.filter(|d| upto.contains(&d.2)).count()
}

/// A path whose `link` is not configured, that loses a burst at each of Starlink's
/// reconfigurations, is recognised as Starlink by the client within its first eight, the
/// server learns it from the client's probes, and from then on the call rides through the
/// bursts on copies (it lost its packets in the earlier ones). One losing the same bursts at
/// other seconds is never recognised.
#[test]
fn an_unconfigured_starlink_path_is_recognised_and_then_its_bursts_are_covered() {
    let mut wan1 = spec("wan1", 1, 1);
    wan1.detect_link = true;
    let burst = Duration::from_millis(150);
    // Every boundary from 7 s to 172 s: twelve.
    let at: Vec<Duration> = (0..12).map(|k| Duration::from_secs(7 + 15 * k)).collect();
    let (mut sim, sent_by) =
        call_through_bursts(wan1.clone(), &at, burst, Duration::from_secs(180), 3);
    for side in [Side::Client, Side::Server] {
        let paths = sim.router(side).paths();
        let p = paths.get(paths.find("wan1").expect("wan1"));
        assert!(p.recognised, "{side:?}: {:?}", p.detector.evidence());
        assert_eq!(p.link(), LinkKind::Starlink);
    }
    // The first bursts took some of the call; the last two (after the eighth boundary's
    // verdict at the latest), none.
    let (before, last_two) = (sent_by[1], sent_by[9]..sent_by[11]);
    assert!(call_received(&sim, Side::Server, 0..before) < before as usize);
    for side in [Side::Client, Side::Server] {
        let got = call_received(&sim, side, last_two.clone());
        assert_eq!(
            got,
            last_two.len(),
            "{side:?}: the call lost packets to a recognised burst"
        );
    }
    // The same bursts 5.5 s off the boundaries.
    let off: Vec<Duration> = at
        .iter()
        .map(|&b| b + Duration::from_millis(5500))
        .collect();
    let (mut sim, _) = call_through_bursts(wan1, &off, burst, Duration::from_secs(180), 3);
    for side in [Side::Client, Side::Server] {
        let paths = sim.router(side).paths();
        let p = paths.get(paths.find("wan1").expect("wan1"));
        assert!(!p.recognised, "{side:?}: {:?}", p.detector.evidence());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// A path known to be Starlink gets copies of a call's packets on the other path across
    /// each reconfiguration: the loss burst there takes none of them, and none is delivered
    /// twice. Without `link: starlink`, the same burst takes the call's packets (datagram
    /// mode: nothing else recovers them).
    #[test]
    fn a_call_rides_through_starlink_reconfigurations(
        burst_ms in 20u64..=200,
        seed in any::<u64>(),
    ) {
        let burst = Duration::from_millis(burst_ms);
        let (sim, sent) = starlink_call(LinkKind::Starlink, burst, seed);
        for side in [Side::Client, Side::Server] {
            let seen = received_once(&sim, side, 9)?;
            prop_assert_eq!(seen.len() as u32, sent, "{:?} lost some of the call", side);
        }
        let (sim, sent) = starlink_call(LinkKind::Other, burst, seed);
        let got = sim.delivered.iter().filter(|d| d.0 == Side::Server && d.1 == 9).count();
        prop_assert!(got as u32 <= sent - 2 * (burst_ms as u32 / 20 - 1), "{} of {}", got, sent);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// A call (50 packets/s each way) on a failover tunnel whose primary loses 5-20% of its
    /// packets at random (datagram mode: nothing retransmits them), the other path metered (a
    /// data budget: no copies on it all along): once the path's connection has declared a
    /// loss, the call's packets go on the other path too, so the call loses only what went in
    /// the round trip before that (a few; without copies: 5-20% of its 500 packets each way),
    /// and while the other path is dark; none is delivered twice. The other path, carrying
    /// copies alone, is not taken down when they go unacknowledged. A second after the path is
    /// clean again, the copies stop.
    #[test]
    fn a_call_beside_a_losing_path_gets_copies_on_the_other(
        loss in 0.05f64..0.2,
        seed in any::<u64>(),
    ) {
        let specs = [spec("wan1", 1, 1), PathSpec { metered: true, ..spec("wan2", 1, 1) }];
        let lossy = format!("delay=20ms,loss={:.1}%", loss * 100.0);
        let mut sim = Sim::new(Policy::Failover, &specs, &[lossy, delay(30)], seed);
        let call = |sim: &mut Sim, seq: &mut u32, secs: u64| {
            let end = sim.now + Duration::from_secs(secs);
            while sim.now < end {
                for side in [Side::Client, Side::Server] {
                    sim.send_data(side, 9, *seq);
                }
                *seq += 1;
                let next = sim.now + Duration::from_millis(20);
                sim.run_until(next);
            }
        };
        let mut seq = 0u32;
        call(&mut sim, &mut seq, 5);
        // wan2 stops for 600 ms (an LTE cell's dip) while it carries the copies alone: not
        // taken down for their missing ACKs (its probes judge it).
        for side in [Side::Client, Side::Server] {
            sim.set_blackhole(side, 1, true);
        }
        call(&mut sim, &mut seq, 1);
        for side in [Side::Client, Side::Server] {
            sim.set_blackhole(side, 1, false);
        }
        let wan2 = sim.client.router().paths().find("wan2").expect("wan2");
        for side in [Side::Client, Side::Server] {
            let silences = sim.core(side).ack_watch(wan2).map_or(0, |w| w.silences);
            prop_assert_eq!(silences, 0, "{:?}: wan2 taken down by its ACK watch", side);
        }
        call(&mut sim, &mut seq, 4);
        let sent = seq;
        let end = sim.now + Duration::from_secs(1);
        sim.run_until(end);
        for side in [Side::Client, Side::Server] {
            let seen = received_once(&sim, side, 9)?;
            // (Packets sent while wan2 was dark whose wan1 copy was lost too are lost: about
            // `loss` of 50.)
            let lost: Vec<u32> = (0..sent).filter(|q| !seen.contains(q)).collect();
            prop_assert!(lost.len() <= 25, "{:?} lost {:?} of {}", side, lost, sent);
        }
        let copies = |sim: &mut Sim| {
            let paths = sim.router(Side::Client).paths();
            paths.get(paths.find("wan1").expect("wan1")).counters.loss_copies
        };
        prop_assert!(copies(&mut sim) > 0);
        // wan1 clean again: the copies stop within a second and a round trip.
        for side in [Side::Client, Side::Server] {
            let l = &mut sim.links[0][side.index()];
            let mut s = l.spec().clone();
            s.loss = 0.0;
            l.set_spec(s);
        }
        call(&mut sim, &mut seq, 2);
        let before = copies(&mut sim);
        call(&mut sim, &mut seq, 3);
        prop_assert_eq!(copies(&mut sim), before, "copies went on over a clean path");
    }

    /// The same call and lossy primary with the other path spare (a primary, not metered): its
    /// packets go on both from the first, so the random loss takes none of them, not even
    /// before the first loss is declared, and none is delivered twice; clean or not, the copies
    /// go on (a loss on a radio link comes unannounced).
    #[test]
    fn a_call_gets_copies_on_a_spare_path_from_the_first_packet(
        loss in 0.05f64..0.2,
        seed in any::<u64>(),
    ) {
        let specs = [spec("wan1", 1, 1), spec("wan2", 1, 1)];
        let lossy = format!("delay=20ms,loss={:.1}%", loss * 100.0);
        let mut sim = Sim::new(Policy::Failover, &specs, &[lossy, delay(30)], seed);
        // Both paths up (their first probes answered) before the call starts.
        let start = sim.now + Duration::from_secs(1);
        sim.run_until(start);
        let sent = 250u32;
        for seq in 0..sent {
            for side in [Side::Client, Side::Server] {
                sim.send_data(side, 9, seq);
            }
            let next = sim.now + Duration::from_millis(20);
            sim.run_until(next);
        }
        let end = sim.now + Duration::from_secs(1);
        sim.run_until(end);
        for side in [Side::Client, Side::Server] {
            let seen = received_once(&sim, side, 9)?;
            prop_assert_eq!(seen.len() as u32, sent, "{:?} lost some of the call", side);
            // Copied while both paths were up: most packets (at 20% loss wan1's probes take it
            // out of use now and then, for up to a second: 42 of 250 packets in one seed, sent
            // once on wan2 meanwhile).
            let paths = sim.router(side).paths();
            let (spare, loss) = paths.iter().fold((0, 0), |(s, l), (_, p)| {
                (s + p.counters.spare_copies, l + p.counters.loss_copies)
            });
            prop_assert!(spare >= u64::from(sent) * 3 / 4, "{:?}: {} copies", side, spare);
            prop_assert_eq!(loss, 0, "{:?}", side);
        }
    }
}

fn lanes_sim(lanes: &[Policy], links: &[String], seed: u64) -> Sim {
    let specs = [spec("a", 1, 1), spec("b", 2, 1)];
    let mut sim = Sim::new(lanes[0], &specs, links, seed);
    for &p in &lanes[1..] {
        for core in [&mut sim.client, &mut sim.server] {
            core.add_lane(p, false).expect("within MAX_LANES");
        }
    }
    sim
}

/// Lane `k`'s packets carry `k` in the top byte of their sequence number.
const LANE_SHIFT: u32 = 24;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Classes over one path layer: each lane's packets arrive in that lane, once, the flows of
    /// each per-packet lane in order (numbered flows of different lanes share slot numbers, so a
    /// resequencer shared between lanes would mix them up), and over lossless paths nothing is
    /// lost. (A flow of a lane that is not numbered may be reordered when a lossy path's probes
    /// move it to the other path: nothing puts such flows back in order.)
    #[test]
    fn classes_share_the_paths_and_keep_their_packets_apart(
        lanes in proptest::collection::vec(
            prop_oneof![Just(Policy::Failover), Just(Policy::Balanced), Just(Policy::Wlb),
                Just(Policy::MinRtt), Just(Policy::Redundant)], 2..4),
        delays in (1u64..30, 1u64..30),
        loss in prop_oneof![Just(0.0f64), 0.0f64..0.03],
        seed in any::<u64>(),
    ) {
        let links = [
            format!("rate=4mbit,delay={}ms,loss={:.3}%", delays.0, loss * 100.0),
            format!("rate=4mbit,delay={}ms,loss={:.3}%", delays.1, loss * 100.0),
        ];
        let mut sim = lanes_sim(&lanes, &links, seed);
        sim.run_until(Duration::from_millis(500));
        // The same two flow ports in every lane, one packet every 2 ms in turn.
        let n = 600u32;
        for i in 0..n {
            let lane = (i as usize) % lanes.len();
            let seq = (u32::try_from(lane).unwrap() << LANE_SHIFT) | (i / lanes.len() as u32);
            sim.send_in(Side::Client, lane, 1000 + (i % 2) as u16, seq);
            let next = sim.now + Duration::from_millis(2);
            sim.run_until(next);
        }
        sim.run_until(sim.now + Duration::from_secs(2));
        let mut seen = HashSet::new();
        let mut last: HashMap<(usize, u16), u32> = HashMap::new();
        let mut out_of_order = 0u64;
        for (d, lane) in sim.delivered.iter().zip(&sim.delivered_lanes) {
            let (_, port, seq) = *d;
            prop_assert_eq!((seq >> LANE_SHIFT) as usize, *lane, "delivered in its own lane");
            prop_assert!(seen.insert((port, seq)), "delivered twice: {:?}", d);
            if !lanes[*lane].per_packet() {
                continue;
            }
            match last.get(&(*lane, port)) {
                Some(prev) if seq < *prev => out_of_order += 1,
                _ => { last.insert((*lane, port), seq); }
            }
        }
        let late: u64 = sim.server.router().lanes().iter().map(|l| l.reseq().counters.late).sum();
        prop_assert_eq!(out_of_order, late, "every out-of-order delivery is a counted late one");
        if loss == 0.0 {
            prop_assert_eq!(seen.len(), n as usize, "lossless: everything arrives");
            prop_assert_eq!(late, 0);
        }
    }
}

/// A peer that sends in a lane this side does not have (its classes are not ours): every such
/// packet is counted as malformed on its path, none is delivered, and the first lane still works.
#[test]
fn a_lane_this_side_does_not_have_is_counted_not_delivered() {
    let links = [delay(5), delay(5)];
    let mut sim = lanes_sim(&[Policy::Failover, Policy::Wlb], &links, 7);
    // The server knows one lane only.
    sim.server = TunnelCore::new(Policy::Failover, HealthMode::Follow, FecMode::Off, None);
    for s in [spec("a", 1, 1), spec("b", 2, 1)] {
        let id = sim.server.path(s, usize::MAX).unwrap();
        sim.server.connected(id, LinkStats::default(), sim.at());
    }
    sim.run_until(Duration::from_millis(500));
    for seq in 0..20 {
        sim.send_in(Side::Client, 1, 1000, seq);
        sim.send_in(Side::Client, 0, 1001, seq);
        let next = sim.now + Duration::from_millis(5);
        sim.run_until(next);
    }
    sim.run_until(sim.now + Duration::from_secs(1));
    let ports: Vec<u16> = sim.delivered.iter().map(|d| d.1).collect();
    assert_eq!(ports, vec![1001; 20]);
    let malformed: u64 = (sim.server.router().paths().iter())
        .map(|(_, p)| p.drops.get(mpquic_core::DropReason::Malformed))
        .sum();
    assert_eq!(malformed, 20);
}

/// A path that answers its probes but delivers none of the data it carries, one way or the
/// other (`path/delivery.rs`): the client, told the server's counts in its probe replies, takes
/// it down within the watch's bound (2 s without any arrival, plus the probe that shows it),
/// says which way, and it stays down (the shell replaces its connection); the same path with
/// 20% loss each way, or idle, is never taken down so.
/// Data both ways every 10 ms (none unless `send`) until `until`; `after` sees each step.
fn exchange(sim: &mut Sim, until: Duration, send: bool, mut after: impl FnMut(&mut Sim)) {
    let mut seq = 0;
    while sim.now < until {
        if send {
            for side in [Side::Client, Side::Server] {
                sim.send_data(side, 7, seq);
            }
        }
        seq += 1;
        let next = sim.now + Duration::from_millis(10);
        sim.run_until(next);
        after(sim);
    }
}

#[test]
fn a_path_that_answers_probes_but_delivers_nothing_is_taken_down() {
    for from in [Side::Client, Side::Server] {
        let mut sim = Sim::new(Policy::Failover, &[spec("a", 1, 1)], &[delay(15)], 5);
        let (mut down_at, mut was_up) = (None, false);
        exchange(&mut sim, Duration::from_secs(10), true, |sim| {
            sim.drop_data[from.index()] = sim.now >= Duration::from_secs(3);
            let id = sim.client.router().paths().find("a").unwrap();
            let up = sim.client.router().paths().get(id).is_up();
            was_up |= up;
            if was_up && down_at.is_none() && !up {
                down_at = Some(sim.now);
            }
        });
        let id = sim.client.router().paths().find("a").unwrap();
        let paths = sim.client.router().paths();
        let at = down_at.expect("taken down");
        assert!(
            at >= Duration::from_secs(5) && at <= Duration::from_millis(5300),
            "{from:?}: down at {at:?}"
        );
        let way = if from == Side::Client {
            Direction::Out
        } else {
            Direction::In
        };
        assert_eq!(paths.stalled(id), Some(way), "{from:?}");
        assert!(
            !paths.get(id).is_up(),
            "{from:?}: stays down though its probes are answered"
        );
        assert_eq!(paths.get(id).delivery_stalls, 1);
    }
    for link in ["delay=15ms,loss=20%", "delay=15ms"] {
        let mut sim = Sim::new(Policy::Failover, &[spec("a", 1, 1)], &[link.to_string()], 9);
        exchange(
            &mut sim,
            Duration::from_secs(20),
            link.contains("loss"),
            |_| {},
        );
        let id = sim.client.router().paths().find("a").unwrap();
        assert_eq!(
            sim.client.router().paths().get(id).delivery_stalls,
            0,
            "{link}"
        );
    }
}
