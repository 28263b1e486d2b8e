//! Transmission: the reader that validates requests and hands each to the pipeline.

use std::sync::Arc;
use std::time::Duration;

use headroom_nbd as nbd;
use headroom_store::Volume;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, BufReader};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::block_status::BLOCK_STATUS_CHARGE_BYTES;
use super::job::{Answer, ClientJob, IoJob};
use super::negotiate::discard;
use super::reply::{is_stalled, read_exact_progressing, write_replies};
use super::split::{
    PieceFeeder, SPLIT_PIECES_IN_FLIGHT, SplitRequest, cache_work, needs_split, piece_bytes_of,
    pieces, submit_job,
};
use super::{ALLOCATION_CONTEXT_ID, Negotiated, SessionContext, SessionError};
use crate::admission::Admitted;
use crate::budget::Charge;
use crate::buffers::{BufferPool, PooledBuffer};
use crate::metrics::{MetricsRegistry, VolumeOp, VolumeStats};
use crate::scheduler::{Ready, Scheduler, VolumeHandle};

/// Permits a request holds until its reply has been written: a request slot, and for READ
/// and WRITE its buffer's bytes from the connection's and the node's budgets.
#[derive(Debug)]
pub(super) struct Permits {
    pub(super) _request: OwnedSemaphorePermit,
    pub(super) _bytes: Option<(OwnedSemaphorePermit, Charge)>,
}

pub(super) enum ReplyBody {
    Done,
    Error(nbd::Errno, &'static str),
    Data {
        offset: u64,
        data: PooledBuffer,
    },
    /// A READ of a range that is all hole: one `NBD_REPLY_TYPE_OFFSET_HOLE` chunk, no payload.
    Hole {
        offset: u64,
        len: u32,
    },
    BlockStatus {
        extents: Vec<(u32, u32)>,
    },
}

pub(super) struct Reply {
    pub(super) cookie: u64,
    pub(super) body: ReplyBody,
    pub(super) _permits: Permits,
}

type ReplySender = mpsc::UnboundedSender<Reply>;

/// Where a session's replies go, and what counts them: one `Arc` per request in flight.
#[derive(Debug)]
pub(super) struct ReplyPath {
    pub(super) tx: ReplySender,
    pub(super) stats: Arc<VolumeStats>,
    pub(super) metrics: Arc<MetricsRegistry>,
}

/// What the statistics need of a request when its reply is handed to the writer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tally {
    op: VolumeOp,
    /// Payload bytes (READ and WRITE).
    payload_bytes: u64,
    /// When its header was read (node clock).
    arrival_ns: u64,
}

impl Tally {
    pub(super) fn of(request: &nbd::ValidRequest, arrival_ns: u64) -> Option<Tally> {
        let op = VolumeOp::of(request.command)?;
        let payload_bytes = match op {
            VolumeOp::Read | VolumeOp::Write => u64::from(request.length),
            _ => 0,
        };
        Some(Tally {
            op,
            payload_bytes,
            arrival_ns,
        })
    }
}

impl ReplyPath {
    /// Hands a reply to the writer at `now_ns` and counts it (arrival to then).
    pub(super) fn send(&self, tally: Tally, reply: Reply, now_ns: u64) {
        let failed = matches!(reply.body, ReplyBody::Error(..));
        // Counted first, so a client that has its reply finds it counted.
        self.stats.complete(
            &self.metrics,
            tally.op,
            tally.payload_bytes,
            failed,
            tally.arrival_ns,
            now_ns,
        );
        // If the writer is gone the client is gone; dropping the reply releases its permits.
        let _ = self.tx.send(reply);
    }
}

/// Runs transmission on a connection's two halves: plain TCP halves (no lock between them) or
/// the halves of a TLS stream. Generic, so the plaintext path pays nothing for TLS.
pub(super) async fn transmit<R, W>(
    read_half: R,
    write_half: W,
    ctx: Arc<SessionContext>,
    negotiated: Negotiated,
    conn: &Admitted,
) -> Result<(), SessionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut reader = BufReader::with_capacity(128 << 10, read_half);
    let (reply_tx, reply_rx) = mpsc::unbounded_channel::<Reply>();
    let stall_ms = ctx.limits.client_stall_timeout_ms;
    let stall = Duration::from_millis(stall_ms);
    let writer = tokio::spawn(write_replies(
        write_half,
        reply_rx,
        negotiated.structured,
        Arc::clone(&ctx.io.buffers),
        stall,
    ));

    let max_requests = ctx.limits.max_inflight_requests_per_conn;
    let request_slots = Arc::new(Semaphore::new(max_requests));
    // `Limits::validate` keeps it below 4 GiB (semaphore permits are u32).
    let byte_budget = u32::try_from(ctx.limits.max_inflight_bytes_per_conn).unwrap_or(u32::MAX);
    let byte_slots = Arc::new(Semaphore::new(byte_budget as usize));
    conn.shared().set_slots(
        Arc::clone(&request_slots),
        max_requests,
        Arc::clone(&byte_slots),
        byte_budget as usize,
    );
    let volume = negotiated.volume;
    let account = ctx.budget.join(volume.tenant());
    let handle = ctx
        .scheduler
        .as_ref()
        .map(|scheduler| scheduler_handle(scheduler, &volume));
    let clock = ctx.io.clock;
    let path = Arc::new(ReplyPath {
        tx: reply_tx.clone(),
        stats: volume_stats(&ctx.metrics, &volume),
        metrics: Arc::clone(&ctx.metrics),
    });
    let mut last_end_bytes = u64::MAX / 2;
    let mut ready: Vec<Ready<IoJob>> = Vec::new();
    // Ends with the writer: when it gives up on a client that stopped reading, the reader
    // must not go on reading (and running) what the client keeps sending.
    let writer_gone = reply_tx.clone();

    let requests = async {
        loop {
            let mut header_buf = [0u8; nbd::REQUEST_HEADER_LEN];
            match reader.read_exact(&mut header_buf).await {
                Ok(_) => {}
                // A client that hangs up without NBD_CMD_DISC: nothing to answer.
                Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
                Err(err) => break Err(err.into()),
            }
            if reply_tx.is_closed() {
                break Ok(());
            }
            crate::coalesce::note_request();
            let header = match nbd::decode_request_header(&header_buf) {
                Ok(header) => header,
                Err(err) => break Err(err.into()),
            };
            let arrival_ns = clock.now_ns();
            let Ok(request_permit) = request_slots.clone().acquire_owned().await else {
                break Ok(());
            };
            let limits = nbd::ExportLimits {
                size_bytes: volume.size_bytes(),
                read_only: volume.read_only(),
                max_payload_bytes: ctx.limits.max_request_bytes,
                structured_replies: negotiated.structured,
                allocation_context_id: negotiated
                    .allocation_context
                    .then_some(ALLOCATION_CONTEXT_ID),
            };
            let request = match nbd::validate_request(&header, &limits) {
                Ok(request) => request,
                Err(rejection) => {
                    let permits = Permits {
                        _request: request_permit,
                        _bytes: None,
                    };
                    let fatal = rejection.is_fatal();
                    let payload = rejection.payload_bytes();
                    if payload > 0
                        && !fatal
                        && let Err(err) = discard(&mut reader, u64::from(payload)).await
                    {
                        break Err(err.into());
                    }
                    let reply = Reply {
                        cookie: header.cookie,
                        body: ReplyBody::Error(rejection.errno(), rejection.message()),
                        _permits: permits,
                    };
                    match VolumeOp::of_type(header.command) {
                        Some(op) => {
                            let tally = Tally {
                                op,
                                payload_bytes: 0,
                                arrival_ns,
                            };
                            path.stats.arrive(&ctx.metrics, arrival_ns, 0);
                            path.send(tally, reply, clock.now_ns());
                        }
                        None => {
                            let _ = reply_tx.send(reply);
                        }
                    }
                    if !fatal {
                        continue;
                    }
                    break Ok(());
                }
            };
            tracing::trace!(
                command = request.command.name(),
                offset = request.offset,
                length = request.length,
                "request"
            );
            let Some(tally) = Tally::of(&request, arrival_ns) else {
                // NBD_CMD_DISC.
                break Ok(());
            };
            // READ and WRITE are charged their buffer, BLOCK_STATUS the largest reply it may
            // build: first against this connection's budget (waiting for its own replies),
            // then against its reserve or its tenant's and the node's shared pool.
            let charged_len = match request.command {
                nbd::Command::Read | nbd::Command::Write => Some(request.length),
                nbd::Command::BlockStatus => Some(BLOCK_STATUS_CHARGE_BYTES),
                _ => None,
            };
            let bytes_permit = match charged_len {
                Some(charged_len) => {
                    let charge_bytes = BufferPool::charge_bytes(charged_len);
                    // At most the class of a 32 MiB request.
                    let permits = u32::try_from(charge_bytes).unwrap_or(u32::MAX);
                    let Ok(conn_permit) = byte_slots.clone().acquire_many_owned(permits).await
                    else {
                        break Ok(());
                    };
                    match account.charge(charge_bytes).await {
                        Ok(charge) => Some((conn_permit, charge)),
                        Err(err) => break Err(err.into()),
                    }
                }
                None => None,
            };
            let permits = Permits {
                _request: request_permit,
                _bytes: bytes_permit,
            };
            conn.shared().note_inflight();
            let mut write_payload = None;
            if matches!(request.command, nbd::Command::Write) {
                let payload = write_payload.insert(ctx.io.buffers.get(request.length as usize));
                // A payload cut short (or stalled): the write never happened and nobody is left to
                // answer.
                match read_exact_progressing(&mut reader, payload.as_mut_slice(), stall).await {
                    Ok(()) => {}
                    Err(err) if is_stalled(&err) => {
                        break Err(SessionError::PayloadStalled(stall_ms));
                    }
                    Err(err) => break Err(err.into()),
                }
            }
            // Counted as arrived (at its header's time) only now that nothing can stop it
            // from being answered: the audit must see every arrival leave.
            path.stats
                .arrive(&ctx.metrics, arrival_ns, tally.payload_bytes);
            let mut submit = |job: IoJob| {
                let io = job.desc();
                let scheduled = ctx.scheduler.as_ref().zip(handle.as_ref());
                let end = io.offset_bytes.saturating_add(u64::from(io.len_bytes));
                let sequential = scheduled.is_none()
                    && headroom_qos::model::is_sequential(last_end_bytes, io.offset_bytes);
                if scheduled.is_none() {
                    last_end_bytes = end;
                }
                submit_job(&ctx.io, scheduled, job, sequential, &mut ready);
            };
            let piece_bytes = piece_bytes_of(&request, ctx.limits.max_request_bytes);
            if needs_split(&request, piece_bytes) {
                // One reply for the request, sent when its last piece completes; each piece is
                // scheduled, charged and run as a request of its own, at most
                // `SPLIT_PIECES_IN_FLIGHT` at once (the rest are submitted as those complete).
                let pieces = match request.command {
                    nbd::Command::Cache => cache_work(&volume, pieces(&request, piece_bytes)),
                    _ => pieces(&request, piece_bytes),
                };
                let feeder = PieceFeeder {
                    volume: Arc::clone(&volume),
                    io: Arc::clone(&ctx.io),
                    scheduled: ctx.scheduler.clone().zip(handle.clone()),
                };
                let split =
                    SplitRequest::new(&request, pieces, permits, Arc::clone(&path), tally, feeder);
                for _ in 0..SPLIT_PIECES_IN_FLIGHT {
                    match split.next_piece() {
                        Some(job) => submit(job),
                        None => break,
                    }
                }
                continue;
            }
            // With structured replies, a READ of a hole is answered by a hole chunk instead of
            // zeros (as qemu-nbd does), unless the client asked for one data chunk (DF).
            let sparse_read = negotiated.structured && !request.df;
            submit(IoJob::Client(ClientJob {
                volume: Arc::clone(&volume),
                request,
                write_payload,
                sparse_read,
                answer: Answer::Whole {
                    permits,
                    reply: Arc::clone(&path),
                    tally,
                },
            }));
        }
    };
    let result = tokio::select! {
        result = requests => result,
        () = writer_gone.closed() => Ok(()),
    };
    drop(writer_gone);
    drop(reply_tx);
    drop(path);
    // Replies for everything already accepted are still delivered (NBD_CMD_DISC semantics).
    let written = match writer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) if is_stalled(&err) => Err(SessionError::RepliesStalled(stall_ms)),
        Ok(Err(err)) => {
            tracing::debug!("reply writer ended: {err}");
            Ok(())
        }
        Err(err) => {
            tracing::warn!("reply writer failed: {err}");
            Ok(())
        }
    };
    drop(account);
    result.and(written)
}

/// The volume's statistics, registering it with its stored QoS if they are new.
pub(super) fn volume_stats(metrics: &MetricsRegistry, volume: &Volume) -> Arc<VolumeStats> {
    if let Some(stats) = metrics.get(volume.id()) {
        return stats;
    }
    let qos = crate::volume_qos::effective_qos(volume.qos().as_deref(), volume.size_bytes());
    metrics.volume(volume.id(), volume.name(), &qos)
}

/// The scheduler's handle for a volume, registering it with no QoS if the scheduler has not
/// seen it (a volume created while the node starts).
fn scheduler_handle(scheduler: &Scheduler<IoJob>, volume: &Volume) -> Arc<VolumeHandle> {
    if let Some(handle) = scheduler.handle(volume.id()) {
        return handle;
    }
    let qos = crate::volume_qos::effective_qos(volume.qos().as_deref(), volume.size_bytes());
    scheduler.add_volume(volume.id(), &qos)
}
