//! What the process shells take from the machine (`Machine`): a TUN device, UDP sockets for the
//! paths and the listener, link MTUs, SIGHUP and the signal to stop. `Platform::system()` is the
//! real machine; tests give the in-memory network's (`memnet::Network::platform`), which puts
//! whole clients and servers in one process without root, with the real QUIC, TLS and hello on
//! top.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::Result;

use crate::config::Bind;
use crate::io::{interface, kernel_tun, socket, tun::Tun};

/// What SIGHUP does (`Machine::on_hangup`).
pub type OnHangup = Box<dyn Fn() + Send + Sync>;

/// The machine an instance runs on.
pub trait Machine: Send + Sync {
    /// The TUN device `name` as `queues` queues (fewer where the device has fewer).
    fn tun(&self, name: &str, offload: bool, queues: usize) -> std::io::Result<Vec<Tun>>;
    /// The server's listening socket.
    fn server_socket(&self, listen: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>>;
    /// A client path's socket, bound as `bind` says, for talking to `remote`.
    fn client_socket(
        &self,
        bind: &Bind,
        remote: SocketAddr,
    ) -> Result<Arc<dyn quinn::AsyncUdpSocket>>;
    /// MTU of the link a path uses, for deriving the TUN MTU.
    fn link_mtu(&self, bind: &Bind) -> u32;
    /// What SIGHUP does from now on, for the life of the process (`then`: the shells ask for a
    /// reload; without a handler SIGHUP would end the process).
    fn on_hangup(&self, then: OnHangup) -> std::io::Result<()>;
    /// Resolves when the instance must stop.
    fn stopped(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// The machine an instance runs on, shared by its parts.
#[derive(Clone)]
pub struct Platform(Arc<dyn Machine>);

impl Platform {
    pub fn system() -> Platform {
        Platform(Arc::new(System))
    }

    pub fn new(machine: Arc<dyn Machine>) -> Platform {
        Platform(machine)
    }
}

impl std::ops::Deref for Platform {
    type Target = dyn Machine + 'static;

    fn deref(&self) -> &(dyn Machine + 'static) {
        self.0.as_ref()
    }
}

/// The real machine: the kernel's TUN device and UDP sockets, signals.
struct System;

impl Machine for System {
    fn tun(&self, name: &str, offload: bool, queues: usize) -> std::io::Result<Vec<Tun>> {
        kernel_tun::open(name, offload, queues)
    }

    fn server_socket(&self, listen: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        Ok(quinn::Runtime::wrap_udp_socket(
            &quinn::TokioRuntime,
            socket::server_socket(listen)?,
        )?)
    }

    fn client_socket(
        &self,
        bind: &Bind,
        remote: SocketAddr,
    ) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        Ok(quinn::Runtime::wrap_udp_socket(
            &quinn::TokioRuntime,
            socket::client_socket(bind, remote)?,
        )?)
    }

    fn link_mtu(&self, bind: &Bind) -> u32 {
        match bind {
            Bind::Interface(name) => interface::mtu(name).unwrap_or(socket::DEFAULT_LINK_MTU),
            _ => socket::DEFAULT_LINK_MTU,
        }
    }

    fn on_hangup(&self, then: OnHangup) -> std::io::Result<()> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup())?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP: reloading the configuration");
                then();
            }
        });
        Ok(())
    }

    fn stopped(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(shutdown_signal())
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
