//! A stream that counts what is read from it as it passes (the lane's byte counters show a
//! transfer while it runs, and one that ends in a reset still counts).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct Counted<S, C: Send + Sync + 'static> {
    inner: S,
    counters: Arc<C>,
    read: fn(&C) -> &AtomicU64,
}

impl<S, C: Send + Sync + 'static> Counted<S, C> {
    /// `inner`, whose reads add to `read(&counters)`.
    pub fn new(inner: S, counters: Arc<C>, read: fn(&C) -> &AtomicU64) -> Self {
        Counted {
            inner,
            counters,
            read,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin, C: Send + Sync + 'static> AsyncRead for Counted<S, C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let n = (buf.filled().len() - before) as u64;
            (self.read)(&self.counters).fetch_add(n, Ordering::Relaxed);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin, C: Send + Sync + 'static> AsyncWrite for Counted<S, C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
