//! An in-memory network for tests: UDP sockets that quinn drives like real ones (through its
//! `AsyncUdpSocket` seam), TUN devices whose other side is the test (a "host"), and a switch per
//! address to black-hole it. Whole clients and servers run in one process on it, without root,
//! with the real QUIC, TLS, hello, health and bonding code.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use anyhow::{anyhow, Result};
use quinn::udp::{RecvMeta, Transmit};
use tokio::sync::{mpsc, watch};

use mpquic_core::classify::Prefix;

use crate::config::Bind;
use crate::io::batch::PacketBatch;
use crate::io::platform::{Machine, OnHangup, Platform};
use crate::io::tun::{Device, ReadDrops, ReadScratch, Tun, VNET};

/// Datagrams a socket may hold unread; more are dropped, as a full socket buffer would.
const SOCKET_QUEUE: usize = 4096;
/// Packets a TUN device may hold in each direction.
const TUN_QUEUE: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Inbox {
    /// (source, destination as addressed, payload).
    queue: VecDeque<(SocketAddr, SocketAddr, Vec<u8>)>,
    waker: Option<Waker>,
}

#[derive(Default)]
struct State {
    sockets: HashMap<SocketAddr, Arc<Mutex<Inbox>>>,
    blackholed: HashSet<IpAddr>,
    next_port: u16,
    /// TUN devices not yet opened by an instance, by name.
    tuns: HashMap<String, MemTun>,
}

pub struct Network {
    state: Mutex<State>,
    stop: watch::Sender<bool>,
}

impl Network {
    pub fn new() -> Arc<Network> {
        Arc::new(Network {
            state: Mutex::new(State {
                next_port: 40_000,
                ..Default::default()
            }),
            stop: watch::channel(false).0,
        })
    }

    /// Drop every datagram from or to `ip` (a path's address) while `on`.
    pub fn blackhole(&self, ip: IpAddr, on: bool) {
        let mut s = lock(&self.state);
        if on {
            s.blackholed.insert(ip);
        } else {
            s.blackholed.remove(&ip);
        }
    }

    /// Tell every instance on this network to stop.
    pub fn stop(&self) {
        self.stop.send_replace(true);
    }

    pub async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// The host side of the TUN device `name` (created here; the instance opens the device).
    pub fn host(&self, name: &str) -> Host {
        let (to_dev, from_host) = mpsc::channel(TUN_QUEUE);
        let (to_host, from_dev) = mpsc::channel(TUN_QUEUE);
        let address = Arc::new(Mutex::new(None));
        lock(&self.state).tuns.insert(
            name.to_string(),
            MemTun {
                from_host: Mutex::new(from_host),
                ready: Mutex::new(None),
                to_host,
                address: address.clone(),
            },
        );
        Host {
            to_dev,
            from_dev,
            address,
        }
    }

    /// The machine of instances on this network (`Platform`).
    pub fn platform(self: &Arc<Self>) -> Platform {
        Platform::new(Arc::new(Memory(self.clone())))
    }

    pub fn tun(&self, name: &str) -> io::Result<Tun> {
        let dev = lock(&self.state).tuns.remove(name).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no memory host for TUN {name}"),
            )
        })?;
        Ok(Tun::new(name, Box::new(dev)))
    }

    /// A socket at `addr` (port 0: the next free one).
    pub fn bind(self: &Arc<Self>, addr: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let mut s = lock(&self.state);
        let mut addr = addr;
        if addr.port() == 0 {
            addr.set_port(s.next_port);
            s.next_port = s.next_port.wrapping_add(1).max(40_000);
        }
        if s.sockets.contains_key(&addr) {
            return Err(anyhow!("memory network: {addr} is in use"));
        }
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        s.sockets.insert(addr, inbox.clone());
        Ok(Arc::new(Socket {
            net: self.clone(),
            addr,
            inbox,
        }))
    }

    /// A client path's socket: `bind_ip` gives its address (each path its own, so that one can
    /// be black-holed); "any" is 127.0.0.1.
    pub fn bind_client(self: &Arc<Self>, bind: &Bind) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        let ip = match bind {
            Bind::Ip(ip) => *ip,
            Bind::Any => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Bind::Interface(name) => return Err(anyhow!("memory network: no interface {name}")),
        };
        self.bind(SocketAddr::new(ip, 0))
    }

    fn deliver(&self, from: SocketAddr, to: SocketAddr, data: &[u8]) {
        let s = lock(&self.state);
        if s.blackholed.contains(&from.ip()) || s.blackholed.contains(&to.ip()) {
            return;
        }
        // A server bound to 0.0.0.0:port receives for any address.
        let unspecified = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), to.port());
        let Some(inbox) = s.sockets.get(&to).or_else(|| s.sockets.get(&unspecified)) else {
            return;
        };
        let mut inbox = lock(inbox);
        if inbox.queue.len() < SOCKET_QUEUE {
            inbox.queue.push_back((from, to, data.to_vec()));
            if let Some(w) = inbox.waker.take() {
                w.wake();
            }
        }
    }
}

/// The machine of instances on a memory network: its TUN devices have one queue whatever is
/// asked, its links the default MTU; SIGHUP is not listened for (tests reload through the
/// control socket), and the instance stops when the test calls `Network::stop`.
struct Memory(Arc<Network>);

impl Machine for Memory {
    fn tun(&self, name: &str, _offload: bool, _queues: usize) -> io::Result<Vec<Tun>> {
        Ok(vec![self.0.tun(name)?])
    }

    fn server_socket(&self, listen: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        self.0.bind(listen)
    }

    fn client_socket(&self, bind: &Bind, _: SocketAddr) -> Result<Arc<dyn quinn::AsyncUdpSocket>> {
        self.0.bind_client(bind)
    }

    fn link_mtu(&self, _: &Bind) -> u32 {
        crate::io::socket::DEFAULT_LINK_MTU
    }

    fn on_hangup(&self, _: OnHangup) -> io::Result<()> {
        Ok(())
    }

    fn stopped(&self) -> Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.0.stopped())
    }
}

/// The test's side of a memory TUN device.
pub struct Host {
    /// Packets into the device (as if the host routed them into the tunnel).
    pub to_dev: mpsc::Sender<Vec<u8>>,
    /// Packets the instance wrote to the device.
    pub from_dev: mpsc::Receiver<Vec<u8>>,
    address: Arc<Mutex<Option<(Ipv4Addr, u8)>>>,
}

impl Host {
    /// The address the instance gave the device, once it has.
    pub fn address(&self) -> Option<(Ipv4Addr, u8)> {
        *lock(&self.address)
    }
}

/// The instance's side of a memory TUN device.
pub struct MemTun {
    from_host: Mutex<mpsc::Receiver<Vec<u8>>>,
    /// A packet `poll_readable` took off the queue to learn that one was there; read first.
    ready: Mutex<Option<Vec<u8>>>,
    to_host: mpsc::Sender<Vec<u8>>,
    address: Arc<Mutex<Option<(Ipv4Addr, u8)>>>,
}

/// Like a kernel TUN device without offloads: reads and writes of one packet, never waiting;
/// the settings only remember the IPv4 address (for the test's `Host::address`).
impl Device for MemTun {
    fn offload(&self) -> bool {
        false
    }

    fn udp_offload(&self) -> bool {
        false
    }

    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut ready = lock(&self.ready);
        if ready.is_some() {
            return Poll::Ready(Ok(()));
        }
        match lock(&self.from_host).poll_recv(cx) {
            Poll::Ready(Some(p)) => {
                *ready = Some(p);
                Poll::Ready(Ok(()))
            }
            // The host is gone: nothing will ever arrive.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }

    fn try_read(
        &self,
        batch: &mut PacketBatch,
        _: &mut ReadScratch,
        mtu: usize,
        drops: &mut ReadDrops,
    ) -> io::Result<bool> {
        let p = match lock(&self.ready).take() {
            Some(p) => p,
            None => match lock(&self.from_host).try_recv() {
                Ok(p) => p,
                Err(_) => return Ok(false),
            },
        };
        if p.len() > mtu {
            drops.oversized += 1;
        } else {
            batch.push(&p);
        }
        Ok(true)
    }

    /// A full queue is EAGAIN, as a TUN write would be.
    fn write(&self, w: &[u8]) -> io::Result<usize> {
        let pkt = &w[VNET..];
        self.to_host
            .try_send(pkt.to_vec())
            .map(|_| pkt.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::EAGAIN))
    }

    fn disable_ipv6(&self) {}

    fn set_mtu(&self, _: u32) -> io::Result<()> {
        Ok(())
    }

    fn set_ipv4(&self, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        *lock(&self.address) = Some((addr, prefix));
        Ok(())
    }

    fn set_ipv6(&self, _: Ipv6Addr, _: u8) -> io::Result<()> {
        Ok(())
    }

    fn add_route(&self, _: &Prefix) -> io::Result<()> {
        Ok(())
    }

    fn del_route(&self, _: &Prefix) -> io::Result<()> {
        Ok(())
    }
}

struct Socket {
    net: Arc<Network>,
    addr: SocketAddr,
    inbox: Arc<Mutex<Inbox>>,
}

impl fmt::Debug for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "memnet::Socket({})", self.addr)
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        lock(&self.net.state).sockets.remove(&self.addr);
    }
}

/// Memory sockets are always writable.
#[derive(Debug)]
struct Writable;

impl quinn::UdpPoller for Writable {
    fn poll_writable(self: Pin<&mut Self>, _: &mut Context) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl quinn::AsyncUdpSocket for Socket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        Box::pin(Writable)
    }

    fn try_send(&self, t: &Transmit) -> io::Result<()> {
        // A socket bound to 0.0.0.0 answers from the address it was reached at (quinn passes
        // it back as `src_ip`), as the kernel does.
        let from = SocketAddr::new(t.src_ip.unwrap_or(self.addr.ip()), self.addr.port());
        let seg = t.segment_size.unwrap_or(t.contents.len()).max(1);
        for d in t.contents.chunks(seg) {
            self.net.deliver(from, t.destination, d);
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut inbox = lock(&self.inbox);
        let mut n = 0;
        while n < bufs.len().min(meta.len()) {
            let Some((from, to, data)) = inbox.queue.pop_front() else {
                break;
            };
            let len = data.len().min(bufs[n].len());
            bufs[n][..len].copy_from_slice(&data[..len]);
            meta[n] = RecvMeta {
                addr: from,
                len,
                stride: len,
                ecn: None,
                dst_ip: Some(to.ip()),
            };
            n += 1;
        }
        if n > 0 {
            return Poll::Ready(Ok(n));
        }
        inbox.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }
}
