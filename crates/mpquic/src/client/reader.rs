//! The client's TUN readers: each batch classified into the tunnel's lanes (traffic classes)
//! and sent; a class with a TUN device of its own has a reader of its own.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mpquic_core::classify::Classifier;
use mpquic_core::DropReason;

use super::Client;
use crate::tunnel::{Routed, Shares};

impl Client {
    /// The classes' rules in force.
    pub(super) fn classifier(&self) -> Arc<Classifier> {
        self.classifier
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) async fn tun_reader(&self) {
        let default = self.ccfg.classifier.default_class();
        let mut shares = Shares::default();
        // Per class: packets put in it by a rule, and without one (added to the counters once
        // per batch).
        let mut counts = vec![(0u64, 0u64); self.classes.len()];
        self.tun
            .read_loop(
                self.mtu,
                mpquic_core::packet::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    let t = &self.tunnel;
                    t.drop_unsent(default, DropReason::Oversized, drops.oversized);
                    t.drop_unsent(default, DropReason::Malformed, drops.unsplit);
                    let classifier = self.classifier();
                    for (i, info) in infos.iter().enumerate() {
                        let (k, matched) = classifier.classify(info.as_ref());
                        shares.add(t, k, i);
                        match matched {
                            true => counts[k].0 += 1,
                            false => counts[k].1 += 1,
                        }
                    }
                    shares.send(batch, infos);
                    for (k, (m, u)) in self.classes.iter().zip(&mut counts) {
                        k.classified.fetch_add(std::mem::take(m), Ordering::Relaxed);
                        k.unmatched.fetch_add(std::mem::take(u), Ordering::Relaxed);
                    }
                },
            )
            .await
    }

    /// A class's own TUN device: everything read from it goes in the class (counted as put
    /// there by a rule: the device is the rule).
    pub(super) async fn class_tun_reader(&self, k: usize) {
        let class = &self.classes[k];
        let Some(tun) = &class.own_tun else { return };
        let mut routed = Routed::default();
        let mut all: Vec<usize> = Vec::new();
        tun.read_loop(
            self.mtu,
            mpquic_core::packet::mtu::tcp_mss(self.mtu),
            |batch, infos, drops| {
                let t = &self.tunnel;
                t.drop_unsent(k, DropReason::Oversized, drops.oversized);
                t.drop_unsent(k, DropReason::Malformed, drops.unsplit);
                all.clear();
                all.extend(0..batch.len());
                t.send_batch(k, batch, &all, infos, &mut routed);
                class
                    .classified
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            },
        )
        .await
    }
}
