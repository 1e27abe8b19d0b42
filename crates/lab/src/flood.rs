//! `mpquic-lab flood`: unauthenticated traffic at a server's UDP port, from spoofed sources,
//! bounded in rate, count and time, for the hardening benchmarks (docs/SECURITY.md). Run it
//! inside a lab namespace (`ip netns exec NS mpquic-lab flood ...`); it sends from a raw IP
//! socket, so every packet can carry another source address.
//!
//! Kinds: `initial`, genuine QUIC Initials each opening a new connection (made by a real QUIC
//! client, quinn-proto, with a classic key share so the whole ClientHello fits one datagram and
//! the server has the most work per packet), a pool of them sent round-robin; `garbage`,
//! random bytes of Initial size.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// What `run` sent.
#[derive(Debug, serde::Serialize)]
pub struct Sent {
    pub packets: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub send_errors: u64,
    pub pool: usize,
}

/// Distinct Initials in the pool (each a connection the server has not seen).
const POOL: usize = 4096;

pub fn run(
    to: SocketAddrV4,
    kind: &str,
    pps: u64,
    seconds: f64,
    sources: u32,
    first_source: Ipv4Addr,
) -> Result<Sent> {
    if pps == 0 || !(0.0..=600.0).contains(&seconds) || sources == 0 {
        bail!("--pps > 0, --seconds in 0..=600 and --sources > 0, please");
    }
    let pool = match kind {
        "initial" => initials(to, POOL)?,
        "garbage" => (0..POOL)
            .map(|i| (0..1200).map(|j| (i * 31 + j * 7) as u8).collect())
            .collect(),
        _ => bail!("--kind initial or garbage"),
    };
    // SAFETY: plain socket(2); the result is checked and owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("raw socket (root needed)");
    }
    // SAFETY: a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut sent = Sent {
        packets: 0,
        bytes: 0,
        seconds: 0.0,
        send_errors: 0,
        pool: pool.len(),
    };
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let gap = Duration::from_secs_f64(1.0 / pps as f64);
    let mut next = start;
    let mut frame = Vec::with_capacity(1600);
    let dst = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*to.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let mut n: u64 = 0;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(1)));
            continue;
        }
        // Behind schedule: catch up in a burst, at most a millisecond's worth.
        let burst = (((now - next).as_secs_f64() * pps as f64) as u64 + 1).min(pps / 1000 + 1);
        for _ in 0..burst {
            let payload = &pool[(n % pool.len() as u64) as usize];
            let src = Ipv4Addr::from(u32::from(first_source) + (n % u64::from(sources)) as u32);
            let sport = 1024 + (n % 60_000) as u16;
            udp4(&mut frame, src, sport, *to.ip(), to.port(), payload);
            // SAFETY: `frame` and `dst` are valid for the lengths given.
            let rc = unsafe {
                libc::sendto(
                    sock.as_raw_fd(),
                    frame.as_ptr().cast(),
                    frame.len(),
                    0,
                    (&dst as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            };
            if rc < 0 {
                sent.send_errors += 1;
            } else {
                sent.packets += 1;
                sent.bytes += frame.len() as u64;
            }
            n += 1;
        }
        next += gap * burst as u32;
    }
    sent.seconds = start.elapsed().as_secs_f64();
    Ok(sent)
}

/// An IPv4/UDP packet (UDP checksum 0: none, as IPv4 allows; the kernel fills the IP checksum).
fn udp4(out: &mut Vec<u8>, src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: &[u8]) {
    out.clear();
    let total = (20 + 8 + payload.len()) as u16;
    out.extend_from_slice(&[0x45, 0]);
    out.extend_from_slice(&total.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(&sport.to_be_bytes());
    out.extend_from_slice(&dport.to_be_bytes());
    out.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(payload);
}

/// `n` first datagrams of new QUIC connections to `to`, from a real client.
fn initials(to: SocketAddrV4, n: usize) -> Result<Vec<Vec<u8>>> {
    use quinn_proto::crypto::rustls::QuicClientConfig;
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    provider.kx_groups = vec![rustls::crypto::aws_lc_rs::kx_group::X25519];
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer))
        .with_no_client_auth();
    let mut tls = tls;
    tls.alpn_protocols = vec![b"mpquic/4".to_vec()];
    let client = quinn_proto::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    let mut ep = quinn_proto::Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        true,
        None,
    );
    let now = Instant::now();
    let mut out = Vec::with_capacity(n);
    let mut buf = Vec::with_capacity(4 * 1500);
    for _ in 0..n {
        let (_, mut conn) = ep
            .connect(now, client.clone(), to.into(), "mpquic-server")
            .context("quinn-proto connect")?;
        buf.clear();
        if let Some(t) = conn.poll_transmit(now, 1, &mut buf) {
            out.push(buf[..t.segment_size.unwrap_or(t.size).min(t.size)].to_vec());
        }
    }
    if out.is_empty() {
        bail!("quinn-proto made no Initial");
    }
    Ok(out)
}

/// The flood never completes a handshake, so it never looks at the server's certificate.
#[derive(Debug)]
struct AnyServer;

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.verify_tls13_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("not verified".into()))
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::aws_lc_rs::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}
