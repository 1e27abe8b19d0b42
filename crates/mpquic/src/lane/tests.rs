//! The lane end to end in one process over loopback (plain TCP where the kernel refuses
//! MPTCP): a connection relayed both ways, a refused destination reset to the LAN host, a
//! client without a certificate refused at the handshake, a revoked one's connections closed
//! by a reload.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::carry;
use super::dial::Lane;
use super::serve::{self, Destinations};
use crate::pki;
use crate::tls::{self, Served};

fn pki_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pki::init(d, false).unwrap();
    pki::issue(d, "mpquic-server", pki::Kind::Server { sans: vec![] }).unwrap();
    pki::issue(d, "site1", pki::Kind::Client).unwrap();
    dir
}

fn server_tls(d: &Path, revoked: &[String]) -> Arc<rustls::ServerConfig> {
    let tls = tls::server_crypto(
        &d.join("mpquic-server.crt"),
        &d.join("mpquic-server.key"),
        &d.join("ca.crt"),
        false,
        revoked,
        Served::Lane,
    )
    .unwrap();
    Arc::new(tls)
}

async fn server(d: &Path) -> (SocketAddr, Arc<serve::Shared>) {
    let listener = super::socket::mptcp_listener("127.0.0.1:0".parse().unwrap()).unwrap();
    let at = listener.local_addr().unwrap();
    let shared = serve::Shared::new(server_tls(d, &[]), &[]);
    tokio::spawn(serve::run(listener, shared.clone(), Destinations::Any));
    (at, shared)
}

/// The destination: an echo server, telling how each of its connections ended (`None`: in
/// order).
async fn echo() -> (
    SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<Option<std::io::ErrorKind>>,
) {
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dst = echo.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let end = tokio::io::copy(&mut r, &mut w).await;
                let _ = tx.send(end.err().map(|e| e.kind()));
            });
        }
    });
    (dst, rx)
}

fn lane(d: &Path, server: SocketAddr, cert: bool) -> Arc<Lane> {
    let (c, k) = (d.join("site1.crt"), d.join("site1.key"));
    let tls = tls::client_crypto(
        Some(&d.join("ca.crt")),
        false,
        cert.then_some((c.as_path(), k.as_path())),
        false,
        Served::Lane,
    )
    .unwrap();
    Arc::new(Lane {
        server,
        server_name: "mpquic-server".try_into().unwrap(),
        tls: std::sync::RwLock::new(tokio_rustls::TlsConnector::from(Arc::new(tls))),
        ahead: Default::default(),
    })
}

/// A LAN host's connection to `dst`, taken and carried over `lane`: the host's end.
async fn carried(dst: SocketAddr, lane: Arc<Lane>, counters: &Arc<carry::Counters>) -> TcpStream {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (ours, _) = l.accept().await.unwrap();
    tokio::spawn(carry::carry(ours, dst, lane, counters.clone()));
    host
}

/// What the LAN host reads next: the error kind, or `None` for bytes or an orderly end.
async fn read_error(host: &mut TcpStream) -> Option<std::io::ErrorKind> {
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(10), host.read(&mut buf))
        .await
        .expect("answered in time");
    r.err().map(|e| e.kind())
}

#[tokio::test]
async fn a_connection_goes_both_ways_and_a_refused_one_is_reset() {
    let dir = pki_dir();
    let (at, shared) = server(dir.path()).await;
    let served = shared.counters.clone();
    let (dst, _) = echo().await;
    let counters = Arc::new(carry::Counters::default());
    let mut host = carried(dst, lane(dir.path(), at, true), &counters).await;
    // Sent before the server could have answered: it goes on all the same.
    let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
    host.write_all(&data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(10), host.read_exact(&mut back))
        .await
        .expect("echoed in time")
        .unwrap();
    assert_eq!(back, data);
    drop(host);
    assert_eq!(served.connected.load(Ordering::Relaxed), 1);

    // A destination that refuses: the LAN host's connection is reset, not held open.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refused = closed.local_addr().unwrap();
    drop(closed);
    let mut host = carried(refused, lane(dir.path(), at, true), &counters).await;
    assert_eq!(
        read_error(&mut host).await,
        Some(std::io::ErrorKind::ConnectionReset),
        "reset, as the destination would"
    );
    assert_eq!(
        counters.failed[0].load(Ordering::Relaxed),
        1,
        "counted as refused"
    );
    assert_eq!(served.failed[0].load(Ordering::Relaxed), 1);

    // Without a client certificate: no lane, the LAN connection is reset.
    let mut host = carried(dst, lane(dir.path(), at, false), &counters).await;
    assert_eq!(
        read_error(&mut host).await,
        Some(std::io::ErrorKind::ConnectionReset),
        "reset: the lane was not set up"
    );
    assert_eq!(counters.setup_failed.load(Ordering::Relaxed), 1);
    assert_eq!(
        served.connected.load(Ordering::Relaxed),
        1,
        "nothing relayed for it"
    );
}

/// An echo through the lane on `host`: `n` bytes sent come back.
async fn echoes(host: &mut TcpStream, n: usize) -> bool {
    let data = vec![7u8; n];
    if host.write_all(&data).await.is_err() {
        return false;
    }
    let mut back = vec![0u8; n];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), host.read_exact(&mut back)).await,
        Ok(Ok(_))
    )
}

#[tokio::test]
async fn a_reload_that_revokes_the_client_closes_its_lane_connections() {
    let dir = pki_dir();
    let (at, shared) = server(dir.path()).await;
    let (dst, mut ends) = echo().await;
    let counters = Arc::new(carry::Counters::default());
    let mut host = carried(dst, lane(dir.path(), at, true), &counters).await;
    assert!(echoes(&mut host, 1000).await);
    assert_eq!(shared.counters.active.load(Ordering::Relaxed), 1);

    // A reload that revokes another client leaves this one alone.
    let other = vec!["site2".to_string()];
    assert_eq!(shared.install(server_tls(dir.path(), &other), &other), 0);
    assert!(echoes(&mut host, 1000).await, "still relayed");

    let revoked = vec!["site1".to_string()];
    assert_eq!(
        shared.install(server_tls(dir.path(), &revoked), &revoked),
        1
    );
    assert_eq!(
        read_error(&mut host).await,
        Some(std::io::ErrorKind::ConnectionReset),
        "reset: a cut transfer does not end like a whole one"
    );
    let end = tokio::time::timeout(Duration::from_secs(5), ends.recv()).await;
    assert_eq!(
        end.expect("the destination's connection ended").unwrap(),
        Some(std::io::ErrorKind::ConnectionReset),
        "the destination's too"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        shared.counters.active.load(Ordering::Relaxed),
        0,
        "its count goes with it"
    );

    // Its next connection is refused at the handshake: the LAN host's is reset.
    let mut host = carried(dst, lane(dir.path(), at, true), &counters).await;
    assert_eq!(
        read_error(&mut host).await,
        Some(std::io::ErrorKind::ConnectionReset)
    );
    assert_eq!(counters.setup_failed.load(Ordering::Relaxed), 1);
    assert_eq!(
        shared.counters.connected.load(Ordering::Relaxed),
        1,
        "only the first"
    );
}

#[tokio::test]
async fn a_connection_set_up_ahead_carries_the_next_lan_connection_and_a_closed_one_is_skipped() {
    let dir = pki_dir();
    let (at, shared) = server(dir.path()).await;
    let (dst, _) = echo().await;
    let lane = lane(dir.path(), at, true);
    let fill = tokio::spawn(super::dial::fill(lane.clone()));
    let ready = |n| {
        let lane = lane.clone();
        async move {
            for _ in 0..200 {
                if lane.ahead.len() == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("{n} not ready");
        }
    };
    ready(super::ahead::READY).await;
    // Set up ahead, authenticated, waiting for a request: open on the server, not counted bad.
    assert_eq!(
        shared.counters.active.load(Ordering::Relaxed),
        super::ahead::READY as u64
    );
    let counters = Arc::new(carry::Counters::default());
    let mut host = carried(dst, lane.clone(), &counters).await;
    assert!(echoes(&mut host, 1000).await);
    assert_eq!(
        counters.ahead.load(Ordering::Relaxed),
        1,
        "it went out on one set up ahead"
    );
    ready(super::ahead::READY).await;

    // The server closes them all (a revocation of another name would not; this one's does).
    fill.abort();
    let revoked = vec!["site1".to_string()];
    shared.install(server_tls(dir.path(), &revoked), &revoked);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(lane.ahead.len(), super::ahead::READY, "still listed");
    assert!(lane.ahead.take().await.is_none(), "seen closed and skipped");
    assert_eq!(lane.ahead.len(), 0);
    assert_eq!(shared.counters.bad.load(Ordering::Relaxed), 0);
}
