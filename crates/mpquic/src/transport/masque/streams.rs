//! The QUIC streams of an HTTP/3 connection, read for its driver (the server's `serve.rs`, the
//! client's `dial.rs`): each stream by its own task, everything into one bounded inbox, so
//! the driver alone owns the connection's HTTP/3 state.

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

/// Bytes taken from a stream per read.
const READ_CHUNK: usize = 16 * 1024;
/// Reads waiting for the driver (each at most `READ_CHUNK`).
pub(super) const INBOX: usize = 32;

/// What the stream readers tell the driver.
pub(super) enum Input {
    /// A stream's first word: its send half (a request stream the peer opened) and how to
    /// stop reading it (dropping `stop` stops it too).
    Opened {
        id: u64,
        send: Option<quinn::SendStream>,
        stop: oneshot::Sender<u32>,
    },
    Data {
        id: u64,
        uni: bool,
        data: Bytes,
        fin: bool,
    },
    /// Reading failed: the peer reset the stream, or the connection is gone.
    Gone { id: u64 },
}

/// The peer's streams, each read by its own task into the driver's inbox.
pub(super) fn spawn_acceptors(conn: &quinn::Connection, inbox: mpsc::Sender<Input>) {
    let (c, tx) = (conn.clone(), inbox.clone());
    tokio::spawn(async move {
        while let Ok(recv) = c.accept_uni().await {
            tokio::spawn(read_stream(None, recv, true, tx.clone()));
        }
    });
    let c = conn.clone();
    tokio::spawn(async move {
        while let Ok((send, recv)) = c.accept_bi().await {
            tokio::spawn(read_stream(Some(send), recv, false, inbox.clone()));
        }
    });
}

/// Read one stream into the inbox until its end, a failure, or the driver stops it (or forgets
/// it: then the stream is dropped, which stops it too).
pub(super) async fn read_stream(
    send: Option<quinn::SendStream>,
    mut recv: quinn::RecvStream,
    uni: bool,
    inbox: mpsc::Sender<Input>,
) {
    let id = quinn::VarInt::from(recv.id()).into_inner();
    let (stop, mut stopped) = oneshot::channel();
    if inbox.send(Input::Opened { id, send, stop }).await.is_err() {
        return;
    }
    loop {
        tokio::select! {
            code = &mut stopped => {
                if let Ok(code) = code {
                    let _ = recv.stop(code.into());
                }
                return;
            }
            chunk = recv.read_chunk(READ_CHUNK, true) => {
                let input = match chunk {
                    Ok(Some(c)) => Input::Data { id, uni, data: c.bytes, fin: false },
                    Ok(None) => Input::Data { id, uni, data: Bytes::new(), fin: true },
                    // The connection's end is the drivers' to see (`conn.closed()`), with
                    // the peer's code: a stream read that fails with it is not a reset.
                    Err(quinn::ReadError::ConnectionLost(_)) => return,
                    Err(_) => Input::Gone { id },
                };
                let last = !matches!(input, Input::Data { fin: false, .. });
                if inbox.send(input).await.is_err() || last {
                    return;
                }
            }
        }
    }
}
