//! Kernel MPTCP sockets (IPPROTO_MPTCP) for the lane: a listener and a connector, each falling
//! back to plain TCP, with a warning once, on a kernel without MPTCP (`net.mptcp.enabled=0`
//! or not built in). Subflows are the kernel's: its path manager opens one from each endpoint
//! the client configures (`endpoints.rs`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::warn;

/// Said once per process: the lane runs over plain TCP (one path).
static FELL_BACK: AtomicBool = AtomicBool::new(false);

fn stream_socket(addr: SocketAddr) -> Result<Socket> {
    let domain = Domain::for_address(addr);
    match Socket::new(domain, Type::STREAM, Some(Protocol::MPTCP)) {
        Ok(s) => Ok(s),
        Err(e) => {
            if !FELL_BACK.swap(true, Ordering::Relaxed) {
                warn!(error = %e, "this kernel does not open MPTCP sockets (sysctl net.mptcp.enabled=1?): the lane runs over plain TCP, on one path");
            }
            Socket::new(domain, Type::STREAM, Some(Protocol::TCP)).context("TCP socket")
        }
    }
}

pub fn mptcp_listener(addr: SocketAddr) -> Result<TcpListener> {
    let s = stream_socket(addr)?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    s.bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    s.listen(1024)?;
    Ok(TcpListener::from_std(s.into())?)
}

/// An MPTCP connection to `to`; its first subflow leaves from `from` when given.
pub async fn mptcp_connect(to: SocketAddr, from: Option<SocketAddr>) -> Result<TcpStream> {
    let s = stream_socket(to)?;
    s.set_nonblocking(true)?;
    s.set_nodelay(true)?;
    if let Some(from) = from {
        s.bind(&from.into())
            .with_context(|| format!("binding {from}"))?;
    }
    let socket = TcpSocket::from_std_stream(s.into());
    socket
        .connect(to)
        .await
        .with_context(|| format!("connecting to the lane at {to}"))
}
