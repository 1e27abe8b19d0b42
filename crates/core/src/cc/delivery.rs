//! Delivery-rate samples and round trips (draft-cheng-iccrg-delivery-rate-estimation), the
//! measurements every model-based controller here is built on: each packet's send is recorded
//! with what the connection had delivered and lost by then, and its acknowledgement turns that
//! into a sample of the delivery rate, of the loss over its flight, and of the round trip count.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Send records kept (one per send instant); older ones are forgotten (their acknowledgements,
/// if any ever come, give no sample).
const MAX_RECORDS: usize = 16_384;
/// How far before an acknowledged packet's send the records of packets it may have overtaken
/// are kept: the minimum RTT (a packet overtakes others by less than a round trip), at most
/// this. Without a minimum yet, none are (every earlier record is taken as acknowledged). A
/// fixed 500 ms kept half a second of records on every fast path: up to `MAX_RECORDS` (~1.2 MB
/// per connection) where the records in flight are a few hundred.
const MAX_REORDER_HORIZON: Duration = Duration::from_millis(500);

/// What the connection had delivered and lost when a packet left.
#[derive(Debug, Clone, Copy)]
struct SendRecord {
    sent: Instant,
    delivered: u64,
    delivered_time: Instant,
    first_sent_time: Instant,
    lost: u64,
    in_flight: u64,
}

/// The send records. A copy of a controller (quinn takes one for every status read) starts
/// without them: they are up to 16k entries, and acknowledgements of packets sent before the
/// copy then give no sample, as after a gap in sending.
#[derive(Debug, Default)]
struct SendRecords(VecDeque<SendRecord>);

impl Clone for SendRecords {
    fn clone(&self) -> Self {
        SendRecords::default()
    }
}

/// What one acknowledgement says about the path.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Bytes/s delivered over the packet's flight; 0 when the interval was shorter than a round
    /// trip (ACK compression, not the path's rate).
    pub rate: u64,
    /// Bytes delivered while the packet was in flight (itself included).
    pub delivered: u64,
    /// Bytes in flight just after the packet left, and bytes declared lost since.
    pub in_flight: u64,
    pub lost: u64,
    /// This acknowledgement began a new round trip (it acknowledges data sent after the
    /// previous round's first acknowledgement).
    pub new_round: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Delivery {
    records: SendRecords,
    delivered: u64,
    delivered_time: Option<Instant>,
    first_sent_time: Option<Instant>,
    lost: u64,
    round: u64,
    next_round_delivered: u64,
}

impl Delivery {
    /// Round trips counted so far.
    pub fn round(&self) -> u64 {
        self.round
    }

    /// A packet of `bytes` left at `now` with `in_flight` bytes (itself included) unacknowledged.
    pub fn on_sent(&mut self, now: Instant, bytes: u64, in_flight: u64) {
        if in_flight == bytes {
            // Nothing was in flight: the next rate sample starts now, not at the last ACK.
            self.first_sent_time = Some(now);
            self.delivered_time = Some(now);
        }
        if self.records.0.back().is_none_or(|r| r.sent != now) {
            if self.records.0.len() == MAX_RECORDS {
                self.records.0.pop_front();
            }
            self.records.0.push_back(SendRecord {
                sent: now,
                delivered: self.delivered,
                delivered_time: self.delivered_time.unwrap_or(now),
                first_sent_time: self.first_sent_time.unwrap_or(now),
                lost: self.lost,
                in_flight,
            });
        }
    }

    /// `bytes` were declared lost.
    pub fn on_loss(&mut self, bytes: u64) {
        self.lost += bytes;
    }

    /// A packet of `bytes` sent at `sent` was acknowledged at `now`. `min_rtt`: intervals
    /// shorter than it give no rate. None if its send is no longer recorded.
    pub fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        min_rtt: Option<Duration>,
    ) -> Option<Sample> {
        self.delivered += bytes;
        self.delivered_time = Some(now);
        let at = self.records.0.partition_point(|r| r.sent < sent);
        let rec = *self.records.0.get(at).filter(|r| r.sent == sent)?;
        // Records well before this one belong to packets acknowledged or lost by now; those
        // just before it may be of packets this one overtook on a link that reorders, whose
        // acknowledgements are still to come and should still give samples.
        let horizon = min_rtt.unwrap_or_default().min(MAX_REORDER_HORIZON);
        let keep_from = rec.sent.checked_sub(horizon);
        let old = keep_from.map_or(0, |k| self.records.0.partition_point(|r| r.sent < k));
        self.records.0.drain(..old);
        // The newest packet acknowledged so far starts the next send interval (an overtaken
        // packet acknowledged late does not move it back).
        self.first_sent_time = Some(self.first_sent_time.map_or(rec.sent, |f| f.max(rec.sent)));
        let send_elapsed = rec.sent.saturating_duration_since(rec.first_sent_time);
        let ack_elapsed = now.saturating_duration_since(rec.delivered_time);
        let interval = send_elapsed.max(ack_elapsed);
        let delivered = self.delivered - rec.delivered;
        let rate = if interval.is_zero() || min_rtt.is_some_and(|m| interval < m) {
            0
        } else {
            (delivered as f64 / interval.as_secs_f64()) as u64
        };
        let new_round = rec.delivered >= self.next_round_delivered;
        if new_round {
            self.next_round_delivered = self.delivered;
            self.round += 1;
        }
        Some(Sample {
            rate,
            delivered,
            in_flight: rec.in_flight,
            lost: self.lost - rec.lost,
            new_round,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a fast path acknowledged in order, the records kept are those in flight and a
    /// minimum RTT's worth before them, not half a second's (16k records, ~1.2 MB).
    #[test]
    fn a_fast_in_order_path_keeps_a_round_trip_of_records() {
        let t0 = Instant::now();
        let mut d = Delivery::default();
        let rtt = Duration::from_millis(1);
        let step = Duration::from_micros(10);
        let mut most = 0;
        for i in 0..100_000u32 {
            let now = t0 + step * i;
            d.on_sent(now, 1400, 1400 * 100);
            if let Some(sent) = now.checked_sub(rtt).filter(|s| *s >= t0) {
                d.on_ack(now, sent, 1400, Some(rtt));
            }
            most = most.max(d.records.0.len());
        }
        // 100 in flight, 100 acknowledged within the last minimum RTT.
        assert!(most <= 250, "{most} records kept");
    }
}
