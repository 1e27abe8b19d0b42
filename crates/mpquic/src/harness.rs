//! Entry points for the fuzz targets of the parsers that files and peers feed the binary
//! (fuzz/fuzz_targets/), and for the replay of their findings in the normal test suite
//! (tests/fuzz_regressions.rs). Each takes any bytes and must return without a panic; what
//! the parsers answer (an error, a refusal, a 4xx) is theirs to decide. The core's parsers
//! have their own entry points (`mpquic_core::harness`).

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use mpquic_core::fec::FecMode;
use mpquic_core::Policy;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::config::{parse_cidr, Config, RoleConfig, TransportMode};
use crate::control::StatusFn;
use crate::hello::{self, Hello, HelloAck};
use crate::status::{PathStatus, StatusReport, TunnelStatus};

pub use mpquic_core::harness::Harness;

/// The token the dashboard harness's server asks for (its seeds carry it).
const TOKEN: &str = "fuzz-token";

/// A configuration file: loaded and checked as `mpquic check-config` does.
pub fn config_file(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(Config {
        role: RoleConfig::Server(s),
        ..
    }) = Config::parse(&text, Path::new("fuzz.yaml"))
    {
        let _ = s.address_plan();
    }
}

/// A path's control exchange, both ends: the bytes read as the client's hello (framing, JSON,
/// and the server's checks of its terms) and as the server's answer (the client's checks),
/// each from a stream and from a CONNECT-IP field (`hello::from_field`).
pub fn hello(data: &[u8]) {
    let rt = runtime();
    let streamed = rt.block_on(hello::read::<Hello>(&mut &data[..]));
    for h in [streamed.ok(), hello::from_field::<Hello>(data).ok()]
        .into_iter()
        .flatten()
    {
        // Past a refused policy or FEC mode, the lanes are checked anyway (the fuzzer should
        // reach them without guessing both).
        let (policy, fec) = crate::server::terms(&h).unwrap_or((Policy::Failover, FecMode::Off));
        let _ = crate::server::lanes_of(&h, policy, fec);
        let _ = h.addr.as_deref().map(parse_cidr);
        let _ = h.previous.as_deref().map(parse_cidr);
        for r in &h.routes {
            let _ = mpquic_core::classify::Prefix::parse(r);
        }
    }
    let streamed = rt.block_on(hello::read::<HelloAck>(&mut &data[..]));
    for ack in [streamed.ok(), hello::from_field::<HelloAck>(data).ok()]
        .into_iter()
        .flatten()
    {
        let _ = crate::client::Assigned::from_answer(&ack);
    }
}

/// Bytes on the control socket: HTTP/1 requests to `/status`, `/metrics` and `/reload` (no
/// instance behind the reload: it answers that the instance is stopping).
pub fn control_http(data: &[u8]) {
    control_answer(data);
}

/// Bytes on the dashboard's listener, which asks for a token.
pub fn dashboard_http(data: &[u8]) {
    dashboard_answer(data);
}

/// What the control socket answers to `data`.
pub fn control_answer(data: &[u8]) -> Vec<u8> {
    let (trigger, requests) = crate::control::reload::channel();
    drop(requests);
    serve_http(crate::control::router(report(), trigger), data)
}

/// What the dashboard answers to `data`.
pub fn dashboard_answer(data: &[u8]) -> Vec<u8> {
    serve_http(
        crate::control::dashboard::router(Some(TOKEN.into()), report()),
        data,
    )
}

/// Every target: its name in fuzz/ and its entry point.
pub const ALL: &[(&str, Harness)] = &[
    ("config_file", config_file),
    ("hello", hello),
    ("control_http", control_http),
    ("dashboard_http", dashboard_http),
];

/// Starting inputs per target: the example configurations, a hello and an answer as the
/// product writes them, and the requests the CLI and a browser send.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    for text in [
        include_str!("../../../examples/seed/client.yaml"),
        include_str!("../../../examples/seed/client-failover.yaml"),
        include_str!("../../../examples/seed/client-stripe.yaml"),
        include_str!("../../../examples/seed/server.yaml"),
        include_str!("../../../examples/seed/server-stripe.yaml"),
    ] {
        out.push(("config_file", text.as_bytes().to_vec()));
    }
    let h = Hello {
        session: 7,
        path: "wan1".into(),
        priority: 1,
        weight: 1,
        policy: "wlb".into(),
        mode: TransportMode::Datagram,
        addr: Some("10.200.17.2/24".into()),
        previous: None,
        fec: Some("auto".into()),
        pipe: None,
        stripe: None,
        instance: Some("mpq0".into()),
        classes: vec![hello::ClassOf {
            name: "default".into(),
            rank: 0,
            default: true,
            policy: "wlb".into(),
            mode: TransportMode::Datagram,
            fec: true,
        }],
        routes: vec!["192.168.10.0/24".into()],
        rate_limit: Some(5_000_000),
        metered: false,
        role: Some("backup".into()),
        counts: false,
        link: Some("starlink".into()),
    };
    let ack = HelloAck {
        ok: true,
        addr: Some("10.200.17.2/24".into()),
        addr6: Some("fd00::2/64".into()),
        mtu: Some(1380),
        ..HelloAck::default()
    };
    for msg in [hello::encode(&h), hello::encode(&ack)]
        .into_iter()
        .flatten()
    {
        out.push(("hello", msg));
    }
    for field in [hello::to_field(&h), hello::to_field(&ack)]
        .into_iter()
        .flatten()
    {
        out.push(("hello", field.into_bytes()));
    }
    for req in [
        "GET /status HTTP/1.1\r\nhost: localhost\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nhost: localhost\r\n\r\nGET /status HTTP/1.1\r\n\r\n",
        "POST /reload HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\n\r\n",
    ] {
        out.push(("control_http", req.as_bytes().to_vec()));
    }
    for req in [
        format!("GET /?token={TOKEN} HTTP/1.1\r\nhost: x\r\n\r\n"),
        format!("GET /status HTTP/1.1\r\nauthorization: Bearer {TOKEN}\r\n\r\n"),
        format!("GET /events?a=b&token={TOKEN} HTTP/1.1\r\nhost: x\r\n\r\n"),
        "GET /status?token=wrong HTTP/1.1\r\n\r\n".to_string(),
    ] {
        out.push(("dashboard_http", req.into_bytes()));
    }
    out
}

/// A report with a tunnel and a path, so the endpoints render something.
fn report() -> StatusFn {
    Arc::new(|| StatusReport {
        role: "server".into(),
        tunnels: vec![TunnelStatus {
            peer: "site1".into(),
            paths: vec![PathStatus {
                name: "wan1".into(),
                state: "up".into(),
                ..PathStatus::default()
            }],
            ..TunnelStatus::default()
        }],
        ..StatusReport::default()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime")
}

/// One HTTP/1 connection whose client sends `data` and then nothing, served by `app` until it
/// ends; an event stream (the dashboard's `/events`, a report a second) is cut after its first
/// event. Returns what the server wrote.
fn serve_http(app: axum::Router, data: &[u8]) -> Vec<u8> {
    let answer = Arc::new(Mutex::new(Vec::new()));
    // A client that sent its requests and closed its side still gets its answers.
    let conn = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(
            TokioIo::new(Wire {
                input: data.to_vec(),
                read: 0,
                answer: answer.clone(),
            }),
            TowerToHyperService::new(app),
        );
    // The timer is made inside the runtime, whose clock it needs.
    let _ =
        runtime().block_on(async { tokio::time::timeout(Duration::from_millis(20), conn).await });
    let out = answer.lock().unwrap_or_else(|e| e.into_inner()).clone();
    out
}

/// The connection: reads `input`, then the end; keeps what is written.
struct Wire {
    input: Vec<u8>,
    read: usize,
    answer: Arc<Mutex<Vec<u8>>>,
}

impl AsyncRead for Wire {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let at = self.read;
        let n = buf.remaining().min(self.input.len() - at);
        buf.put_slice(&self.input[at..at + n]);
        self.read += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        (self.answer.lock().unwrap_or_else(|e| e.into_inner())).extend_from_slice(b);
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
