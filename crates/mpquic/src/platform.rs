//! What the process shells take from the machine: a TUN device, UDP sockets for the paths and
//! the listener, link MTUs, and the signal to stop. `Platform::system()` is the real machine;
//! in tests, `Platform::memory(net)` puts whole clients and servers in one process on an
//! in-memory network (`crate::memnet`) without root, with the real QUIC, TLS and hello on top.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Result;

use crate::config::Bind;
use crate::quic;
use crate::tun::Tun;

#[derive(Clone)]
pub struct Platform {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    System,
    #[cfg(test)]
    Memory(Arc<crate::memnet::Network>),
}

impl Platform {
    pub fn system() -> Platform {
        Platform { kind: Kind::System }
    }

    #[cfg(test)]
    pub fn memory(net: Arc<crate::memnet::Network>) -> Platform {
        Platform {
            kind: Kind::Memory(net),
        }
    }

    /// The TUN device `name` as `queues` queues (`Tun::create`); the memory network's devices
    /// have one queue whatever is asked.
    pub fn tun(&self, name: &str, offload: bool, queues: usize) -> std::io::Result<Vec<Tun>> {
        match &self.kind {
            Kind::System => Tun::create(name, offload, queues),
            #[cfg(test)]
            Kind::Memory(net) => Ok(vec![net.tun(name)?]),
        }
    }

    /// The server's listening socket.
    pub fn server_socket(&self, listen: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        match &self.kind {
            Kind::System => Ok(quinn::Runtime::wrap_udp_socket(
                &quinn::TokioRuntime,
                quic::server_socket(listen)?,
            )?),
            #[cfg(test)]
            Kind::Memory(net) => net.bind(listen),
        }
    }

    /// A client path's socket, bound as `bind` says, for talking to `remote`.
    pub fn client_socket(
        &self,
        bind: &Bind,
        remote: SocketAddr,
    ) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        match &self.kind {
            Kind::System => Ok(quinn::Runtime::wrap_udp_socket(
                &quinn::TokioRuntime,
                quic::client_socket(bind, remote)?,
            )?),
            #[cfg(test)]
            Kind::Memory(net) => net.bind_client(bind),
        }
    }

    /// MTU of the link a path uses, for deriving the TUN MTU.
    pub fn link_mtu(&self, bind: &Bind) -> u32 {
        match &self.kind {
            Kind::System => quic::link_mtu(bind),
            #[cfg(test)]
            Kind::Memory(_) => quic::DEFAULT_LINK_MTU,
        }
    }

    /// SIGHUP asks `trigger` for a reload (`control/reload.rs`); the memory network's instances are
    /// reloaded by their tests.
    pub fn on_hangup(&self, trigger: crate::control::reload::Trigger) -> std::io::Result<()> {
        match &self.kind {
            Kind::System => crate::control::reload::on_hangup(trigger),
            #[cfg(test)]
            Kind::Memory(_) => Ok(()),
        }
    }

    /// Resolves when the instance must stop: SIGTERM or SIGINT, or the test's stop.
    pub async fn stopped(&self) {
        match &self.kind {
            Kind::System => shutdown_signal().await,
            #[cfg(test)]
            Kind::Memory(net) => net.stopped().await,
        }
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
