//! The live dashboard (`dashboard_listen`): one self-contained page (`dashboard.html`, no CDN,
//! works offline) fed by server-sent events carrying the same `StatusReport` as
//! `mpquic status --json`, once a second. Off unless configured; a listener off loopback needs
//! `dashboard_token` (the config refuses it otherwise), asked for as `?token=` (the page passes
//! its own on to the event stream) or `Authorization: Bearer`. The report holds no keys.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tracing::{info, warn};

use super::report::StatusFn;
use crate::config::Dashboard;

const PAGE: &str = include_str!("dashboard.html");
/// How often the event stream sends a report; and how often it looks for a path whose state
/// changed, which is sent at once (a failover shows within a look, not a second).
const EVERY: Duration = Duration::from_secs(1);
const LOOK: Duration = Duration::from_millis(200);
/// Event streams open at once (each costs a report a second): a bound, not a tuning knob.
const MAX_STREAMS: usize = 16;

struct State {
    status: StatusFn,
    token: Option<String>,
    streams: AtomicUsize,
}

/// Serve the dashboard on `cfg.listen` until the runtime stops.
pub async fn serve(cfg: &Dashboard, status: StatusFn) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen for the dashboard on {}", cfg.listen))?;
    let app = router(cfg.token.clone(), status);
    info!(addr = %cfg.listen, token = cfg.token.is_some(), "dashboard listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!(error = %e, "dashboard stopped");
        }
    });
    Ok(())
}

/// The dashboard's endpoints: the page, `/status` once and `/events`, each asking for `token`
/// when there is one.
pub fn router(token: Option<String>, status: StatusFn) -> Router {
    let st = Arc::new(State {
        status,
        token,
        streams: AtomicUsize::new(0),
    });
    let (s1, s2, s3) = (st.clone(), st.clone(), st);
    Router::new()
        .route("/", get(move |u: Uri, h: HeaderMap| page(s1, u, h)))
        .route("/status", get(move |u: Uri, h: HeaderMap| once(s2, u, h)))
        .route("/events", get(move |u: Uri, h: HeaderMap| events(s3, u, h)))
}

/// With a token configured, the request must carry it (query or bearer header).
fn authorized(st: &State, uri: &Uri, headers: &HeaderMap) -> bool {
    let Some(want) = &st.token else { return true };
    let from_query = uri
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter_map(|kv| kv.strip_prefix("token="));
    let from_header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    from_query
        .chain(from_header)
        .any(|got| same(got.as_bytes(), want.as_bytes()))
}

/// Equality without an early exit, so response times do not tell how much of a guess matched.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn refused() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        "mpquic dashboard: add ?token=... (dashboard_token) to the address\n",
    )
        .into_response()
}

async fn page(st: Arc<State>, uri: Uri, headers: HeaderMap) -> Response {
    if !authorized(&st, &uri, &headers) {
        return refused();
    }
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // Everything the page needs is in it; nothing from elsewhere, no framing.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; frame-ancestors 'none'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

async fn once(st: Arc<State>, uri: Uri, headers: HeaderMap) -> Response {
    if !authorized(&st, &uri, &headers) {
        return refused();
    }
    axum::Json((st.status)()).into_response()
}

/// Counts an open event stream; uncounts it when the stream ends (the browser went away).
struct Open(Arc<State>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn events(st: Arc<State>, uri: Uri, headers: HeaderMap) -> Response {
    if !authorized(&st, &uri, &headers) {
        return refused();
    }
    if st.streams.fetch_add(1, Ordering::Relaxed) >= MAX_STREAMS {
        st.streams.fetch_sub(1, Ordering::Relaxed);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "mpquic dashboard: too many open pages\n",
        )
            .into_response();
    }
    let open = Open(st);
    let stream = futures_util::stream::unfold((open, None::<Sent>), |(open, sent)| async move {
        let (report, states) = loop {
            let report = (open.0.status)();
            let states = path_states(&report);
            match &sent {
                Some((at, was)) if at.elapsed() < EVERY && *was == states => {
                    tokio::time::sleep(LOOK).await
                }
                _ => break (report, states),
            }
        };
        let json = serde_json::to_string(&report).unwrap_or_default();
        let ev = Event::default().event("status").data(json);
        Some((
            Ok::<_, Infallible>(ev),
            (open, Some((std::time::Instant::now(), states))),
        ))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Every path's state, by tunnel: a change is worth a report at once.
type States = Vec<(String, String, String)>;
/// When the last report went out and the states it had.
type Sent = (std::time::Instant, States);

fn path_states(r: &crate::status::StatusReport) -> States {
    r.tunnels
        .iter()
        .flat_map(|t| {
            t.paths
                .iter()
                .map(|p| (t.peer.clone(), p.name.clone(), p.state.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(token: Option<&str>) -> State {
        State {
            status: Arc::new(crate::status::StatusReport::default),
            token: token.map(str::to_string),
            streams: AtomicUsize::new(0),
        }
    }

    #[test]
    fn token_from_query_or_bearer_header() {
        let st = state(Some("0123456789abcdef"));
        let h = HeaderMap::new();
        assert!(!authorized(&st, &"/".parse().unwrap(), &h));
        assert!(!authorized(
            &st,
            &"/?token=0123456789abcdeX".parse().unwrap(),
            &h
        ));
        assert!(!authorized(
            &st,
            &"/?token=0123456789abcde".parse().unwrap(),
            &h
        ));
        assert!(authorized(
            &st,
            &"/events?x=1&token=0123456789abcdef".parse().unwrap(),
            &h
        ));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            "Bearer 0123456789abcdef".parse().unwrap(),
        );
        assert!(authorized(&st, &"/status".parse().unwrap(), &h));
        // No token configured (loopback): open.
        assert!(authorized(
            &state(None),
            &"/".parse().unwrap(),
            &HeaderMap::new()
        ));
    }
}
