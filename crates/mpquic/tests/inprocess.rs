//! A whole client and server in one process, without root: the real shells, QUIC, TLS (a fresh
//! PKI), hello, health and bonding, on the in-memory network of `io::memnet` (the shells' `Machine`)
//! with memory TUN devices.
//! Runs in `cargo test` in seconds; the namespace end-to-end tests cover the kernel side.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpquic::config::{Config, RoleConfig};
use mpquic::io::memnet::{Host, Network};
use mpquic::{client, pki, server};

const SERVER_TUN: Ipv4Addr = Ipv4Addr::new(10, 200, 17, 254);
const CLIENT_TUN: Ipv4Addr = Ipv4Addr::new(10, 200, 17, 1);
const PATH_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 10, 1, 2), Ipv4Addr::new(10, 10, 2, 2)];

fn config(dir: &Path, name: &str, text: &str) -> Config {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    Config::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// The server's config; `more`: more top-level keys (`key: value\n` lines).
fn server_config_with(dir: &Path, more: &str) -> Config {
    let d = dir.display();
    config(
        dir,
        "server.yaml",
        &format!(
            "role: server\nbind_ip: 0.0.0.0\nremote_port: 4433\nmulti_conn_enabled: true\n\
             tun_name: srv0\ntun_cidr: {SERVER_TUN}/24\n\
             tls_cert_file: {d}/mpquic-server.crt\ntls_key_file: {d}/mpquic-server.key\n\
             control_socket: {d}/server.sock\n{more}"
        ),
    )
}

fn client_config(dir: &Path, mode: &str) -> Config {
    client_config_with(dir, mode, "")
}

/// `path1`: more keys for path 1 (`  key: value\n` lines).
fn client_config_with(dir: &Path, mode: &str, path1: &str) -> Config {
    nth_client_config(dir, 0, mode, "", path1)
}

/// Client `n`'s tunnel address: 10.200.17.(n+1).
fn client_tun(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, 17, 1 + n as u8)
}

/// Client `n` (0: the one the other tests use): certificate site(n+1), TUN cli(n), its own
/// path addresses and control socket; `top`: more top-level keys, `path1`: more keys for path 1.
fn nth_client_config(dir: &Path, n: usize, mode: &str, top: &str, path1: &str) -> Config {
    let d = dir.display();
    let (site, tun) = (format!("site{}", n + 1), client_tun(n));
    let name = match n {
        0 => "client".to_string(),
        n => format!("client{n}"),
    };
    // `top` may choose the policy.
    let policy = match top.contains("multipath_policy:") {
        true => "",
        false => "multipath_policy: failover\n",
    };
    let mut y = format!(
        "role: client\ntransport_mode: {mode}\nmultipath_enabled: true\n{policy}tun_name: cli{n}\n\
         tun_cidr: {tun}/24\ntls_ca_file: {d}/ca.crt\n\
         tls_cert_file: {d}/{site}.crt\ntls_key_file: {d}/{site}.key\n\
         tls_server_name: mpquic-server\ncontrol_socket: {d}/{name}.sock\n{top}multipath_paths:\n"
    );
    for (i, ip) in PATH_IPS.iter().enumerate() {
        let o = ip.octets();
        let ip = Ipv4Addr::new(o[0], o[1], o[2], o[3] + n as u8);
        y += &format!(
            "- name: wan{}\n  bind_ip: {ip}\n  remote_addr: 10.10.0.1\n  remote_port: 4433\n  priority: {}\n",
            i + 1,
            i + 1
        );
        if i == 0 {
            y += path1;
        }
    }
    config(dir, &format!("{name}.yaml"), &y)
}

/// An IPv4/UDP packet carrying `seq` (header checksum filled in).
fn udp_packet(src: Ipv4Addr, dst: Ipv4Addr, seq: u32) -> Vec<u8> {
    let mut p = vec![0x45, 0, 0, 32, 0, 0, 0x40, 0, 64, 17, 0, 0];
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let sum = p
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum::<u32>();
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(&[0x9c, 0x40, 0x9c, 0x41, 0, 12, 0, 0]);
    p.extend_from_slice(&seq.to_be_bytes());
    p
}

fn seq_of(p: &[u8]) -> u32 {
    u32::from_be_bytes([p[28], p[29], p[30], p[31]])
}

/// One packet each way with sequence number `seq`, then `wait`, then collect what arrived.
async fn exchange(
    cli: &mut Host,
    srv: &mut Host,
    seq: u32,
    wait: Duration,
    up: &mut Vec<(u32, Instant)>,
    down: &mut Vec<(u32, Instant)>,
) {
    let up_pkt = udp_packet(CLIENT_TUN, SERVER_TUN, seq);
    cli.to_dev.send(up_pkt).await.unwrap();
    let down_pkt = udp_packet(SERVER_TUN, CLIENT_TUN, seq);
    srv.to_dev.send(down_pkt).await.unwrap();
    tokio::time::sleep(wait).await;
    drain(srv, up);
    drain(cli, down);
}

/// Every packet `host` received so far, as sequence numbers.
fn drain(host: &mut Host, into: &mut Vec<(u32, Instant)>) {
    while let Ok(p) = host.from_dev.try_recv() {
        into.push((seq_of(&p), Instant::now()));
    }
}

/// A fresh PKI in a temporary directory: the CA, the server's certificate and `clients` client
/// certificates (site1, site2, ...).
fn pki_dir(clients: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pki::init(d, false).unwrap();
    pki::issue(d, "mpquic-server", pki::Kind::Server { sans: vec![] }).unwrap();
    for n in 1..=clients {
        pki::issue(d, &format!("site{n}"), pki::Kind::Client).unwrap();
    }
    dir
}

type Instance = tokio::task::JoinHandle<anyhow::Result<()>>;

/// The server (`server_config`) running on `net`.
fn spawn_server(dir: &Path, net: &Arc<Network>) -> Instance {
    spawn_server_with(dir, net, "")
}

/// The server with `more` top-level keys.
fn spawn_server_with(dir: &Path, net: &Arc<Network>, more: &str) -> Instance {
    let cfg = server_config_with(dir, more);
    let RoleConfig::Server(s) = cfg.role.clone() else {
        panic!("not a server configuration")
    };
    tokio::spawn(server::run(cfg, s, net.platform()))
}

/// A client running on `net` with `cfg`.
fn spawn_client(net: &Arc<Network>, cfg: Config) -> Instance {
    let RoleConfig::Client(c) = cfg.role.clone() else {
        panic!("not a client configuration")
    };
    tokio::spawn(client::run(cfg, c, net.platform()))
}

/// Stop the network (the instances' stop signal) and check that each ends cleanly, in time.
async fn stop_all(net: &Network, tasks: Vec<(&str, Instance)>) {
    net.stop();
    for (who, task) in tasks {
        let r = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap_or_else(|_| panic!("{who} did not stop"))
            .unwrap();
        assert!(r.is_ok(), "{who}: {r:?}");
    }
}

/// 300 packets each way, 2 ms apart: every one arrives, once.
async fn all_arrive_once(cli_host: &mut Host, srv_host: &mut Host) {
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for seq in 0..300u32 {
        let wait = Duration::from_millis(2);
        exchange(cli_host, srv_host, seq, wait, &mut up, &mut down).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    drain(srv_host, &mut up);
    drain(cli_host, &mut down);
    for (dir, got) in [("up", &up), ("down", &down)] {
        let mut seqs: Vec<u32> = got.iter().map(|(s, _)| *s).filter(|s| *s < 300).collect();
        seqs.sort_unstable();
        assert_eq!(seqs, (0..300).collect::<Vec<_>>(), "{dir}: lost or doubled");
    }
}

/// What both ends counted, for a test that found a packet missing: the drops by reason and
/// each path's state, reconnects, verdicts and hand-overs (a rare miss on a loaded host is
/// otherwise a bare sequence number).
fn where_lost(dir: &Path) -> String {
    let counted = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = String::new();
    for who in ["client", "server"] {
        let st = status_of(dir, who);
        out += &format!(
            "{who}: drops [{}] refused [{}]\n",
            counted(&st.drops),
            counted(&st.refused)
        );
        for t in &st.tunnels {
            for p in &t.paths {
                out += &format!(
                    "  {} {} for {:.1} s: connects {} ack_silences {} stalls {} handed_over {} \
                     tx/rx {}/{} quic lost {} of {} drops [{}]\n",
                    p.name,
                    p.state,
                    p.state_for_s,
                    p.connects,
                    p.ack_silences,
                    p.delivery_stalls,
                    p.handed_over_packets,
                    p.tx_packets,
                    p.rx_packets,
                    p.quic_lost_packets,
                    p.quic_sent_packets,
                    counted(&p.drops)
                );
            }
        }
    }
    out
}

/// The status of instance `who` (`server`, `client`...) in test directory `dir`.
fn status_of(dir: &Path, who: &str) -> mpquic_status::StatusReport {
    let body =
        mpquic::control::get_over_socket(&dir.join(format!("{who}.sock")), "/status").unwrap();
    serde_json::from_str(&body).unwrap()
}

/// Path `name` of the first tunnel in `st`.
fn path_of(st: &mpquic_status::StatusReport, name: &str) -> Option<mpquic_status::PathStatus> {
    st.tunnels[0].paths.iter().find(|p| p.name == name).cloned()
}

/// Wait until the client has its address and a packet has gone through each way.
async fn warm_up(cli_host: &mut Host, srv_host: &mut Host) {
    // The client gets its address from the server through the hello.
    let t0 = Instant::now();
    while cli_host.address().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no tunnel address");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cli_host.address(), Some((CLIENT_TUN, 24)));
    // The server installs the path just after its answer: until then a packet for the client
    // finds no path (counted as no_path). Start once a packet has gone through each way.
    let (mut up, mut down) = (Vec::new(), Vec::new());
    while up.is_empty() || down.is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no packet through");
        let wait = Duration::from_millis(20);
        exchange(cli_host, srv_host, u32::MAX, wait, &mut up, &mut down).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    drain(srv_host, &mut up);
    drain(cli_host, &mut down);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_and_server_in_process_exchange_and_fail_over() {
    exchange_and_fail_over("datagram").await;
}

/// Reliable mode (the default): the same, except that the dead path's recent packets are sent
/// again on the live one, so some that had arrived before the black hole arrive twice (bounded
/// by the hand-over window: the silence bound plus a round trip, here ~70 packets at most).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliable_mode_in_process_exchange_and_fail_over() {
    exchange_and_fail_over("reliable").await;
}

async fn exchange_and_fail_over(mode: &str) {
    let dir = pki_dir(1);
    let d = dir.path();

    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let server = spawn_server(d, &net);
    let client = spawn_client(&net, client_config(d, mode));

    warm_up(&mut cli_host, &mut srv_host).await;
    let (mut up, mut down) = (Vec::new(), Vec::new());

    // Traffic both ways, one packet every 5 ms, while path 1 (the primary) is black-holed for
    // about 2 s and then repaired.
    let start = Instant::now();
    let mut sent_at = Vec::new();
    for seq in 0..1000u32 {
        let t = start.elapsed();
        if seq == 300 {
            net.blackhole(IpAddr::V4(PATH_IPS[0]), true);
        }
        if seq == 700 {
            net.blackhole(IpAddr::V4(PATH_IPS[0]), false);
        }
        sent_at.push(t);
        let wait = Duration::from_millis(5);
        exchange(&mut cli_host, &mut srv_host, seq, wait, &mut up, &mut down).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    drain(&mut srv_host, &mut up);
    drain(&mut cli_host, &mut down);

    for (dir, got) in [("up", &up), ("down", &down)] {
        let seqs: std::collections::HashSet<u32> = got.iter().map(|(s, _)| *s).collect();
        let twice = got.len() - seqs.len();
        if mode == "reliable" {
            assert!(twice <= 70, "{dir}: {twice} packets delivered twice");
        } else {
            assert_eq!(twice, 0, "{dir}: a packet was delivered twice");
        }
        // Before the failure: everything. After failover and after the repair: everything.
        for range in [0..300u32, 500..700, 800..1000] {
            let missing: Vec<u32> = range.filter(|s| !seqs.contains(s)).collect();
            let when: Vec<f64> = missing
                .iter()
                .map(|s| sent_at[*s as usize].as_secs_f64())
                .collect();
            assert!(
                missing.is_empty(),
                "{dir}: lost {missing:?}, sent at {when:?} s (black hole from {:.2} to {:.2} s)\n{}",
                sent_at[300].as_secs_f64(),
                sent_at[700].as_secs_f64(),
                where_lost(d)
            );
        }
        // The black hole costs less than a second of packets.
        let lost = (300..700u32).filter(|s| !seqs.contains(s)).count();
        assert!(lost < 200, "{dir}: {lost} packets lost across the failover");
        println!("[measure] in-process {mode} {dir}: {} of 1000 delivered ({twice} twice), {lost} lost across the 2 s black hole of the primary path", seqs.len());
    }

    stop_all(&net, vec![("server", server), ("client", client)]).await;
}

/// `pipes: 3` on path 1: three QUIC connections (three client ports) that the server joins into
/// one path; packets go over all three, none lost or doubled; status and metrics show each pipe.
/// A pipe whose pipe 0 the server does not have is refused with a reason, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipes_make_one_path_and_a_stray_pipe_is_refused() {
    use mpquic::hello::{Hello, PipeOf};
    use mpquic::transport::{Dialer, Known};

    let dir = pki_dir(1);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let ccfg = client_config_with(d, "datagram", "  pipes: 3\n");
    let RoleConfig::Client(c) = ccfg.role.clone() else {
        panic!("role")
    };
    let server = spawn_server(d, &net);
    let client = spawn_client(&net, ccfg.clone());
    warm_up(&mut cli_host, &mut srv_host).await;

    all_arrive_once(&mut cli_host, &mut srv_host).await;

    let status = |who: &str| status_of(d, who);
    for who in ["client", "server"] {
        let st = status(who);
        let path = |name: &str| st.tunnels[0].paths.iter().find(|p| p.name == name).unwrap();
        let wan1 = path("wan1");
        let mut ports: Vec<u16> = wan1.pipes.iter().map(|p| p.port).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 3, "{who}: {:?}", wan1.pipes);
        for p in &wan1.pipes {
            // 300 packets each way went round the pipes (and the probes with them).
            assert!(
                p.tx_bytes > 5_000 && p.rx_bytes > 5_000,
                "{who}: {:?}, connects {}",
                wan1.pipes,
                wan1.connects
            );
        }
        assert!(path("wan2").pipes.is_empty(), "wan2 has one pipe");
        println!(
            "[measure] in-process pipes, {who}: {}",
            wan1.pipes_summary().unwrap()
        );
        let metrics = st.to_openmetrics();
        assert!(
            metrics.contains("mpquic_pipe_tx_bytes_total{") && metrics.contains("pipe=\"wan1.2\""),
            "{metrics}"
        );
    }

    // Pipe 1 of a path the server has no pipe 0 of.
    let dialer = mpquic::transport::quic::QuicDialer::new(&ccfg, &c, 1500, net.platform()).unwrap();
    let stray = Hello {
        session: 7,
        path: "wan9".into(),
        priority: 1,
        weight: 1,
        policy: "failover".into(),
        mode: c.classes[0].mode,
        addr: None,
        previous: None,
        fec: None,
        pipe: Some(PipeOf { index: 1, count: 2 }),
        stripe: None,
        routes: Vec::new(),
        rate_limit: None,
        metered: false,
        role: None,
        counts: false,
        link: None,
        instance: None,
        classes: Vec::new(),
    };
    let mpquic::transport::Dialed {
        transport: t, ack, ..
    } = dialer
        .dial(&c.paths[1], &stray, Known::default())
        .await
        .unwrap();
    t.close(0, "done");
    assert!(!ack.ok);
    let why = ack.error.unwrap();
    assert!(why.contains("pipe 0 is not connected"), "{why}");
    assert_eq!(status("server").refused.get("pipe_without_path"), Some(&1));

    stop_all(&net, vec![("server", server), ("client", client)]).await;
}

/// Two clients with FEC: the server reads batches holding packets for both, and each session's
/// packets still get their FEC header. (Before the server routed every session's share before
/// sending any, a batch was shared once the first session sent, and the second session's packets
/// in it went out unprotected, and unnumbered under a per-packet policy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_for_two_clients_gets_every_header() {
    let dir = pki_dir(2);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let server = spawn_server(d, &net);
    let mut hosts = Vec::new();
    let mut clients = Vec::new();
    for n in 0..2 {
        hosts.push(net.host(&format!("cli{n}")));
        let cfg = nth_client_config(d, n, "datagram", "fec: 10/2\n", "");
        clients.push(spawn_client(&net, cfg));
    }
    // Both sessions up: a packet from each client reaches the server.
    let t0 = Instant::now();
    let mut seen = [false; 2];
    while seen != [true, true] {
        assert!(t0.elapsed() < Duration::from_secs(10), "clients not up");
        for (n, h) in hosts.iter().enumerate() {
            if h.address().is_some() {
                let _ = h
                    .to_dev
                    .try_send(udp_packet(client_tun(n), SERVER_TUN, u32::MAX));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        while let Ok(p) = srv_host.from_dev.try_recv() {
            let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
            for (n, seen) in seen.iter_mut().enumerate() {
                *seen |= src == client_tun(n);
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Bursts of packets for both clients, interleaved, so the server reads them together.
    for burst in 0..20u32 {
        for seq in 0..16u32 {
            for n in 0..2 {
                let pkt = udp_packet(SERVER_TUN, client_tun(n), burst * 16 + seq);
                srv_host.to_dev.send(pkt).await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = status_of(d, "server");
    assert_eq!(st.tunnels.len(), 2);
    for t in &st.tunnels {
        let sent: u64 = t.paths.iter().map(|p| p.tx_packets).sum();
        let protected: u64 = t.paths.iter().map(|p| p.fec_protected_packets).sum();
        println!("[measure] in-process, two clients, one server batch: {} sent {sent} packets, {protected} with FEC", t.peer);
        assert!(sent >= 320, "{}: {sent}", t.peer);
        assert_eq!(
            protected, sent,
            "{}: packets sent without their FEC header",
            t.peer
        );
    }
    for (n, h) in hosts.iter_mut().enumerate() {
        let mut got = 0;
        while let Ok(p) = h.from_dev.try_recv() {
            got += usize::from(seq_of(&p) < 320);
        }
        assert_eq!(got, 320, "client {n}");
    }
    let mut all = vec![("server", server)];
    all.extend(clients.into_iter().map(|c| ("client", c)));
    stop_all(&net, all).await;
}

/// `transport: stripe` with 3 pipes on path 1: the path's datagrams go in sealed stripe packets
/// over three client ports to the server's stripe socket; nothing lost or doubled; status shows
/// each pipe and the controller's figures; packets to the stripe port that name no session are
/// refused and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_path_carries_the_tunnel_and_refuses_strangers() {
    use std::net::SocketAddr;
    let dir = pki_dir(1);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let ccfg = client_config_with(d, "datagram", "  pipes: 3\n  transport: stripe\n");
    let server = spawn_server_with(d, &net, "stripe_enabled: true\nstripe_port: 5433\n");
    let client = spawn_client(&net, ccfg.clone());
    warm_up(&mut cli_host, &mut srv_host).await;
    let status = |who: &str| status_of(d, who);
    let wan1 = |who: &str| path_of(&status(who), "wan1").unwrap();

    // The pipes' counters are the current link's: a reconnect between the exchange and the
    // status read (a loaded CI host can stall a path into one) starts them again, so the
    // exchange is repeated until it ran on one link from start to end.
    for attempt in 1.. {
        let before = (wan1("client").connects, wan1("server").connects);
        all_arrive_once(&mut cli_host, &mut srv_host).await;
        if (wan1("client").connects, wan1("server").connects) == before {
            break;
        }
        assert!(attempt < 3, "wan1 reconnected during each exchange");
        println!("[measure] wan1 reconnected during exchange {attempt}: again");
    }

    // Strangers at the stripe port: too short to name a session, and a session nobody has.
    let stranger = net.bind("10.10.9.9:0".parse().unwrap()).unwrap();
    let to: SocketAddr = "10.10.0.1:5433".parse().unwrap();
    let mut forged = vec![1u8, 1];
    forged.extend_from_slice(&[0xab; 8 + 8 + 40]);
    for contents in [&[1u8, 2, 3][..], &forged] {
        let t = quinn::udp::Transmit {
            destination: to,
            ecn: None,
            contents,
            segment_size: None,
            src_ip: None,
        };
        stranger.try_send(&t).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    for who in ["client", "server"] {
        let wan1 = &wan1(who);
        let mut ports: Vec<u16> = wan1.pipes.iter().map(|p| p.port).collect();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 3, "{who}: {:?}", wan1.pipes);
        for p in &wan1.pipes {
            assert!(
                p.tx_bytes > 5_000 && p.rx_bytes > 5_000,
                "{who}: {:?}, connects {}",
                wan1.pipes,
                wan1.connects
            );
        }
        assert!(wan1.quic_rtt_ms.is_some_and(|r| r > 0.0), "{who}: {wan1:?}");
        assert!(wan1.cwnd_bytes.is_some_and(|c| c > 0), "{who}: {wan1:?}");
        println!(
            "[measure] in-process stripe, {who}: {}",
            wan1.pipes_summary().unwrap()
        );
    }
    let refused = status("server").refused;
    assert_eq!(refused.get("stripe_malformed"), Some(&1), "{refused:?}");
    assert_eq!(
        refused.get("stripe_unknown_session"),
        Some(&1),
        "{refused:?}"
    );
    stop_all(&net, vec![("server", server), ("client", client)]).await;
}

/// A server without `stripe_enabled` refuses a stripe path, with the reason, and counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_path_to_a_server_without_stripe_is_refused() {
    let dir = pki_dir(1);
    let d = dir.path();
    let ccfg = client_config_with(d, "datagram", "  transport: stripe\n");
    let net = Network::new();
    let _srv_host = net.host("srv0");
    let server = spawn_server(d, &net);
    let RoleConfig::Client(c) = ccfg.role.clone() else {
        panic!("role")
    };
    let dialer = mpquic::transport::quic::QuicDialer::new(&ccfg, &c, 1500, net.platform()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let hello = mpquic::hello::Hello {
        session: 7,
        path: "wan1".into(),
        priority: 1,
        weight: 1,
        policy: "failover".into(),
        mode: c.classes[0].mode,
        addr: None,
        previous: None,
        fec: None,
        pipe: None,
        stripe: None,
        routes: Vec::new(),
        rate_limit: None,
        metered: false,
        role: None,
        counts: false,
        link: None,
        instance: None,
        classes: Vec::new(),
    };
    use mpquic::transport::{Dialer, Known};
    let mpquic::transport::Dialed {
        transport: t, ack, ..
    } = dialer
        .dial(&c.paths[0], &hello, Known::default())
        .await
        .unwrap();
    t.close(0, "done");
    let why = ack.error.unwrap_or_default();
    assert!(!ack.ok && why.contains("stripe_enabled"), "{why}");
    let refused = status_of(d, "server").refused;
    assert_eq!(refused.get("stripe_disabled"), Some(&1), "{refused:?}");
    stop_all(&net, vec![("server", server)]).await;
}

/// An IPv4/UDP packet from `src:sport` to `dst:dport` carrying `seq`.
fn udp_ports(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, seq: u32) -> Vec<u8> {
    let mut p = udp_packet(src, dst, seq);
    p[20..22].copy_from_slice(&sport.to_be_bytes());
    p[22..24].copy_from_slice(&dport.to_be_bytes());
    p
}

/// Traffic classes in one client: a flow its rule puts in `critical` goes up in that class, and
/// the server sends the flow's answers back in it (learnt from the flow); a flow no rule
/// matches goes in `default` both ways; the classes share one connection per path (each a lane
/// of one tunnel, with its own policy); status counts both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_carry_their_flows_both_ways() {
    let dir = pki_dir(1);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let classes = "classes:\n- name: critical\n  multipath_policy: redundant\n  transport_mode: datagram\n  match:\n  - protocol: udp\n    port: 5060\n- name: default\n";
    let server = spawn_server(d, &net);
    let cfg = nth_client_config(d, 0, "datagram", classes, "");
    let file = cfg.file.clone();
    let client = spawn_client(&net, cfg);
    warm_up(&mut cli_host, &mut srv_host).await;
    let before = |who: &str| {
        status_of(d, who).tunnels[0]
            .classes
            .iter()
            .map(|c| (c.name.clone(), c.classified_packets + c.unmatched_packets))
            .collect::<Vec<_>>()
    };
    let (cli0, srv0) = (before("client"), before("server"));

    let (mut up, mut down) = (Vec::new(), Vec::new());
    // SIP (critical) and web (default) from the site, then their answers (once the server has
    // seen each flow: an answer to a flow it has not seen goes in the default class).
    for seq in 0..200u32 {
        for dport in [5060, 80] {
            let p = udp_ports(CLIENT_TUN, SERVER_TUN, 40000, dport, seq);
            cli_host.to_dev.send(p).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for seq in 0..200u32 {
        for sport in [5060, 80] {
            let p = udp_ports(SERVER_TUN, CLIENT_TUN, sport, 40000, seq);
            srv_host.to_dev.send(p).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    drain(&mut srv_host, &mut up);
    drain(&mut cli_host, &mut down);
    for (dir, got) in [("up", &up), ("down", &down)] {
        let n = got.iter().filter(|(s, _)| *s < 200).count();
        assert_eq!(n, 400, "{dir}: every packet of both classes, once");
    }

    for who in ["client", "server"] {
        let st = status_of(d, who);
        assert_eq!(
            st.tunnels.len(),
            1,
            "{who}: one tunnel, the classes its lanes"
        );
        let t = &st.tunnels[0];
        let classes: Vec<_> = t.classes.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(classes, ["critical", "default"], "{who}");
        let (crit, dflt) = (&t.classes[0], &t.classes[1]);
        assert_eq!(crit.policy, "redundant", "{who}: the class's own bond");
        assert_eq!(dflt.policy, "failover", "{who}");
        let base = if who == "client" { &cli0 } else { &srv0 };
        let counted = |c: &mpquic_status::ClassStatus, i: usize| {
            c.classified_packets + c.unmatched_packets - base[i].1
        };
        // The client classifies by its rules; the server by the class each flow arrived in.
        assert_eq!(
            crit.classified_packets - base[0].1,
            200,
            "{who}: critical {crit:?}"
        );
        assert_eq!(counted(dflt, 1), 200, "{who}: default");
        if who == "client" {
            assert_eq!(
                dflt.classified_packets, 0,
                "the default class takes no rule's packets"
            );
        }
        // Each class sent its 200 packets (critical's `redundant` on both paths, which its
        // lane counts once), over the paths' one connection each.
        assert!(
            crit.tx_packets >= 200 && dflt.tx_packets >= 200,
            "{who}: {t:?}"
        );
        for p in &t.paths {
            assert_eq!(
                p.connects, 1,
                "{who} {}: one connection for both classes",
                p.name
            );
        }
        let wan1 = t.paths.iter().find(|p| p.name == "wan1").unwrap();
        assert!(wan1.tx_packets >= 400, "{who}: {}", wan1.tx_packets);
        if who == "server" {
            assert_eq!(t.peer, "site1/cli0", "a session per instance");
        }
    }
    let m = mpquic::control::get_over_socket(&d.join("server.sock"), "/metrics").unwrap();
    assert!(
        m.contains("mpquic_path_up{tunnel=\"site1/cli0\",path=\"wan1\"} 1"),
        "{m}"
    );
    assert!(
        m.contains(
            "mpquic_class_packets_total{tunnel=\"site1/cli0\",class=\"critical\",how=\"matched\"} "
        ),
        "{m}"
    );

    // A reload moves SIP to another port: packets follow the new rule from then on; the
    // classes and their connections stay.
    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replace("port: 5060", "port: 5070")).unwrap();
    let sock = d.join("client.sock");
    let what = tokio::task::spawn_blocking(move || mpquic::control::reload_over_socket(&sock));
    assert_eq!(
        what.await.unwrap().unwrap(),
        "classes: match rules changed; TLS certificate, key and CA read again"
    );
    let (crit0, dflt0) = {
        let st = status_of(d, "client");
        let c = &st.tunnels[0].classes;
        (c[0].classified_packets, c[1].unmatched_packets)
    };
    for seq in 1000..1050u32 {
        for dport in [5060, 5070] {
            let p = udp_ports(CLIENT_TUN, SERVER_TUN, 40001, dport, seq);
            cli_host.to_dev.send(p).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut after = Vec::new();
    drain(&mut srv_host, &mut after);
    assert_eq!(after.iter().filter(|(s, _)| *s >= 1000).count(), 100);
    let st = status_of(d, "client");
    let t = &st.tunnels[0];
    let (crit, dflt) = (&t.classes[0], &t.classes[1]);
    assert_eq!(
        crit.classified_packets - crit0,
        50,
        "port 5070 is critical now"
    );
    assert!(dflt.unmatched_packets - dflt0 >= 50, "port 5060 is not");
    let wan1 = t.paths.iter().find(|p| p.name == "wan1").unwrap();
    assert_eq!(wan1.connects, 1, "wan1 was reconnected");
    stop_all(&net, vec![("server", server), ("client", client)]).await;
}

/// Reliable mode under a per-packet policy: when a path goes down, the packets its stream
/// carried recently are sent again on the live one, without their old numbering (sent with it,
/// the receiver took the old header for the packet and dropped it as malformed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliable_hand_over_under_wlb_delivers_packets_not_headers() {
    let dir = pki_dir(1);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let server = spawn_server(d, &net);
    let top = "multipath_policy: wlb\n";
    let client = spawn_client(&net, nth_client_config(d, 0, "reliable", top, ""));
    warm_up(&mut cli_host, &mut srv_host).await;
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for seq in 0..600u32 {
        if seq == 200 {
            net.blackhole(IpAddr::V4(PATH_IPS[0]), true);
        }
        exchange(
            &mut cli_host,
            &mut srv_host,
            seq,
            Duration::from_millis(3),
            &mut up,
            &mut down,
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let handed: u64 = ["client", "server"]
        .iter()
        .flat_map(|w| status_of(d, w).tunnels[0].paths.clone())
        .map(|p| p.handed_over_packets)
        .sum();
    for who in ["client", "server"] {
        let st = status_of(d, who);
        let malformed: u64 = st.tunnels[0]
            .paths
            .iter()
            .map(|p| p.drops.get("malformed").copied().unwrap_or(0))
            .sum();
        assert_eq!(malformed, 0, "{who}: {:?}", st.tunnels[0].paths);
    }
    println!(
        "[measure] in-process reliable wlb: {handed} packets handed over when path 1 went dark"
    );
    assert!(
        handed > 0,
        "no hand-over happened: the test did not test it"
    );
    stop_all(&net, vec![("server", server), ("client", client)]).await;
}

/// Reload under traffic (`control/reload.rs`): a third path added and path 2's weight changed leave
/// path 1's connection alone and lose nothing; the server learns the new weight; a removed path
/// is retired on both sides; the policy changes within its kind; a broken file and a change to
/// a key fixed at start are refused
/// with the reason (in the answer and in status), the running configuration kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_paths_without_touching_the_others() {
    let dir = pki_dir(1);
    let d = dir.path().to_path_buf();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let server = spawn_server(&d, &net);
    let cfg = client_config(&d, "datagram");
    let file = cfg.file.clone();
    let original = std::fs::read_to_string(&file).unwrap();
    let client = spawn_client(&net, cfg);
    warm_up(&mut cli_host, &mut srv_host).await;

    let reload = |d: &Path| {
        let sock = d.join("client.sock");
        tokio::task::spawn_blocking(move || mpquic::control::reload_over_socket(&sock))
    };
    let wait_for =
        |who: &'static str, what: &'static str, ok: fn(&mpquic_status::StatusReport) -> bool| {
            let d = d.clone();
            async move {
                let t0 = Instant::now();
                loop {
                    let st = status_of(&d, who);
                    if ok(&st) {
                        return st;
                    }
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "{who}: {what}: {st:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };

    // Add wan3, change wan2's weight.
    let changed = original.replace("  priority: 2\n", "  priority: 2\n  weight: 5\n")
        + "- name: wan3\n  bind_ip: 10.10.3.2\n  remote_addr: 10.10.0.1\n  remote_port: 4433\n  priority: 3\n";
    std::fs::write(&file, &changed).unwrap();
    let what = reload(&d).await.unwrap().unwrap();
    assert_eq!(
        what,
        "paths: added wan3; changed wan2; TLS certificate, key and CA read again"
    );
    all_arrive_once(&mut cli_host, &mut srv_host).await;
    let st = wait_for("server", "wan3 up, wan2 weight 5", |st| {
        let p = |n: &str| {
            st.tunnels
                .first()
                .and_then(|t| t.paths.iter().find(|p| p.name == n))
        };
        p("wan3").is_some_and(|p| p.state == "up") && p("wan2").is_some_and(|p| p.weight == 5)
    })
    .await;
    assert_eq!(
        path_of(&st, "wan1").unwrap().connects,
        1,
        "wan1 was reconnected"
    );
    let st = status_of(&d, "client");
    assert_eq!(path_of(&st, "wan1").unwrap().connects, 1);
    assert_eq!(path_of(&st, "wan2").unwrap().weight, 5);
    assert!(st.last_reload.as_ref().is_some_and(|r| r.ok));

    // Remove wan3: retired on both sides, still listed with its counters.
    std::fs::write(
        &file,
        original.replace("  priority: 2\n", "  priority: 2\n  weight: 5\n"),
    )
    .unwrap();
    assert_eq!(
        reload(&d).await.unwrap().unwrap(),
        "paths: removed wan3; TLS certificate, key and CA read again"
    );
    wait_for("client", "wan3 removed", |st| {
        st.tunnels[0]
            .paths
            .iter()
            .any(|p| p.name == "wan3" && p.state == "removed")
    })
    .await;
    wait_for("server", "wan3 removed", |st| {
        st.tunnels[0]
            .paths
            .iter()
            .any(|p| p.name == "wan3" && p.state == "removed")
    })
    .await;
    all_arrive_once(&mut cli_host, &mut srv_host).await;

    // The policy, within its kind: the server learns it from the paths' new hellos.
    let weighted = original.replace("  priority: 2\n", "  priority: 2\n  weight: 5\n");
    let balanced = weighted.replace("multipath_policy: failover", "multipath_policy: balanced");
    std::fs::write(&file, &balanced).unwrap();
    assert_eq!(
        reload(&d).await.unwrap().unwrap(),
        "multipath_policy failover -> balanced; TLS certificate, key and CA read again"
    );
    wait_for("server", "policy balanced", |st| {
        st.tunnels[0].policy == "balanced"
            && st.tunnels[0]
                .paths
                .iter()
                .filter(|p| p.state == "up")
                .count()
                == 2
    })
    .await;
    assert_eq!(status_of(&d, "client").tunnels[0].policy, "balanced");
    all_arrive_once(&mut cli_host, &mut srv_host).await;
    std::fs::write(&file, balanced.replace("policy: balanced", "policy: wlb")).unwrap();
    let e = reload(&d).await.unwrap().unwrap_err().to_string();
    assert!(e.contains("between a per-packet policy and another"), "{e}");

    // A broken file, then a key fixed at start: refused, nothing changed.
    std::fs::write(&file, "role: client\nmultipath_paths: [\n").unwrap();
    let e = reload(&d).await.unwrap().unwrap_err().to_string();
    assert!(e.contains("client.yaml"), "{e}");
    let st = status_of(&d, "client");
    assert!(st.last_reload.as_ref().is_some_and(|r| !r.ok), "{st:?}");
    std::fs::write(&file, original.replace("tun_name: cli0", "tun_name: cli9")).unwrap();
    let e = reload(&d).await.unwrap().unwrap_err().to_string();
    assert!(e.contains("tun_name cannot change while running"), "{e}");
    let st = status_of(&d, "client");
    assert_eq!(path_of(&st, "wan2").unwrap().weight, 5);
    assert_eq!(st.tunnels[0].policy, "balanced");
    all_arrive_once(&mut cli_host, &mut srv_host).await;

    stop_all(&net, vec![("client", client), ("server", server)]).await;
}

/// An IPv6/UDP packet carrying `seq` (UDP checksum left zero: nothing on the way checks it).
fn udp6_packet(src: Ipv6Addr, dst: Ipv6Addr, seq: u32) -> Vec<u8> {
    let mut p = vec![0x60, 0, 0, 0, 0, 12, 17, 64];
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&[0x9c, 0x40, 0x9c, 0x41, 0, 12, 0, 0]);
    p.extend_from_slice(&seq.to_be_bytes());
    p
}

/// IPv6 inside the tunnel: with a dual-stack `tun_cidr` the server gives the client both
/// addresses (its IPv6 one carries its IPv4 host number), IPv6 packets go through both ways, and
/// one from an IPv6 source that is not the client's is dropped and counted as spoofed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_inside_a_dual_stack_tunnel() {
    let dir = pki_dir(1);
    let d = dir.path();
    let net = Network::new();
    let mut srv_host = net.host("srv0");
    let mut cli_host = net.host("cli0");
    let base = server_config_with(d, "");
    let text = std::fs::read_to_string(&base.file).unwrap().replace(
        &format!("tun_cidr: {SERVER_TUN}/24"),
        &format!("tun_cidr: {SERVER_TUN}/24, fd00:17::fe/64"),
    );
    let cfg = config(d, "server6.yaml", &text);
    let RoleConfig::Server(s) = cfg.role.clone() else {
        unreachable!()
    };
    let server = tokio::spawn(server::run(cfg, s, net.platform()));
    let client = spawn_client(&net, client_config(d, "datagram"));
    warm_up(&mut cli_host, &mut srv_host).await;

    let (server6, client6): (Ipv6Addr, Ipv6Addr) = (
        "fd00:17::fe".parse().unwrap(),
        "fd00:17::1".parse().unwrap(),
    );
    for who in ["client", "server"] {
        let st = status_of(d, who);
        assert_eq!(
            st.tunnels[0].address6.as_deref(),
            Some("fd00:17::1/64"),
            "{who}"
        );
    }
    let seq6 = |p: &[u8]| u32::from_be_bytes([p[48], p[49], p[50], p[51]]);
    for seq in 0..50u32 {
        cli_host
            .to_dev
            .send(udp6_packet(client6, server6, seq))
            .await
            .unwrap();
        srv_host
            .to_dev
            .send(udp6_packet(server6, client6, seq))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Forged: another address of the tunnel's IPv6 network.
    let forged: Ipv6Addr = "fd00:17::99".parse().unwrap();
    for seq in 100..110u32 {
        cli_host
            .to_dev
            .send(udp6_packet(forged, server6, seq))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = |host: &mut Host| {
        let mut v = Vec::new();
        while let Ok(p) = host.from_dev.try_recv() {
            if p[0] >> 4 == 6 {
                v.push(seq6(&p));
            }
        }
        v.sort_unstable();
        v
    };
    assert_eq!(got(&mut srv_host), (0..50).collect::<Vec<_>>(), "up");
    assert_eq!(got(&mut cli_host), (0..50).collect::<Vec<_>>(), "down");
    let st = status_of(d, "server");
    let spoofed: u64 = (st.tunnels[0].paths.iter())
        .map(|p| p.drops.get("spoofed_source").copied().unwrap_or(0))
        .sum();
    assert_eq!(spoofed, 10, "{st:?}");
    stop_all(&net, vec![("client", client), ("server", server)]).await;
}
