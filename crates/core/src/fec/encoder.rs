//! The sending side of FEC on one path: numbers the packets of the open group, keeps a copy of
//! each, and closes the group (repair packets out) when it is full or `MAX_GROUP_DELAY` old.

use std::time::Instant;

use super::codec::Codecs;
use super::redundancy::auto_parity;
use super::{FecCounters, FecMode, AUTO_DATA, MAX_GROUP_DELAY};
use crate::path::loss::LossEstimate;
use crate::wire::{self, FEC_DATA_HEADER, FEC_REPAIR_HEADER};

/// A shard starts with its packet's length, so a rebuilt packet knows where it ends.
pub(super) const LEN_PREFIX: usize = 2;

#[derive(Debug, Clone)]
pub struct Encoder {
    mode: FecMode,
    group: u16,
    /// The open group's packets as shards without padding (`[len u16][packet]`); buffers kept.
    shards: Vec<Vec<u8>>,
    count: usize,
    longest: usize,
    opened: Option<Instant>,
    loss: LossEstimate,
    codecs: Codecs,
    pub counters: FecCounters,
}

impl Encoder {
    pub fn new(mode: FecMode) -> Encoder {
        Encoder {
            mode,
            group: 0,
            shards: Vec::new(),
            count: 0,
            longest: 0,
            opened: None,
            loss: LossEstimate::default(),
            codecs: Codecs::default(),
            counters: FecCounters::default(),
        }
    }

    pub fn mode(&self) -> FecMode {
        self.mode
    }

    /// The path's loss as the encoder sees it (0..1).
    pub fn loss(&self) -> f64 {
        self.loss.loss()
    }

    /// The repair count a full group gets now (0: packets go bare).
    pub fn parity(&self) -> usize {
        match self.mode {
            FecMode::Off => 0,
            FecMode::Fixed { m, .. } => usize::from(m),
            FecMode::Auto => auto_parity(AUTO_DATA, self.loss.loss()),
        }
    }

    fn group_size(&self) -> usize {
        match self.mode {
            FecMode::Off => 0,
            FecMode::Fixed { k, .. } => usize::from(k),
            FecMode::Auto => AUTO_DATA,
        }
    }

    /// The transport's cumulative sent / lost packet counters (`auto` follows them), and the
    /// path's probe loss (a prior until the counters have said enough).
    pub fn on_counters(&mut self, now: Instant, sent: u64, lost: u64, probe_loss: f64) {
        self.loss.hint(probe_loss);
        self.loss.on_counters(now, sent, lost);
    }

    /// `packet` leaves on this path now. Returns the FEC header to send in front of it, or
    /// `None` to send it bare (FEC off, or `auto` on a clean path). Repair packets of a group
    /// this packet fills are appended to `repairs`, each a whole datagram.
    pub fn on_data(
        &mut self,
        now: Instant,
        packet: &[u8],
        repairs: &mut Vec<Vec<u8>>,
    ) -> Option<[u8; FEC_DATA_HEADER]> {
        if self.count == 0 {
            if self.parity() == 0 {
                return None;
            }
            self.opened = Some(now);
        }
        let header = wire::encode_fec_data(self.group, self.count as u8);
        if self.shards.len() <= self.count {
            self.shards.push(Vec::new());
        }
        let shard = &mut self.shards[self.count];
        shard.clear();
        shard.extend_from_slice(&(packet.len() as u16).to_be_bytes());
        shard.extend_from_slice(packet);
        self.count += 1;
        self.longest = self.longest.max(packet.len());
        self.counters.protected_packets += 1;
        self.counters.protected_bytes += packet.len() as u64;
        if self.count >= self.group_size() {
            self.close(repairs);
        }
        Some(header)
    }

    /// Close the open group if it is `MAX_GROUP_DELAY` old (its repairs into `repairs`).
    pub fn poll(&mut self, now: Instant, repairs: &mut Vec<Vec<u8>>) {
        if self.deadline().is_some_and(|t| now >= t) {
            self.close(repairs);
        }
    }

    /// When `poll` next has work.
    pub fn deadline(&self) -> Option<Instant> {
        self.opened.map(|t| t + MAX_GROUP_DELAY)
    }

    /// Repair packets the transport did not take (counted; the group is not retried).
    pub fn refused(&mut self, n: u64) {
        self.counters.repair_refused += n;
    }

    fn close(&mut self, repairs: &mut Vec<Vec<u8>>) {
        let k = self.count;
        let m = match self.mode {
            FecMode::Off => 0,
            FecMode::Fixed { m, .. } => usize::from(m),
            FecMode::Auto => auto_parity(k, self.loss.loss()),
        };
        if k > 0 && m > 0 {
            let shard_len = LEN_PREFIX + self.longest;
            for s in &mut self.shards[..k] {
                s.resize(shard_len, 0);
            }
            let mut out: Vec<Vec<u8>> = (0..m)
                .map(|r| {
                    let mut d = Vec::with_capacity(FEC_REPAIR_HEADER + shard_len);
                    d.extend_from_slice(&wire::encode_fec_repair(
                        self.group, r as u8, k as u8, m as u8,
                    ));
                    d.resize(FEC_REPAIR_HEADER + shard_len, 0);
                    d
                })
                .collect();
            let encoded = match self.codecs.get(k as u8, m as u8) {
                Some(rs) => {
                    let mut parity: Vec<&mut [u8]> = out
                        .iter_mut()
                        .map(|d| &mut d[FEC_REPAIR_HEADER..])
                        .collect();
                    rs.encode_sep(&self.shards[..k], &mut parity).is_ok()
                }
                None => false,
            };
            // Shapes within the wire bounds always encode; if one ever did not, its
            // repairs would be garbage, so none are sent (the group is simply unprotected).
            if encoded {
                for d in out {
                    self.counters.repair_sent += 1;
                    self.counters.repair_bytes += d.len() as u64;
                    repairs.push(d);
                }
            }
        }
        self.group = self.group.wrapping_add(1);
        self.count = 0;
        self.longest = 0;
        self.opened = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/PROTOCOL.md's FEC test vector: a group of two packets with one repair.
    #[test]
    fn vector() {
        let t0 = Instant::now();
        let mut e = Encoder::new(FecMode::Fixed { k: 2, m: 1 });
        e.group = 0x0102;
        let mut repairs = Vec::new();
        assert_eq!(
            e.on_data(t0, &[0x45, 0x01], &mut repairs),
            Some([0x03, 0x01, 0x02, 0x00])
        );
        assert_eq!(
            e.on_data(t0, &[0x45, 0x02, 0x03], &mut repairs),
            Some([0x03, 0x01, 0x02, 0x01])
        );
        // Shards 00 02 45 01 00 and 00 03 45 02 03 (length-prefixed, padded to 5 bytes).
        assert_eq!(
            repairs,
            vec![vec![
                0x04, 0x01, 0x02, 0x00, 0x02, 0x01, 0x00, 0x00, 0x45, 0x07, 0x06
            ]]
        );
        // Either packet is rebuilt from the other and the repair.
        let mut d = super::super::Decoder::new();
        let mut out = Vec::new();
        assert!(d.on_data(t0, 0x0102, 1, &[0x45, 0x02, 0x03], &mut out));
        let r = crate::wire::Repair {
            group: 0x0102,
            index: 0,
            k: 2,
            m: 1,
            shard: &repairs[0][6..],
        };
        d.on_repair(t0, &r, &mut out);
        assert_eq!(out, vec![vec![0x45, 0x01]]);
    }
}
