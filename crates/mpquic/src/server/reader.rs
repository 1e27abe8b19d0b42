//! The server's TUN readers, one per queue: each batch's packets routed to their sessions and
//! classes (each flow's answers in its class), every share routed before any is sent.

use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mpquic_core::DropReason;

use super::Server;
use crate::tunnel::Shares;

impl Server {
    /// Inner packets from TUN queue `q`, a batch per wake-up, to the sessions that own their
    /// destinations (each session's share of the batch routed in one call; with classes, each
    /// class's share). A flow's packets all come from one queue, so readers of different
    /// queues never reorder a flow.
    pub(super) async fn tun_reader(&self, q: usize) {
        let mut shares = Shares::default();
        self.queues[q]
            .read_loop(
                self.mtu,
                mpquic_core::packet::mtu::tcp_mss(self.mtu),
                |batch, infos, drops| {
                    self.queue_packets[q].fetch_add(infos.len() as u64, Ordering::Relaxed);
                    for _ in 0..drops.oversized {
                        self.drop_packet(DropReason::Oversized);
                    }
                    for _ in 0..drops.unsplit {
                        self.drop_packet(DropReason::Malformed);
                    }
                    let now = Instant::now();
                    {
                        let registry = self.read();
                        for (i, info) in infos.iter().enumerate() {
                            let Some(info) = info else {
                                self.drop_packet(DropReason::Malformed);
                                continue;
                            };
                            // A client's IPv6 address names its IPv4 one (`Ipv6Plan`);
                            // any other IPv6 address may be in a site LAN.
                            let dst = match info.dst {
                                IpAddr::V6(a) => match self.ipv6.and_then(|p| p.v4_of(a)) {
                                    Some(v4) => IpAddr::V4(v4),
                                    None => info.dst,
                                },
                                v4 => v4,
                            };
                            let Some(s) = registry.by_addr(dst) else {
                                self.drop_packet(DropReason::NoRoute);
                                continue;
                            };
                            if !s.pick(info, now, |t, lane| shares.add(t, lane, i)) {
                                self.drop_packet(DropReason::NoPath);
                            }
                        }
                    }
                    shares.send(batch, infos);
                },
            )
            .await
    }
}
