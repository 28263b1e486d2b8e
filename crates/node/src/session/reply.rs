//! The reply writer: encodes replies as they complete, batching what is ready.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use headroom_nbd as nbd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::{ALLOCATION_CONTEXT_ID, BATCH_BYTES_MAX, BATCH_REPLIES_MAX};
use crate::buffers::BufferPool;
use crate::pipeline::{Reply, ReplyBody};

/// Encodes replies as they complete, batching what is ready into one write.
///
/// A write that the socket accepts no byte of within `stall` fails with `TimedOut`: the client
/// stopped reading, and ending the session gives back everything its replies hold.
pub(super) async fn write_replies<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut replies: mpsc::UnboundedReceiver<Reply>,
    structured: bool,
    buffers: Arc<BufferPool>,
    stall: Duration,
) -> std::io::Result<()> {
    // Headers (and other small replies) are encoded into `out`; READ payloads stay in their
    // buffers. `segments` lists the batch in wire order, and one `writev` sends it all: no
    // payload is copied on its way out.
    let mut out: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut segments: Vec<Segment> = Vec::with_capacity(2 * BATCH_REPLIES_MAX);
    let mut batch: Vec<Reply> = Vec::with_capacity(BATCH_REPLIES_MAX);
    while let Some(first) = replies.recv().await {
        let mut next = Some(first);
        let mut head_start = 0;
        let mut payload_bytes = 0;
        while let Some(reply) = next.take() {
            if encode_reply(&mut out, &reply, structured) {
                segments.push(Segment::Head(head_start..out.len()));
                head_start = out.len();
                segments.push(Segment::Payload(batch.len()));
                payload_bytes += reply_payload(&reply).len();
            }
            batch.push(reply);
            if out.len() + payload_bytes < BATCH_BYTES_MAX && batch.len() < BATCH_REPLIES_MAX {
                next = replies.try_recv().ok();
            }
        }
        if head_start < out.len() {
            segments.push(Segment::Head(head_start..out.len()));
        }
        let mut slices: Vec<std::io::IoSlice<'_>> = segments
            .iter()
            .map(|segment| match segment {
                Segment::Head(range) => std::io::IoSlice::new(&out[range.clone()]),
                Segment::Payload(index) => std::io::IoSlice::new(reply_payload(&batch[*index])),
            })
            .collect();
        write_all_slices(&mut writer, &mut slices, stall).await?;
        drop(slices);
        out.clear();
        segments.clear();
        // Releases the permits of everything now on the wire, and recycles read buffers.
        for reply in batch.drain(..) {
            if let ReplyBody::Data { data, .. } = reply.body {
                buffers.put(data);
            }
        }
    }
    // Flushes, then ends the stream (TLS: close_notify first, as the spec asks).
    match tokio::time::timeout(stall, writer.shutdown()).await {
        Ok(done) => done,
        Err(_) => Err(Stalled::error()),
    }
}

/// The client moved no byte for the stall timeout (`Limits::client_stall_timeout_ms`).
#[derive(Debug, thiserror::Error)]
#[error("the client moved no byte in time")]
struct Stalled;

impl Stalled {
    fn error() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::TimedOut, Stalled)
    }
}

/// Runs one socket read or write that must make progress within `stall`. The stall timer is
/// armed only when the operation does not complete at its first poll: a timer's deadline is a
/// clock read, and the common case (the socket had the bytes, or room for them) needs none.
async fn within_stall<T>(
    stall: Duration,
    io: impl Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    let mut io = pin!(io);
    let first = std::future::poll_fn(|cx| match io.as_mut().poll(cx) {
        Poll::Ready(done) => Poll::Ready(Some(done)),
        Poll::Pending => Poll::Ready(None),
    })
    .await;
    if let Some(done) = first {
        return done;
    }
    match tokio::time::timeout(stall, io).await {
        Ok(done) => done,
        Err(_) => Err(Stalled::error()),
    }
}

pub(super) fn is_stalled(err: &std::io::Error) -> bool {
    err.get_ref().is_some_and(|inner| inner.is::<Stalled>())
}

/// Fills `buf`; each read must bring at least one byte within `stall`.
pub(super) async fn read_exact_progressing<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
    stall: Duration,
) -> std::io::Result<()> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..)
        && !rest.is_empty()
    {
        let n = within_stall(stall, reader.read(rest)).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
    }
    Ok(())
}

/// One piece of a batch of replies on the wire.
enum Segment {
    /// Bytes of the batch's encode buffer.
    Head(std::ops::Range<usize>),
    /// The payload of the batch's reply at this index.
    Payload(usize),
}

/// The payload bytes a reply carries after its header (READ data).
fn reply_payload(reply: &Reply) -> &[u8] {
    match &reply.body {
        ReplyBody::Data { data, .. } => data.as_slice(),
        _ => &[],
    }
}

/// Writes every slice, in order; each write must make progress within `stall`.
async fn write_all_slices<W: AsyncWrite + Unpin>(
    writer: &mut W,
    slices: &mut [std::io::IoSlice<'_>],
    stall: Duration,
) -> std::io::Result<()> {
    let mut slices = slices;
    std::io::IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = within_stall(stall, writer.write_vectored(slices)).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Appends a reply to `out`; returns whether its payload (`reply_payload`) must follow `out`
/// on the wire.
fn encode_reply(out: &mut Vec<u8>, reply: &Reply, structured: bool) -> bool {
    let cookie = reply.cookie;
    match (&reply.body, structured) {
        (ReplyBody::Done, false) => nbd::encode_simple_reply_header(out, cookie, 0),
        (ReplyBody::Done, true) => nbd::encode_structured_none_done(out, cookie),
        (ReplyBody::Error(errno, _), false) => {
            nbd::encode_simple_reply_header(out, cookie, *errno as u32);
        }
        (ReplyBody::Error(errno, message), true) => {
            nbd::encode_structured_error(out, true, cookie, *errno as u32, message);
        }
        (ReplyBody::Data { data, .. }, false) => {
            nbd::encode_simple_reply_header(out, cookie, 0);
            return !data.is_empty();
        }
        (ReplyBody::Data { offset, data }, true) => {
            if data.is_empty() {
                nbd::encode_structured_none_done(out, cookie);
                return false;
            }
            // Lengths were validated against the 32 MiB maximum, so they fit in 32 bits.
            let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
            nbd::encode_structured_offset_data_header(out, true, cookie, *offset, length);
            return true;
        }
        (ReplyBody::Hole { offset, len }, true) => {
            nbd::encode_structured_offset_hole(out, true, cookie, *offset, *len);
        }
        // Not produced without structured replies; answered correctly all the same.
        (ReplyBody::Hole { len, .. }, false) => {
            nbd::encode_simple_reply_header(out, cookie, 0);
            out.resize(out.len() + *len as usize, 0);
        }
        (ReplyBody::BlockStatus { extents }, _) => {
            nbd::encode_structured_block_status(out, true, cookie, ALLOCATION_CONTEXT_ID, extents);
        }
    }
    false
}
