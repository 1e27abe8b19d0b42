//! Receive coalescing (GRO) for a TUN device with offloads: the inner packets a wake-up
//! delivers become few writes, consecutive segments of a TCP flow (and, where the kernel takes
//! UDP segmentation, same-size datagrams of a UDP flow) joined into one super-packet with a
//! virtio-net header, so the kernel's stack runs once per up to 64 KB instead of once per packet.
//!
//! The rules are the kernel's own GRO rules (`tcp_gro_receive`), so that the kernel cutting a
//! super-packet up again (when it forwards it) gives back the packets that went in: IPv4 without
//! options or fragments; for TCP only ACK (with PSH on the last segment), the same acknowledgement
//! number, window and options, the next sequence number, segments of one size with at most a
//! shorter last one; for UDP one size with at most a shorter last one. A packet whose checksum is
//! wrong is never joined (it would get a valid one from the kernel); it is written on its own, for
//! the receiver to drop. Everything else is written as it came, behind a zero header.
//!
//! Each packet is copied once, into the write it belongs to; no allocation per packet (the write
//! buffers are reused from batch to batch).

use crate::packet::{checksum_fold, checksum_sum};

/// Bytes of the virtio-net header in front of every write (`struct virtio_net_hdr`).
pub const VNET_HDR: usize = 10;
/// `virtio_net_hdr.flags`: the checksum at `csum_start + csum_offset` is to be completed.
const NEEDS_CSUM: u8 = 1;
const GSO_TCPV4: u8 = 1;
const GSO_UDP_L4: u8 = 5;
/// An IP packet's length field is 16 bits.
const MAX_SUPER: usize = 65535;
/// Datagrams one UDP super-packet carries at most: the kernel's own limit for UDP GSO
/// (`UDP_MAX_SEGMENTS`), which its send path enforces; staying within it keeps our writes
/// what a local sender could have made, and bounds the burst a receiving socket gets at once.
const MAX_UDP_SEGMENTS: usize = 64;
/// Flows one batch coalesces at once; a packet of a further flow is written on its own.
const MAX_HEADS: usize = 16;
/// A write buffer that held more than this is let go after the batch, so that resident memory
/// follows the current batch, not the largest super-packet each buffer ever held.
const KEEP_CAPACITY: usize = 16 * 1024;

const TCP: u8 = 6;
const UDP: u8 = 17;
/// The IPv4 header of every candidate: options are never joined, so it is always 20 bytes.
const IP: usize = 20;

/// A flow a super-packet is being built for: the write it is, what it needs to take more.
#[derive(Clone, Copy)]
struct Head {
    write: usize,
    proto: u8,
    /// Source and destination address, then source and destination port.
    key: [u8; 12],
    /// IP plus TCP/UDP header bytes.
    headers: usize,
    /// Payload bytes of each segment (the first one's).
    segment: usize,
    segments: usize,
    /// TCP: the sequence number the next segment must have.
    next_seq: u32,
    /// No more segments: the last one was shorter, or carried PSH.
    ended: bool,
}

/// One batch's writes for a TUN device with the virtio-net header.
#[derive(Default)]
pub struct Coalescer {
    writes: Vec<Vec<u8>>,
    used: usize,
    /// Packets in each write (for counting what a refused write lost).
    counts: Vec<usize>,
    heads: Vec<Head>,
    /// The device takes TCP super-packets (TSO); without it every packet is a write of its own.
    tcp: bool,
    /// The device takes UDP super-packets (USO, Linux 6.2 and later).
    udp: bool,
    packets: usize,
}

impl Coalescer {
    pub fn new(tcp: bool, udp: bool) -> Coalescer {
        Coalescer {
            tcp,
            udp,
            ..Default::default()
        }
    }

    /// Packets pushed since the last `clear`.
    pub fn packets(&self) -> usize {
        self.packets
    }

    /// Add `pkt`: to a flow's super-packet, or as a write of its own.
    pub fn push(&mut self, pkt: &[u8]) {
        self.packets += 1;
        let Some(c) = Candidate::parse(pkt, self.tcp, self.udp) else {
            self.new_write(pkt);
            return;
        };
        if let Some(h) = self
            .heads
            .iter()
            .rposition(|h| h.key == c.key && h.proto == c.proto)
        {
            if self.try_append(h, pkt, &c) {
                return;
            }
            // A new super-packet for this flow from here on; the old one takes nothing more
            // (joining it later would reorder the flow).
            let old = self.heads.remove(h);
            self.close(&old);
        }
        let write = self.new_write(pkt);
        if self.heads.len() < MAX_HEADS {
            self.heads.push(Head {
                write,
                proto: c.proto,
                key: c.key,
                headers: c.headers,
                segment: pkt.len() - c.headers,
                segments: 1,
                next_seq: c.seq.wrapping_add((pkt.len() - c.headers) as u32),
                ended: c.psh,
            });
        }
    }

    fn new_write(&mut self, pkt: &[u8]) -> usize {
        if self.writes.len() == self.used {
            self.writes.push(Vec::new());
            self.counts.push(0);
        }
        let w = &mut self.writes[self.used];
        w.clear();
        w.extend_from_slice(&[0; VNET_HDR]);
        w.extend_from_slice(pkt);
        self.counts[self.used] = 1;
        self.used += 1;
        self.used - 1
    }

    fn try_append(&mut self, h: usize, pkt: &[u8], c: &Candidate) -> bool {
        let head = self.heads[h];
        let payload = pkt.len() - c.headers;
        let w = &self.writes[head.write];
        let first = &w[VNET_HDR..];
        if head.ended
            || (c.proto == UDP && head.segments == MAX_UDP_SEGMENTS)
            || c.headers != head.headers
            || payload > head.segment
            || w.len() - VNET_HDR + payload > MAX_SUPER
            || !same_ip_fields(first, pkt)
        {
            return false;
        }
        if c.proto == TCP {
            let t = IP;
            // Acknowledgement, data offset, flags other than PSH, window, options: all equal.
            let (a, b) = (&first[t + 8..c.headers], &pkt[t + 8..c.headers]);
            let flags_equal = a[..5] == b[..5] && a[5] & !PSH == b[5] & !PSH && a[6..8] == b[6..8];
            if c.seq != head.next_seq || !flags_equal || a[12..] != b[12..] {
                return false;
            }
        }
        // The first packet's checksum is checked when a second joins it (a lone packet is
        // written as it came, and its receiver checks it).
        if head.segments == 1 && !transport_checksum_ok(first, head.proto) {
            return false;
        }
        if !transport_checksum_ok(pkt, c.proto) {
            return false;
        }
        let w = &mut self.writes[head.write];
        w.extend_from_slice(&pkt[c.headers..]);
        if c.psh {
            w[VNET_HDR + IP + 13] |= PSH;
        }
        self.counts[head.write] += 1;
        let head = &mut self.heads[h];
        head.segments += 1;
        head.next_seq = head.next_seq.wrapping_add(payload as u32);
        head.ended = c.psh || payload < head.segment;
        true
    }

    /// The batch's writes, headers completed, in the order their first packets came, each
    /// with the number of packets it carries.
    pub fn writes(&mut self) -> impl Iterator<Item = (&[u8], usize)> {
        for h in std::mem::take(&mut self.heads) {
            self.close(&h);
        }
        self.writes[..self.used]
            .iter()
            .map(Vec::as_slice)
            .zip(self.counts.iter().copied())
    }

    /// A super-packet that takes no more: its headers completed (a lone packet keeps its own).
    fn close(&mut self, h: &Head) {
        if h.segments > 1 {
            finish(&mut self.writes[h.write], h);
        }
    }

    /// Forget the batch (after its writes were made).
    pub fn clear(&mut self) {
        for w in &mut self.writes[..self.used] {
            if w.capacity() > KEEP_CAPACITY {
                *w = Vec::new();
            }
        }
        self.used = 0;
        self.packets = 0;
        self.heads.clear();
    }
}

const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

/// What a packet that may be coalesced says about its flow.
struct Candidate {
    proto: u8,
    key: [u8; 12],
    headers: usize,
    seq: u32,
    psh: bool,
}

impl Candidate {
    fn parse(pkt: &[u8], tcp: bool, udp: bool) -> Option<Candidate> {
        // IPv4 without options, not a fragment, its length field the packet's length.
        if pkt.len() < 28
            || pkt[0] != 0x45
            || usize::from(u16::from_be_bytes([pkt[2], pkt[3]])) != pkt.len()
        {
            return None;
        }
        if pkt[6] & 0x3f != 0 || pkt[7] != 0 {
            return None;
        }
        let mut key = [0; 12];
        key[..8].copy_from_slice(&pkt[12..20]);
        key[8..].copy_from_slice(&pkt[20..24]);
        match pkt[9] {
            TCP if tcp && pkt.len() > 40 => {
                let headers = IP + usize::from(pkt[32] >> 4) * 4;
                let flags = pkt[33];
                if pkt.len() <= headers || headers < 40 || (flags != ACK && flags != ACK | PSH) {
                    return None;
                }
                Some(Candidate {
                    proto: TCP,
                    key,
                    headers,
                    seq: u32::from_be_bytes([pkt[24], pkt[25], pkt[26], pkt[27]]),
                    psh: flags & PSH != 0,
                })
            }
            // A zero UDP checksum says "none": such datagrams go as they are.
            // An empty datagram is no segment (the kernel refuses a GSO size of 0).
            UDP if udp
                && pkt.len() > 28
                && pkt[26..28] != [0, 0]
                && usize::from(u16::from_be_bytes([pkt[24], pkt[25]])) == pkt.len() - 20 =>
            {
                Some(Candidate {
                    proto: UDP,
                    key,
                    headers: 28,
                    seq: 0,
                    psh: false,
                })
            }
            _ => None,
        }
    }
}

/// TOS, the DF and reserved bits, TTL and protocol equal (the kernel's GRO flushes otherwise).
fn same_ip_fields(a: &[u8], b: &[u8]) -> bool {
    a[1] == b[1] && a[6] >> 5 == b[6] >> 5 && a[8..10] == b[8..10]
}

/// The sum of the IPv4 pseudo-header of a TCP/UDP segment of `len` bytes.
fn pseudo_sum(pkt: &[u8], proto: u8, len: usize) -> u64 {
    checksum_sum(&pkt[12..20], u64::from(proto) + len as u64)
}

fn transport_checksum_ok(pkt: &[u8], proto: u8) -> bool {
    let l4 = &pkt[IP..];
    checksum_fold(checksum_sum(l4, pseudo_sum(pkt, proto, l4.len()))) == 0xffff
}

/// Complete a super-packet: IP length and checksum, the TCP/UDP checksum field holding the
/// pseudo-header's sum for the kernel to finish, the virtio-net header saying how to cut it up.
fn finish(w: &mut [u8], h: &Head) {
    let (hdr, pkt) = w.split_at_mut(VNET_HDR);
    let len = pkt.len();
    pkt[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    pkt[10..12].fill(0);
    let ip = !checksum_fold(checksum_sum(&pkt[..20], 0));
    pkt[10..12].copy_from_slice(&ip.to_be_bytes());
    let l4_len = len - 20;
    let (gso_type, csum_offset) = match h.proto {
        TCP => (GSO_TCPV4, 16usize),
        _ => {
            // UDP: the length field covers the whole super-packet, as the kernel's own.
            pkt[24..26].copy_from_slice(&(l4_len as u16).to_be_bytes());
            (GSO_UDP_L4, 6usize)
        }
    };
    let partial = checksum_fold(pseudo_sum(pkt, h.proto, l4_len));
    pkt[20 + csum_offset..22 + csum_offset].copy_from_slice(&partial.to_be_bytes());
    // struct virtio_net_hdr, little-endian fields (the TUN device's default on this host order).
    hdr[0] = NEEDS_CSUM;
    hdr[1] = gso_type;
    hdr[2..4].copy_from_slice(&(h.headers as u16).to_le_bytes());
    hdr[4..6].copy_from_slice(&(h.segment as u16).to_le_bytes());
    hdr[6..8].copy_from_slice(&20u16.to_le_bytes());
    hdr[8..10].copy_from_slice(&(csum_offset as u16).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::checksum;

    const A: [u8; 4] = [10, 200, 17, 1];
    const B: [u8; 4] = [192, 0, 2, 7];

    fn ip(proto: u8, id: u16, l4: &[u8]) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
        p[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        p[4..6].copy_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&A);
        p.extend_from_slice(&B);
        let c = checksum(0, &p);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p.extend_from_slice(l4);
        p
    }

    fn l4_checksum(p: &mut [u8], at: usize) {
        p[20 + at..22 + at].fill(0);
        let len = p.len() - 20;
        let pseudo = checksum_fold(pseudo_sum(p, p[9], len)) as u32;
        let c = checksum(pseudo, &p[20..]);
        p[20 + at..22 + at].copy_from_slice(&c.to_be_bytes());
    }

    /// A TCP segment of flow `port` with a timestamp option (as Linux sends them).
    fn tcp(port: u16, seq: u32, ack: u32, len: usize, flags: u8, id: u16) -> Vec<u8> {
        let mut t = vec![0u8; 32];
        t[0..2].copy_from_slice(&port.to_be_bytes());
        t[2..4].copy_from_slice(&5201u16.to_be_bytes());
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[8..12].copy_from_slice(&ack.to_be_bytes());
        t[12] = 8 << 4;
        t[13] = flags;
        t[14..16].copy_from_slice(&502u16.to_be_bytes());
        t[20..32].copy_from_slice(&[1, 1, 8, 10, 0, 0, 0, 9, 0, 0, 0, 7]);
        t.extend((0..len).map(|i| (seq as usize + i) as u8));
        let mut p = ip(TCP, id, &t);
        l4_checksum(&mut p, 16);
        p
    }

    fn udp(port: u16, len: usize, fill: u8, id: u16) -> Vec<u8> {
        let mut u = vec![0u8; 8];
        u[0..2].copy_from_slice(&port.to_be_bytes());
        u[2..4].copy_from_slice(&53u16.to_be_bytes());
        u[4..6].copy_from_slice(&((8 + len) as u16).to_be_bytes());
        u.extend(std::iter::repeat_n(fill, len));
        let mut p = ip(UDP, id, &u);
        l4_checksum(&mut p, 6);
        p
    }

    /// What the kernel makes of a write: the packets it is cut into (software GSO), each with
    /// its headers and checksums as the sender had them.
    fn segment(w: &[u8]) -> Vec<Vec<u8>> {
        let (hdr, pkt) = w.split_at(VNET_HDR);
        if hdr[1] == 0 {
            assert_eq!(
                hdr, [0; VNET_HDR],
                "a single packet goes behind a zero header"
            );
            return vec![pkt.to_vec()];
        }
        assert_eq!(hdr[0], NEEDS_CSUM);
        let headers = usize::from(u16::from_le_bytes([hdr[2], hdr[3]]));
        let size = usize::from(u16::from_le_bytes([hdr[4], hdr[5]]));
        assert_eq!(u16::from_le_bytes([hdr[6], hdr[7]]), 20);
        let csum_at = usize::from(u16::from_le_bytes([hdr[8], hdr[9]]));
        // The partial checksum is the pseudo-header's sum over the whole super-packet.
        let whole = pkt.len() - 20;
        let partial = u16::from_be_bytes([pkt[20 + csum_at], pkt[21 + csum_at]]);
        assert_eq!(partial, checksum_fold(pseudo_sum(pkt, pkt[9], whole)));
        assert_eq!(checksum(0, &pkt[..20]), 0, "IP header checksum");
        assert_eq!(usize::from(u16::from_be_bytes([pkt[2], pkt[3]])), pkt.len());
        let id = u16::from_be_bytes([pkt[4], pkt[5]]);
        let seq = u32::from_be_bytes([pkt[24], pkt[25], pkt[26], pkt[27]]);
        let chunks: Vec<&[u8]> = pkt[headers..].chunks(size).collect();
        let n = chunks.len();
        chunks
            .iter()
            .enumerate()
            .map(|(i, payload)| {
                let mut s = pkt[..headers].to_vec();
                s.extend_from_slice(payload);
                let len = s.len() as u16;
                s[2..4].copy_from_slice(&len.to_be_bytes());
                s[4..6].copy_from_slice(&id.wrapping_add(i as u16).to_be_bytes());
                s[10..12].fill(0);
                let c = checksum(0, &s[..20]);
                s[10..12].copy_from_slice(&c.to_be_bytes());
                if s[9] == TCP {
                    let sq = seq.wrapping_add((i * size) as u32);
                    s[24..28].copy_from_slice(&sq.to_be_bytes());
                    if i + 1 < n {
                        s[33] &= !PSH;
                    }
                    l4_checksum(&mut s, 16);
                } else {
                    let ul = (len - 20).to_be_bytes();
                    s[24..26].copy_from_slice(&ul);
                    l4_checksum(&mut s, 6);
                }
                s
            })
            .collect()
    }

    fn run(c: &mut Coalescer, pkts: &[Vec<u8>]) -> Vec<(Vec<u8>, usize)> {
        for p in pkts {
            c.push(p);
        }
        assert_eq!(c.packets(), pkts.len());
        let out: Vec<(Vec<u8>, usize)> = c.writes().map(|(w, n)| (w.to_vec(), n)).collect();
        c.clear();
        assert_eq!(
            out.iter().map(|(_, n)| n).sum::<usize>(),
            pkts.len(),
            "every packet counted once"
        );
        out
    }

    fn flow(port: u16, from: u32, sizes: &[usize], last_psh: bool) -> Vec<Vec<u8>> {
        let mut seq = from;
        let n = sizes.len();
        sizes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let flags = if last_psh && i + 1 == n {
                    ACK | PSH
                } else {
                    ACK
                };
                let p = tcp(port, seq, 77, len, flags, 100 + i as u16);
                seq += len as u32;
                p
            })
            .collect()
    }

    #[test]
    fn a_flows_segments_become_one_write_that_cuts_back_into_them() {
        let mut sizes = vec![1348; 10];
        sizes.push(500);
        let pkts = flow(40000, 1_000_000, &sizes, true);
        let out = run(&mut Coalescer::new(true, false), &pkts);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1, 11);
        assert_eq!(out[0].0[1], GSO_TCPV4);
        assert_eq!(segment(&out[0].0), pkts);
    }

    #[test]
    fn flows_stay_apart_and_in_order() {
        let a = flow(1, 0, &[1000; 4], false);
        let b = flow(2, 5000, &[1000; 4], false);
        let mixed: Vec<Vec<u8>> = a
            .iter()
            .zip(&b)
            .flat_map(|(x, y)| [x.clone(), y.clone()])
            .collect();
        let out = run(&mut Coalescer::new(true, false), &mixed);
        assert_eq!(out.len(), 2);
        assert_eq!(segment(&out[0].0), a);
        assert_eq!(segment(&out[1].0), b);
    }

    #[test]
    fn what_the_kernel_would_not_join_starts_a_new_write() {
        let mut c = Coalescer::new(true, false);
        // A gap in the sequence, then in order again: the later packets join the new write.
        let mut p = flow(1, 0, &[1000; 2], false);
        p.extend(flow(1, 5000, &[1000; 3], false));
        let out = run(&mut c, &p);
        assert_eq!(out.iter().map(|o| o.1).collect::<Vec<_>>(), [2, 3]);
        // Another acknowledgement number, a larger segment after a smaller one, PSH in the
        // middle, a window update.
        let mut ack = flow(1, 0, &[1000; 3], false);
        ack[1] = tcp(1, 1000, 78, 1000, ACK, 0);
        ack[2] = tcp(1, 2000, 78, 1000, ACK, 0);
        assert_eq!(
            run(&mut c, &ack).iter().map(|o| o.1).collect::<Vec<_>>(),
            [1, 2]
        );
        let grow = flow(1, 0, &[500, 1000], false);
        assert_eq!(run(&mut c, &grow).len(), 2);
        let push = flow(1, 0, &[1000, 1000, 1000], false);
        let mut push = push;
        push[1] = tcp(1, 1000, 77, 1000, ACK | PSH, 0);
        assert_eq!(
            run(&mut c, &push).iter().map(|o| o.1).collect::<Vec<_>>(),
            [2, 1]
        );
        let mut win = flow(1, 0, &[1000; 2], false);
        win[1][20 + 15] ^= 1;
        l4_checksum(&mut win[1], 16);
        assert_eq!(run(&mut c, &win).len(), 2);
        // SYN, FIN and pure ACKs go as they are.
        let syn = tcp(1, 0, 0, 0, 0x02, 0);
        let fin = tcp(1, 0, 77, 10, ACK | 0x01, 0);
        let pure = tcp(1, 0, 77, 0, ACK, 0);
        for p in [syn, fin, pure] {
            let out = run(&mut c, &[p.clone(), p.clone()]);
            assert_eq!(out.len(), 2);
            assert_eq!(segment(&out[0].0), [p]);
        }
    }

    #[test]
    fn a_packet_with_a_bad_checksum_is_never_joined() {
        let mut p = flow(1, 0, &[1000; 4], false);
        p[2][60] ^= 0xff; // payload byte: the TCP checksum no longer matches
        let out = run(&mut Coalescer::new(true, false), &p);
        assert_eq!(out.iter().map(|o| o.1).collect::<Vec<_>>(), [2, 1, 1]);
        assert_eq!(segment(&out[1].0), [p[2].clone()], "written as it came");
        // A bad first packet is not joined either.
        let mut q = flow(1, 0, &[1000; 2], false);
        q[0][60] ^= 0xff;
        assert_eq!(run(&mut Coalescer::new(true, false), &q).len(), 2);
    }

    #[test]
    fn super_packets_stay_within_64_kb() {
        let p = flow(1, 0, &[1400; 60], false);
        let out = run(&mut Coalescer::new(true, false), &p);
        assert!(out.len() == 2 && out.iter().all(|(w, _)| w.len() - VNET_HDR <= MAX_SUPER));
        let back: Vec<Vec<u8>> = out.iter().flat_map(|(w, _)| segment(w)).collect();
        assert_eq!(back, p);
    }

    #[test]
    fn other_packets_pass_unchanged() {
        let icmp = ip(1, 9, &[8, 0, 0, 0, 0, 1, 0, 1]);
        let opts = {
            let mut p = tcp(1, 0, 77, 100, ACK, 0);
            p[0] = 0x46; // an IP option length: not joined
            p
        };
        let tiny = vec![0x45, 0, 0, 4];
        let out = run(
            &mut Coalescer::new(true, true),
            &[icmp.clone(), opts.clone(), tiny.clone()],
        );
        let plain: Vec<Vec<u8>> = out.iter().flat_map(|(w, _)| segment(w)).collect();
        assert_eq!(plain, [icmp, opts, tiny]);
    }

    #[test]
    fn udp_datagrams_of_a_flow_join_only_where_the_device_takes_them() {
        let mut p: Vec<Vec<u8>> = (0..5).map(|i| udp(7000, 132, i, i as u16)).collect();
        p.push(udp(7000, 60, 9, 5));
        p.push(udp(7000, 132, 1, 6)); // after a shorter one: a new write
        let out = run(&mut Coalescer::new(true, true), &p);
        assert_eq!(out.iter().map(|o| o.1).collect::<Vec<_>>(), [6, 1]);
        assert_eq!(out[0].0[1], GSO_UDP_L4);
        let back: Vec<Vec<u8>> = out.iter().flat_map(|(w, _)| segment(w)).collect();
        assert_eq!(back, p);
        let out = run(&mut Coalescer::new(true, false), &p);
        assert_eq!(out.len(), p.len(), "no USO: one write each");
        let empty = udp(7000, 0, 0, 1);
        let out = run(
            &mut Coalescer::new(true, true),
            &[empty.clone(), empty.clone()],
        );
        assert_eq!(out.len(), 2, "empty datagrams go as they are");
        let many: Vec<Vec<u8>> = (0..100).map(|i| udp(7000, 132, 1, i)).collect();
        let out = run(&mut Coalescer::new(true, true), &many);
        assert_eq!(
            out.iter().map(|o| o.1).collect::<Vec<_>>(),
            [MAX_UDP_SEGMENTS, 36]
        );
        let tcp = flow(1, 0, &[1000; 3], false);
        let out = run(&mut Coalescer::new(false, false), &tcp);
        assert_eq!(out.len(), 3, "no offloads: one write each");
    }

    #[test]
    fn any_bytes_are_taken_without_a_panic() {
        // Packets come from authenticated peers but are not trusted: truncated and corrupted
        // variants of valid packets, and noise.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut c = Coalescer::new(true, true);
        let base = [tcp(1, 0, 77, 1000, ACK, 0), udp(7, 100, 3, 0)];
        let mut pkts = Vec::new();
        for i in 0..5000 {
            let mut p = base[i % 2].clone();
            match next() % 3 {
                0 => p.truncate((next() % p.len() as u64) as usize),
                1 => {
                    let at = (next() % p.len() as u64) as usize;
                    p[at] = next() as u8;
                }
                _ => p = (0..next() % 200).map(|_| next() as u8).collect(),
            }
            pkts.push(p);
            if pkts.len() == 64 {
                run(&mut c, &pkts);
                pkts.clear();
            }
        }
    }
}
