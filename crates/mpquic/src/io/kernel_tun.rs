//! The kernel's TUN device, opened by tun-rs: with offloads by default (IFF_VNET_HDR, TSO/USO
//! and checksum offload), so one read can be a 64 KB super-packet of one flow, which tun-rs
//! splits here into segments of the flow's MSS, and one write can carry many coalesced segments
//! (GRO). The device is not persistent, so it disappears, with its address and connected route,
//! when the process exits, however it exits. Its settings are ioctls (`interface`).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::task::{Context, Poll};

use mpquic_core::classify::Prefix;

use crate::io::batch::PacketBatch;
use crate::io::interface;
use crate::io::tun::{Device, ReadDrops, ReadScratch, Tun, MAX_SEGMENTS, VNET};

/// One queue of a kernel TUN device.
pub struct KernelTun {
    dev: tun_rs::AsyncDevice,
    name: String,
}

/// Create the TUN device `name` with `queues` queues (`queue_count`), without packet
/// information headers; with `offload`, with the virtio header and the kernel's
/// segmentation and checksum offloads. Each queue is a `Tun` of its own (its descriptor and
/// its outbox); the first one also sets the device up (MTU, address).
///
/// Why queues: with more than one (IFF_MULTI_QUEUE) the kernel hands each flow's packets to
/// one queue (by flow hash, or to the queue that last wrote the flow's other direction), so
/// one reader per queue spreads the device's reads over the runtime's threads without
/// reordering a flow, and writers of different queues never share an outbox lock.
pub fn open(name: &str, offload: bool, queues: usize) -> io::Result<Vec<Tun>> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name `{name}`"),
        ));
    }
    let dev = tun_rs::DeviceBuilder::new()
        .name(name)
        .offload(offload)
        .multi_queue(queues > 1)
        // Down until `set_ipv4`: up before `disable_ipv6`, the kernel sent an IPv6 router
        // solicitation into the device (ff02::2), which the server counted as no_route.
        .enable(false)
        .build_async()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot create TUN device {name}: {e}")))?;
    let mut more = Vec::with_capacity(queues.saturating_sub(1));
    for q in 1..queues {
        more.push(dev.try_clone().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot open queue {q} of TUN device {name}: {e}"),
            )
        })?);
    }
    Ok(std::iter::once(dev)
        .chain(more)
        .map(|dev| {
            let kernel = KernelTun {
                dev,
                name: name.to_string(),
            };
            Tun::new(name, Box::new(kernel))
        })
        .collect())
}

impl Device for KernelTun {
    fn offload(&self) -> bool {
        self.dev.tcp_gso()
    }

    fn udp_offload(&self) -> bool {
        self.dev.udp_gso()
    }

    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.dev.poll_readable(cx)
    }

    fn try_read(
        &self,
        batch: &mut PacketBatch,
        scratch: &mut ReadScratch,
        mtu: usize,
        drops: &mut ReadDrops,
    ) -> io::Result<bool> {
        // One byte more than the MTU: a packet that fills its slot was longer than allowed.
        let stride = mtu + 1;
        let dev = &self.dev;
        if scratch.segments.len() != stride * MAX_SEGMENTS {
            scratch.segments = vec![0; stride * MAX_SEGMENTS];
        }
        let mut chunks = scratch.segments.chunks_exact_mut(stride);
        let mut slots: [&mut [u8]; MAX_SEGMENTS] =
            std::array::from_fn(|_| chunks.next().unwrap_or_default());
        let n = match dev.try_recv_multiple(&mut scratch.raw, &mut slots, &mut scratch.sizes, 0) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            // The read worked but its packet could not be split (a malformed virtio header,
            // more segments than MAX_SEGMENTS, a segment longer than the MTU).
            Err(e) if e.raw_os_error().is_none() => {
                tracing::debug!(tun = %self.name, error = %e, "TUN super-packet dropped");
                drops.unsplit += 1;
                return Ok(true);
            }
            Err(e) => return Err(e),
        };
        for (slot, &len) in slots.iter().zip(&scratch.sizes).take(n) {
            if len > mtu {
                drops.oversized += 1;
            } else {
                batch.push(&slot[..len]);
            }
        }
        Ok(true)
    }

    fn write(&self, w: &[u8]) -> io::Result<usize> {
        let bytes = match self.dev.tcp_gso() {
            true => w,
            false => &w[VNET..],
        };
        // SAFETY: `bytes` is valid for `bytes.len()` bytes; the descriptor is the open TUN
        // device.
        let n = unsafe { libc::write(self.dev.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Without this the kernel would send IPv6 router solicitations and MLD reports into the
    /// tunnel (IPv4-only tunnels never get an IPv6 address), which the server counts as spoofed.
    fn disable_ipv6(&self) {
        interface::disable_ipv6(&self.name)
    }

    fn set_mtu(&self, mtu: u32) -> io::Result<()> {
        interface::set_mtu(&self.name, mtu)
    }

    fn set_ipv4(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        interface::set_ipv4(&self.name, addr, prefix)
    }

    fn set_ipv6(&self, addr: Ipv6Addr, prefix: u8) -> io::Result<()> {
        interface::set_ipv6(&self.name, addr, prefix)
    }

    fn add_route(&self, lan: &Prefix) -> io::Result<()> {
        interface::add_route(&self.name, lan)
    }

    fn del_route(&self, lan: &Prefix) -> io::Result<()> {
        interface::del_route(&self.name, lan)
    }
}
