//! Drives the core's parsers and state machines with arbitrary bytes, as the network or a LAN
//! host could send them. The coverage-guided fuzz targets (`fuzz/`, `bench/fuzz.sh`) call these,
//! and so does the regression test that replays every input the fuzzers ever crashed on
//! (`tests/fuzz_regressions.rs`, inputs in `fuzz/regressions/<target>/`): one harness for both.
//! None of it may panic, whatever the bytes.

use crate::fec::FecMode;
use crate::packet::coalesce::Coalescer;
use crate::reorder::reassembly::{self, Reassembly};
use crate::stripe::feedback::Feedback;
use crate::stripe::{self, Keys, Kind, SECRET_LEN};
use crate::tunnel::{LinkStats, Polled, Recorded, Sources, TunnelCore};
use crate::PacketInfo;
use crate::{HealthMode, PathSpec, Policy};
use bytes::Bytes;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// The tunnel core as a peer's datagrams and stream packets reach it: every wire frame (inner
/// packets bare, bonded and classed, health probes and replies, FEC data and repair, MTU probes
/// and replies) parsed and acted on by the product's own state machine, with the timers run
/// between them. The server's view: FEC on, a per-packet policy, two lanes, two paths, source
/// checks on, adaptive recovery.
pub fn tunnel_receive(data: &[u8]) {
    let t0 = Instant::now();
    let sources = Sources {
        addr: Ipv4Addr::new(10, 200, 17, 1),
        addr6: None,
        lans: Vec::new(),
    };
    let mut core = TunnelCore::new(
        Policy::Wlb,
        HealthMode::Follow,
        FecMode::Auto,
        Some(sources),
    )
    .adaptive();
    let _ = core.add_lane(Policy::Failover, true);
    let paths: Vec<_> = ["wan1", "wan2"]
        .iter()
        .map(|n| {
            let id = core
                .path(
                    PathSpec {
                        name: (*n).into(),
                        priority: 1,
                        weight: 1,
                        ..Default::default()
                    },
                    8,
                )
                .expect("two paths fit");
            core.connected(id, LinkStats::default(), t0);
            id
        })
        .collect();
    let mut out = Recorded::default();
    let mut polled = Polled::default();
    let mut now = t0;
    // Records: [op, len_hi, len_lo, bytes...]; op picks the path, datagram or stream packet,
    // and how far the clock moves before it.
    let mut rest = data;
    while rest.len() >= 3 {
        let op = rest[0];
        let len = usize::from(u16::from_be_bytes([rest[1], rest[2]])) % 2048;
        let end = (3 + len).min(rest.len());
        let bytes = &rest[3..end];
        rest = &rest[end..];
        now += Duration::from_millis(u64::from(op >> 4) * 7);
        let path = paths[usize::from(op & 1)];
        match (op >> 1) & 3 {
            0 | 1 => {
                let _ = core.on_datagram(path, bytes, now, &mut out);
            }
            2 => {
                let _ = core.on_stream_packet(path, Some(bytes), now, &mut out);
            }
            _ => {
                let _ = core.poll(now, |_| Some(LinkStats::default()), &mut out, &mut polled);
            }
        }
    }
    let _ = core.poll(
        now + Duration::from_secs(5),
        |_| None,
        &mut out,
        &mut polled,
    );
}

/// Inner packets as a LAN host or the peer sends them: the header parser the classifier,
/// flow table and spoof check use, and the coalescer that merges them for the TUN device.
pub fn inner_packets(data: &[u8]) {
    let mut co = Coalescer::new(true, true);
    // Several packets in one input: [len_hi, len_lo, bytes...] each.
    let mut rest = data;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]])) % 4096;
        let end = (2 + len).min(rest.len());
        let pkt = &rest[2..end];
        rest = &rest[end..];
        let _ = PacketInfo::parse(pkt);
        co.push(pkt);
    }
    for (bytes, _segments) in co.writes() {
        let _ = PacketInfo::parse(bytes);
    }
    co.clear();
}

/// Stripe packets: what anyone can send to the stripe port (parsed for a session id, refused
/// unless authentic), and what an authenticated peer can send (the harness seals the input
/// with the session's real key, so the parser behind the AEAD is reached: kinds, feedback).
pub fn stripe_packets(data: &[u8]) {
    let Some((&op, body)) = data.split_first() else {
        return;
    };
    let secret = [7u8; SECRET_LEN];
    let mut client = Keys::from_secret(&secret, true);
    let mut server = Keys::from_secret(&secret, false);
    let _ = stripe::session_of(body);
    // As anyone would send it: must be refused, never panic.
    let mut raw = body.to_vec();
    let _ = server.open.open(&mut raw);
    // As the authenticated peer would send it.
    let kind = [
        Kind::Data,
        Kind::Register,
        Kind::RegisterAck,
        Kind::Keepalive,
        Kind::Feedback,
    ][usize::from(op) % 5];
    let mut sealed = Vec::new();
    client.seal.seal(kind, body, &mut sealed);
    if let Ok((Kind::Feedback, payload)) = server.open.open(&mut sealed) {
        if let Some(f) = Feedback::decode(payload) {
            f.arrived().for_each(drop);
        }
    }
    if let Some(f) = Feedback::decode(body) {
        f.arrived().for_each(drop);
    }
}

/// A path's reliable stream as the receiver reassembles it: chunks at arbitrary offsets
/// (QUIC hands them over as they arrive), frame headers of any length, frames popped as they
/// complete.
pub fn stream_frames(data: &[u8]) {
    let t0 = Instant::now();
    let mut r = Reassembly::starting_at(0);
    // Records: [offset (u16), len (u8), bytes...].
    let mut rest = data;
    let mut n = 0u64;
    while rest.len() >= 3 {
        let offset = u64::from(u16::from_be_bytes([rest[0], rest[1]]));
        let len = usize::from(rest[2]);
        let end = (3 + len).min(rest.len());
        let chunk = Bytes::copy_from_slice(&rest[3..end]);
        rest = &rest[end..];
        n += 1;
        let _ = r.insert(offset, chunk, t0 + Duration::from_millis(n));
        while let Some(frame) = r.pop() {
            let _ = frame;
        }
        let _ = r.ahead_bytes();
    }
    if data.len() >= reassembly::HEADER {
        let h: [u8; reassembly::HEADER] = data[..reassembly::HEADER].try_into().unwrap();
        let _ = reassembly::parse_header(&h);
    }
}

/// A harness: any bytes in, no panic out.
pub type Harness = fn(&[u8]);

/// Each harness by its fuzz target's name.
pub const ALL: &[(&str, Harness)] = &[
    ("tunnel_receive", tunnel_receive),
    ("inner_packets", inner_packets),
    ("stripe_packets", stripe_packets),
    ("stream_frames", stream_frames),
    ("connect_ip", connect_ip),
];

/// With FUZZ_SEEDS_DIR set (`bench/fuzz.sh`), write `seeds` there, one directory per target
/// (used for this crate's seeds and the binary's).
pub fn write_seeds(seeds: &[(&str, Vec<u8>)]) {
    let Ok(dir) = std::env::var("FUZZ_SEEDS_DIR") else {
        return;
    };
    for (i, (target, input)) in seeds.iter().enumerate() {
        let d = std::path::Path::new(&dir).join(target);
        std::fs::create_dir_all(&d).expect("the seeds directory can be made");
        std::fs::write(d.join(format!("seed-{i}")), input).expect("a seed can be written");
    }
}

/// Starting inputs for the fuzzers, one file each (`bench/fuzz.sh` writes them into the
/// targets' corpora): every wire frame as the product's own encoders write it, real inner
/// packets, a stripe feedback, a stream frame. From these the fuzzers mutate toward what the
/// parsers do with near-valid input, which random bytes rarely reach.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::wire;
    let udp4 = ipv4(
        17,
        &[
            0x30, 0x39, 0x00, 0x35, 0x00, 0x0c, 0x00, 0x00, b'p', b'i', b'n', b'g',
        ],
    );
    let tcp4 = ipv4(6, &{
        let mut t = vec![
            0x30, 0x39, 0x01, 0xbb, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x10, 0xff, 0xff,
        ];
        t.extend_from_slice(&[0, 0, 0, 0]);
        t
    });
    let udp6 = {
        let mut p = vec![0x60, 0, 0, 0, 0, 12, 17, 64];
        p.extend_from_slice(&[0xfd, 0, 0, 0x17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        p.extend_from_slice(&[0xfd, 0, 0, 0x17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        p.extend_from_slice(&[
            0x30, 0x39, 0x00, 0x35, 0x00, 0x0c, 0x00, 0x00, b'p', b'i', b'n', b'g',
        ]);
        p
    };
    let record = |op: u8, bytes: &[u8]| {
        let mut r = vec![op];
        r.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
        r.extend_from_slice(bytes);
        r
    };
    let cat = |parts: &[&[u8]]| parts.concat();
    let view = crate::PeerView {
        state: crate::PathState::Up,
        srtt: Some(Duration::from_millis(20)),
        rttvar: Duration::from_millis(2),
        min_rtt: Some(Duration::from_millis(18)),
        loss_permille: 10,
        probe_interval: Some(Duration::from_millis(100)),
        role: Some(crate::Role::Overflow),
        link: Some(crate::path::reconfig::LinkKind::Starlink),
    };
    let bonded = cat(&[&wire::encode_bonded(0, 1), &udp4]);
    let classed = cat(&[&wire::encode_classed(1).expect("lane 1"), &bonded]);
    let frames: Vec<Vec<u8>> = vec![
        wire::encode_probe(wire::PROBE, 1).to_vec(),
        wire::encode_probe(wire::PROBE_REPLY, 1).to_vec(),
        wire::encode_probe_view(2, &view).to_vec(),
        wire::encode_mtu_probe(wire::MTU_PROBE, 3, 1200),
        wire::encode_mtu_probe(wire::MTU_PROBE_REPLY, 3, 1200),
        udp4.clone(),
        bonded.clone(),
        classed,
        cat(&[&wire::encode_fec_data(0, 0), &udp4]),
        cat(&[&wire::encode_fec_repair(0, 0, 4, 1), &[0u8; 40]]),
    ];
    let mut out: Vec<(&'static str, Vec<u8>)> = Vec::new();
    for f in &frames {
        out.push(("tunnel_receive", record(0, f)));
    }
    // A datagram, a stream packet and a poll, time moving between them.
    out.push((
        "tunnel_receive",
        cat(&[
            &record(0x10, &bonded),
            &record(0x14, &udp4),
            &record(0x36, &[]),
        ]),
    ));
    let len = |p: &[u8]| (p.len() as u16).to_be_bytes();
    out.push((
        "inner_packets",
        cat(&[&len(&udp4), &udp4, &len(&tcp4), &tcp4, &len(&udp6), &udp6]),
    ));
    let mut fb = Vec::new();
    Feedback {
        largest: 100,
        delay: Duration::from_millis(3),
        runs: vec![3, 2, 5],
    }
    .encode(&mut fb);
    out.push(("stripe_packets", cat(&[&[4], &fb])));
    out.push(("stripe_packets", cat(&[&[0], &udp4])));
    let frame = cat(&[&reassembly::header(udp4.len() as u16, 1000), &udp4]);
    out.push(("stream_frames", cat(&[&[0, 0, frame.len() as u8], &frame])));
    out.extend(connect_ip_seeds().into_iter().map(|s| ("connect_ip", s)));
    out
}

/// CONNECT-IP's parsers and the HTTP/3 under them, as a client or server could feed them: the
/// bytes as an HTTP/3 stream (a request stream, or a control stream when the first byte is odd:
/// frames, every HEADERS frame's QPACK field section judged as a request and checked as an
/// answer; and as records for the server's side of a connection, `http3::server`), as a request
/// stream's capsules, arriving
/// in pieces the first byte sizes (every capsule read is written again and must read back the
/// same), as an HTTP Datagram's prefix, and as a request path against the default template and
/// as a configured template.
pub fn connect_ip(data: &[u8]) {
    use crate::connect_ip::{datagram, request, CapsuleReader, Template, TokenHash};
    use crate::http3::{qpack, Frame, FrameReader, On};
    let Some((&piece, rest)) = data.split_first() else {
        return;
    };
    let mut frames = FrameReader::new(match piece % 2 {
        0 => On::Request,
        _ => On::Control,
    });
    'stream: for chunk in rest.chunks(usize::from(piece).max(1)) {
        frames.push(chunk);
        loop {
            match frames.read() {
                Ok(Some(Frame::Headers(section))) => {
                    if let Ok(fields) = qpack::decode(&section, crate::http3::frame::MAX_FRAME) {
                        let tokens = [("t".to_string(), TokenHash::new("mpq_t", &[0; 16]))];
                        let _ = request::judge(&fields, &Template::default(), None, &tokens);
                        let _ = request::check_answer(&fields);
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => break 'stream,
            }
        }
    }
    let _ = frames.finish();
    let _ = qpack::decode(rest, 4096);
    // The server's side of a connection: records [stream, len, bytes...], the stream byte
    // picking a unidirectional (odd) or request stream, its number, its end (0x80) and whether
    // the shell then forgets it (0x40); every request answered 200 or 401.
    let (mut conn, _) = crate::http3::server::ServerConn::new();
    let mut at = rest;
    while let [s, len, tail @ ..] = at {
        let (n, tail) = tail.split_at(usize::from(*len).min(tail.len()));
        let stream = u64::from(s & 0x3e) << 1;
        let fin = s & 0x80 != 0;
        let events = match s & 1 {
            1 => conn.on_uni(stream | 2, n, fin),
            _ => conn.on_request(stream, n, fin),
        };
        for e in events {
            if let crate::http3::server::Event::Request { stream, .. } = e {
                let _ = conn.answer(stream, if stream % 8 == 0 { 200 } else { 401 });
            }
        }
        if s & 0x40 != 0 {
            conn.forget(stream);
        }
        at = tail;
    }
    // The client's side, fed the same records as the server's streams (one request stream).
    let (mut client, _) = crate::http3::client::ClientConn::new();
    let mut at = rest;
    while let [s, len, tail @ ..] = at {
        let (n, tail) = tail.split_at(usize::from(*len).min(tail.len()));
        let _ = match s & 1 {
            1 => client.on_uni(u64::from(s & 0x3e) << 1 | 3, n, s & 0x80 != 0),
            _ => client.on_request(n, s & 0x80 != 0),
        };
        at = tail;
    }
    let mut reader = CapsuleReader::default();
    for chunk in rest.chunks(usize::from(piece).max(1)) {
        reader.push(chunk);
        loop {
            match reader.read() {
                Ok(Some(c)) => {
                    let mut again = Vec::new();
                    c.encode(&mut again);
                    let mut r = CapsuleReader::default();
                    r.push(&again);
                    assert_eq!(r.read(), Ok(Some(c)), "a capsule reads back as written");
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = reader.finish();
    let _ = datagram::parse(rest);
    let text = String::from_utf8_lossy(rest);
    let _ = Template::default().matches(&text);
    if let Ok(t) = Template::parse(&text) {
        let _ = t.matches(&text);
    }
}

/// Starting inputs for `connect_ip`: each capsule as this end writes it, a datagram prefix,
/// request paths.
fn connect_ip_seeds() -> Vec<Vec<u8>> {
    use crate::connect_ip::{datagram, AddressEntry, Capsule, IpRange, Scope, Template};
    let assign = Capsule::AddressAssign(vec![AddressEntry {
        request_id: 1,
        addr: Ipv4Addr::new(10, 200, 17, 1).into(),
        prefix_len: 32,
    }]);
    let request = Capsule::AddressRequest(vec![AddressEntry {
        request_id: 1,
        addr: std::net::Ipv6Addr::UNSPECIFIED.into(),
        prefix_len: 128,
    }]);
    let routes =
        Capsule::RouteAdvertisement(vec![IpRange::everything(false), IpRange::everything(true)]);
    let dgram = Capsule::Datagram {
        context: 0,
        payload: ipv4(17, &[0, 1, 0, 2, 0, 8, 0, 0]),
    };
    let mut all = vec![7u8];
    for c in [&assign, &request, &routes, &dgram] {
        c.encode(&mut all);
    }
    let t = Template::default();
    let scoped = Scope {
        target: Some((Ipv4Addr::new(192, 0, 2, 0).into(), 24)),
        protocol: Some(17),
    };
    let mut prefixed = datagram::ip_prefix(4);
    prefixed.extend_from_slice(&ipv4(17, &[0; 8]));
    // A request stream: HEADERS (a CONNECT-IP request), then DATA holding the capsules.
    let mut stream = vec![16u8];
    stream.extend(crate::http3::frame::frame(
        crate::http3::frame::HEADERS,
        &crate::http3::qpack::encode([
            (":method", "CONNECT"),
            (":protocol", "connect-ip"),
            (":scheme", "https"),
            (":authority", "vpn.example"),
            (":path", "/.well-known/masque/ip/*/*/"),
            ("capsule-protocol", "?1"),
        ]),
    ));
    stream.extend(crate::http3::frame::data_header(all.len() - 1));
    stream.extend_from_slice(&all[1..]);
    let mut control = vec![1u8];
    control.extend(crate::http3::Settings::ours().encode());
    // The same as records for the server's connection: its control stream, then the request.
    let mut conn = vec![0u8];
    let ctl = [&[0u8][..], &crate::http3::Settings::ours().encode()].concat();
    conn.extend([1, ctl.len() as u8]);
    conn.extend(&ctl);
    for piece in stream[1..].chunks(200) {
        conn.extend([0, piece.len() as u8]);
        conn.extend(piece);
    }
    vec![
        all,
        stream,
        control,
        conn,
        [&[0u8][..], t.expand(scoped).as_bytes()].concat(),
        [&[0u8][..], b"/vpn?t={target}&i={ipproto}"].concat(),
        [&[0u8][..], &prefixed].concat(),
    ]
}

/// A minimal IPv4 packet of `proto` around `l4` (10.200.17.1 -> 10.99.0.1).
fn ipv4(proto: u8, l4: &[u8]) -> Vec<u8> {
    let total = (20 + l4.len()) as u16;
    let mut p = vec![0x45, 0];
    p.extend_from_slice(&total.to_be_bytes());
    p.extend_from_slice(&[0, 1, 0x40, 0, 64, proto, 0, 0, 10, 200, 17, 1, 10, 99, 0, 1]);
    p.extend_from_slice(l4);
    p
}
