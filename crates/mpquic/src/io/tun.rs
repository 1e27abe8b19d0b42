//! A TUN device's queue as the tunnel uses it: batched reads (`read_loop`, the one TUN read
//! loop of client and server) and writes queued and coalesced per flow (`queue`, `flush`),
//! whatever the device behind it (`Device`): the kernel's (`kernel_tun`) or, in tests, the
//! in-memory network's (`memnet`).
//!
//! With offloads, a read may be a 64 KB super-packet of one flow, which the kernel device splits
//! into segments of the flow's MSS (tun-rs's port of wireguard-go's split); what the tunnel
//! delivers is queued into `mpquic_core::packet::coalesce`, which joins consecutive segments of a flow as
//! they come, and written at the end of a receive wake-up (`flush`). Either way the kernel's
//! stack runs once per super-packet instead of once per packet. (tun-rs's own coalescing copies
//! and allocates every packet once more; ours copies each packet once, into its write.)

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;
use std::task::{Context, Poll};

use mpquic_core::classify::Prefix;
use mpquic_core::PacketInfo;

use crate::io::batch::PacketBatch;

/// What a TUN device's queue does for `Tun`: the packet I/O and the interface settings.
/// The kernel's device is `kernel_tun::KernelTun`; tests put the in-memory network's there.
pub trait Device: Send + Sync {
    /// Whether reads and writes carry the virtio header (offloads on).
    fn offload(&self) -> bool;
    /// Whether the device takes coalesced UDP too (USO, Linux 6.2 and later).
    fn udp_offload(&self) -> bool;
    /// Ready when a read may find a packet (a readable TUN descriptor).
    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// One read without waiting, its packets (a super-packet's segments) into `batch`, those
    /// longer than `mtu` or that could not be split counted in `drops`: `Ok(false)` when
    /// nothing is queued.
    fn try_read(
        &self,
        batch: &mut PacketBatch,
        scratch: &mut ReadScratch,
        mtu: usize,
        drops: &mut ReadDrops,
    ) -> io::Result<bool>;
    /// One write, never waiting: `w` begins with the virtio header's room (`VNET` bytes),
    /// filled when the device has offloads, to be left out when it has not.
    fn write(&self, w: &[u8]) -> io::Result<usize>;

    /// IPv6 off until the device gets an IPv6 address (`set_ipv6`).
    fn disable_ipv6(&self);
    fn set_mtu(&self, mtu: u32) -> io::Result<()>;
    /// The IPv4 address and prefix, and the device up.
    fn set_ipv4(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()>;
    /// The IPv6 address and prefix (a dual-stack tunnel).
    fn set_ipv6(&self, addr: Ipv6Addr, prefix: u8) -> io::Result<()>;
    /// Route `lan` into the device (one already there is fine).
    fn add_route(&self, lan: &Prefix) -> io::Result<()>;
    /// Take the route `lan` out of the device (one not there is fine).
    fn del_route(&self, lan: &Prefix) -> io::Result<()>;
}

pub struct Tun {
    device: Box<dyn Device>,
    name: String,
    /// What the tunnel delivered and has not written yet (`queue`, `flush`).
    outbox: Mutex<Outbox>,
}

/// Segments one TUN read yields at most: a 64 KB super-packet cut at the flow's MSS. The kernel
/// sends super-packets only for MSS of ~512 bytes and more (65535 / 128); a smaller MSS is
/// refused by the split and counted as malformed (wireguard-go has the same bound).
pub(super) const MAX_SEGMENTS: usize = tun_rs::IDEAL_BATCH_SIZE;
/// Packets queued for writing at most; a full outbox is written before it takes more.
const OUTBOX_PACKETS: usize = 128;
/// Bytes of the virtio header in front of every read and write with offloads.
pub const VNET: usize = mpquic_core::packet::coalesce::VNET_HDR;

/// What the tunnel delivered and has not written yet: coalesced per flow as it comes
/// (`mpquic_core::packet::coalesce`), written in arrival order.
type Outbox = mpquic_core::packet::coalesce::Coalescer;

/// Packets a TUN write refused: how many and why (the kernel's error).
#[derive(Debug)]
pub struct Refused {
    pub packets: u64,
    pub error: io::Error,
}

/// A reader's buffers for offloaded reads: the raw read (virtio header and up to 64 KB) and
/// the segments it is split into, before they are copied into the batch.
pub struct ReadScratch {
    pub(super) raw: Vec<u8>,
    pub(super) segments: Vec<u8>,
    pub(super) sizes: [usize; MAX_SEGMENTS],
}

impl ReadScratch {
    pub fn new() -> ReadScratch {
        ReadScratch {
            raw: vec![0; VNET + 65535],
            segments: Vec::new(),
            sizes: [0; MAX_SEGMENTS],
        }
    }
}

impl Default for ReadScratch {
    fn default() -> Self {
        ReadScratch::new()
    }
}

impl Tun {
    /// The queue `device` of the TUN device `name`.
    pub fn new(name: &str, device: Box<dyn Device>) -> Tun {
        // The outbox joins what the device takes joined.
        let outbox = Mutex::new(Outbox::new(device.offload(), device.udp_offload()));
        Tun {
            device,
            name: name.to_string(),
            outbox,
        }
    }

    /// The device's interface settings (`Device`): MTU, addresses, routes.
    pub fn device(&self) -> &dyn Device {
        self.device.as_ref()
    }

    /// Fill `batch` with what the device has queued: waits for the first read, then reads
    /// until the device is drained or the batch has `BATCH_PACKETS` (one wake-up, many
    /// packets; one offloaded read may add a super-packet's segments beyond that). Packets of
    /// `mtu` bytes at most; longer ones (the MTU was lowered under us) and reads that could not
    /// be split are dropped and returned in the counts, for the caller to count.
    pub async fn read_batch(
        &self,
        batch: &mut PacketBatch,
        scratch: &mut ReadScratch,
        mtu: usize,
    ) -> io::Result<ReadDrops> {
        let mut drops = ReadDrops::default();
        loop {
            std::future::poll_fn(|cx| self.device.poll_readable(cx)).await?;
            while !batch.is_full() {
                match self.device.try_read(batch, scratch, mtu, &mut drops) {
                    Ok(true) => {}
                    // Drained: the next wait is for new packets.
                    Ok(false) => break,
                    // What was read before the error goes out first; the error comes back on
                    // the next read.
                    Err(_) if !batch.is_empty() || drops.any() => break,
                    Err(e) => return Err(e),
                }
            }
            if !batch.is_empty() || drops.any() {
                return Ok(drops);
            }
        }
    }

    /// Read packets forever, a batch per wake-up; clamp the MSS of TCP SYNs to `mss`, and hand
    /// each batch with its packets' parsed headers to `f`. The one TUN read loop of client and
    /// server.
    pub async fn read_loop(
        &self,
        mtu: u32,
        mss: u16,
        mut f: impl FnMut(&mut PacketBatch, &[Option<PacketInfo>], ReadDrops),
    ) {
        let mut batch = PacketBatch::new();
        let mut scratch = ReadScratch::new();
        let mut infos: Vec<Option<PacketInfo>> =
            Vec::with_capacity(crate::io::batch::BATCH_PACKETS);
        loop {
            batch.clear();
            let drops = match self
                .read_batch(&mut batch, &mut scratch, mtu as usize)
                .await
            {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(tun = %self.name, error = %e, "TUN read failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            infos.clear();
            for i in 0..batch.len() {
                let pkt = batch.packet_mut(i).expect("nothing taken yet");
                let info = PacketInfo::parse(pkt);
                if let Some(info) = &info {
                    // Only the MSS option and the TCP checksum change: `info` stays valid.
                    info.clamp_mss(pkt, mss);
                }
                infos.push(info);
            }
            f(&mut batch, &infos, drops);
        }
    }

    /// Queue one packet for the device; it is written by the next `flush` (or now, when the
    /// outbox is full: then what that write refused is returned).
    pub fn queue(&self, pkt: &[u8]) -> Option<Refused> {
        let mut out = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        let refused = if out.packets() == OUTBOX_PACKETS {
            self.write_out(&mut out)
        } else {
            None
        };
        out.push(pkt);
        refused
    }

    /// Write what is queued, coalesced where the device takes super-packets. Writers keep
    /// their order: the outbox stays locked while it is written.
    pub fn flush(&self) -> Option<Refused> {
        let mut out = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        self.write_out(&mut out)
    }

    /// One packet now: queued and written with whatever was queued before it.
    pub fn send(&self, pkt: &[u8]) -> Option<Refused> {
        let first = self.queue(pkt);
        let second = self.flush();
        match (first, second) {
            (Some(mut a), Some(b)) => {
                a.packets += b.packets;
                Some(a)
            }
            (a, b) => a.or(b),
        }
    }

    /// Each of the outbox's writes (a packet or a super-packet): a TUN write only fails when
    /// the kernel cannot take it (the packets it carries are counted, the last error kept); it
    /// does not block.
    fn write_out(&self, out: &mut Outbox) -> Option<Refused> {
        if out.packets() == 0 {
            return None;
        }
        let mut refused: Option<Refused> = None;
        for (w, packets) in out.writes() {
            if let Err(error) = self.device.write(w) {
                let r = refused.get_or_insert(Refused { packets: 0, error });
                r.packets += packets as u64;
            }
        }
        out.clear();
        refused
    }
}

/// Packets a wake-up of the reader dropped before they reached the batch.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReadDrops {
    /// Longer than the MTU.
    pub oversized: u64,
    /// Offloaded reads whose super-packet could not be split into segments.
    pub unsplit: u64,
}

impl ReadDrops {
    pub(super) fn any(&self) -> bool {
        self.oversized + self.unsplit > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_packets_wait_for_the_flush_and_keep_their_order() {
        let net = crate::io::memnet::Network::new();
        let mut host = net.host("t0");
        let tun = net.tun("t0").unwrap();
        for i in 0..3u8 {
            assert!(tun.queue(&[i; 40]).is_none());
        }
        assert!(
            host.from_dev.try_recv().is_err(),
            "nothing before the flush"
        );
        assert!(tun.flush().is_none());
        for i in 0..3u8 {
            assert_eq!(host.from_dev.try_recv().unwrap(), vec![i; 40]);
        }
        // A full outbox is written before it takes more: memory stays bounded without a flush.
        for i in 0..=OUTBOX_PACKETS {
            assert!(tun.queue(&[i as u8; 60]).is_none());
        }
        for i in 0..OUTBOX_PACKETS {
            assert_eq!(host.from_dev.try_recv().unwrap(), vec![i as u8; 60]);
        }
        assert!(host.from_dev.try_recv().is_err());
        // `send` writes at once, behind what was queued.
        assert!(tun.send(&[0xee; 20]).is_none());
        assert_eq!(
            host.from_dev.try_recv().unwrap(),
            vec![OUTBOX_PACKETS as u8; 60]
        );
        assert_eq!(host.from_dev.try_recv().unwrap(), vec![0xee; 20]);
    }

    #[test]
    fn refused_writes_are_counted_with_the_error() {
        let net = crate::io::memnet::Network::new();
        let host = net.host("t1");
        let tun = net.tun("t1").unwrap();
        drop(host); // nobody reads: every write is refused
        tun.queue(&[1; 40]);
        tun.queue(&[2; 40]);
        let r = tun.flush().expect("refused");
        assert_eq!(r.packets, 2);
        assert!(tun.flush().is_none(), "refused packets are not retried");
    }
}
