//! The reply side of a generator connection, shared by the closed loop (`closed_loop`) and
//! the many-tenant engine (`engine`): a task that reads simple replies as fast as they come
//! and hands each to the submitter with the time it arrived.
//!
//! Why a task of its own: the submitter must keep sending while replies arrive, in any order
//! (NBD lets the server answer out of order), and a reply's latency is only honest if it is
//! stamped when its bytes are read, not when the submitter gets round to it.

use std::time::Instant;

use headroom_nbd::consts::SIMPLE_REPLY_HEADER_LEN;
use headroom_nbd::decode_simple_reply_header;
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::mpsc;

use crate::client::LabError;

/// The low bit of every cookie both generators send: set for a READ, so the reader knows from
/// the reply alone that data follows.
pub(crate) const READ_BIT: u64 = 1;

/// A reply as the reader task saw it.
#[derive(Debug)]
pub(crate) struct Completion {
    pub cookie: u64,
    pub error: u32,
    pub at: Instant,
}

/// Reads simple replies until the connection ends or breaks, passing each (or the error that
/// ended the stream) on. A successful READ's reply (cookie with [`READ_BIT`], error 0) is
/// followed by its data, `read_len(cookie)` bytes (at most `max_bytes`; more is an unknown
/// cookie), which are read and dropped.
pub(crate) async fn read_replies(
    read_half: OwnedReadHalf,
    max_bytes: u32,
    tx: mpsc::Sender<Result<Completion, LabError>>,
    read_len: impl Fn(u64) -> usize,
) {
    let mut read = BufReader::with_capacity(256 * 1024, read_half);
    let mut data = vec![0u8; max_bytes as usize];
    loop {
        let reply = async {
            let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
            read.read_exact(&mut header)
                .await
                .map_err(LabError::io("reading a reply"))?;
            let reply = decode_simple_reply_header(&header)?;
            if reply.cookie & READ_BIT != 0 && reply.error == 0 {
                let Some(buf) = data.get_mut(..read_len(reply.cookie)) else {
                    return Err(LabError::UnknownCookie {
                        cookie: reply.cookie,
                    });
                };
                read.read_exact(buf)
                    .await
                    .map_err(LabError::io("reading READ data"))?;
            }
            Ok(Completion {
                cookie: reply.cookie,
                error: reply.error,
                at: Instant::now(),
            })
        }
        .await;
        let last = reply.is_err();
        if tx.send(reply).await.is_err() || last {
            return;
        }
    }
}
