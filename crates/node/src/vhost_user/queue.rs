//! One virtqueue's requests through the pipeline: a submitter task that takes each parsed
//! chain through the queue's `Intake` (a request slot, validation, the byte budget, the
//! payload copied out of guest memory, submission), and a completer task that writes each
//! reply back into guest memory, returns the chain used and signals the driver.
//!
//! Why two tasks, as NBD has a reader and a writer: a submitter waiting for a slot or for
//! budget waits for replies to be delivered, so the delivery must not wait behind it. Why a
//! queue is an `Intake` of its own: each queue is a stream of requests the driver keeps in
//! flight independently (a vCPU's blk-mq hardware queue), so each gets the slots and the
//! budget share a connection gets, and all of them meet at the same scheduler and the same
//! per-volume QoS as every NBD client of the volume.
//!
//! Every chain is returned used in the order it was popped, through the queue's
//! [`UsedOrder`] (why: `vhost_user::used_order`), whichever task answers it.

use std::sync::{Arc, Mutex};

use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_store::Volume;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, oneshot};
use vhost_user_backend::VringRwLock;
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap};

use super::queue_state::QueueCounters;
use super::request::{BlkRequest, Kind, Parsed, Segment};
use super::used_order::UsedOrder;
use super::wire::{ID_BYTES, Status};
use crate::buffers::BufferPool;
use crate::net_threads::NetThreads;
use crate::pipeline::{Intake, Pipeline, ReplyBody, ReplyReceiver, Submission};
use crate::sync::lock;

pub(super) type Mem = GuestMemoryAtomic<GuestMemoryMmap<()>>;
pub(super) type MemGuard = GuestMemoryLoadGuard<GuestMemoryMmap<()>>;
pub(super) type Vring = VringRwLock<Mem>;

/// A chain handed from the vring's event thread to its queue's submitter.
pub(super) struct Arrived {
    pub(super) parsed: Parsed,
    /// Its place in the queue's pop order ([`UsedOrder::popped`]).
    pub(super) seq: u64,
    /// The guest memory the chain was read against (kept mapped until it is used).
    pub(super) mem: MemGuard,
    pub(super) vring: Vring,
}

impl std::fmt::Debug for Arrived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arrived")
            .field("parsed", &self.parsed)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

fn write_status(mem: &MemGuard, addr: GuestAddress, status: Status) {
    // The address was checked against this memory when the chain was parsed.
    let _ = mem.write_slice(&[status.byte()], addr);
}

/// A request in the pipeline, as the completer needs it.
struct Pending {
    seq: u64,
    head: u16,
    mem: MemGuard,
    vring: Vring,
    read_into: Vec<Segment>,
    status_addr: GuestAddress,
    /// The status to answer with whatever the reply (a chain the parser refused).
    refusal: Option<Status>,
}

type PendingMap = Arc<Mutex<FxHashMap<u64, Pending>>>;

/// What a queue's tasks share.
#[derive(Debug)]
pub(super) struct QueueContext {
    pub(super) pipeline: Arc<Pipeline>,
    pub(super) volume: Arc<Volume>,
    pub(super) order: Arc<UsedOrder>,
    /// Its kicks and signals (`vhost_user::queue_state`); every signal goes through it.
    pub(super) counters: Arc<QueueCounters>,
    /// GET_ID's answer (the volume's name, cut or NUL-padded to 20 bytes).
    pub(super) id: [u8; ID_BYTES],
}

/// Says when a queue's tasks have ended: resolves (with an error, nothing is ever sent) once
/// the task holding its sender is gone, finished or dropped with its thread.
pub(super) type QueueEnded = oneshot::Receiver<()>;

/// Starts a queue's submitter and completer, together on one of `threads` (the node's
/// connection threads, picked as a connection's is) or, without them, on the node's runtime;
/// they end once `arrivals` is closed or `close` fires (or its sender is dropped), and every
/// reply of what was submitted has been delivered. What is returned resolves when they have:
/// the accepting thread waits for it, so nothing of the queue (its volume, the pipeline, the
/// store under them) outlives the attachment's stop.
///
/// Why on a connection thread: the submitter hands each reply to the completer, and on the
/// shared multi-thread runtime the two land on different workers, so every batch of replies
/// is a cross-thread wake-up (a futex and, on a VM, an interrupt), as it was for NBD's reader
/// and writer before connections owned a thread (`crate::net_threads`); on one thread it is a
/// push on a local queue.
pub(super) fn start(
    context: QueueContext,
    arrivals: mpsc::UnboundedReceiver<Arrived>,
    close: oneshot::Receiver<()>,
    threads: Option<&Arc<NetThreads>>,
) -> QueueEnded {
    let (ended_tx, ended) = oneshot::channel::<()>();
    let runtime = context.pipeline.io.runtime.clone();
    let run = move || async move {
        let _ended = ended_tx;
        run_queue(context, arrivals, close).await;
    };
    match threads {
        Some(threads) => {
            // A thread that ended (its runtime panicked) drops the job, and with it the
            // sender: the queue is seen ended, its chains unanswered, as a crash leaves them.
            if threads.spawn(run).is_none() {
                tracing::error!("vhost-user-blk: no connection thread took a queue");
            }
        }
        None => drop(runtime.spawn(run())),
    }
    ended
}

/// The submitter and the completer of one queue, on the task that runs this.
async fn run_queue(
    context: QueueContext,
    arrivals: mpsc::UnboundedReceiver<Arrived>,
    close: oneshot::Receiver<()>,
) {
    let (intake, replies) = Intake::open(&context.pipeline, Arc::clone(&context.volume), None);
    let pending: PendingMap = Arc::default();
    let buffers = Arc::clone(&context.pipeline.io.buffers);
    let completer = tokio::spawn(complete_replies(
        replies,
        Arc::clone(&pending),
        Arc::clone(&context.order),
        Arc::clone(&context.counters),
        buffers,
    ));
    let intake = submit_arrivals(context, intake, arrivals, close, pending).await;
    let account = intake.close();
    let _ = completer.await;
    drop(account);
}

/// The NBD request a virtio-blk one is.
fn header(request: &BlkRequest, cookie: u64) -> nbd::RequestHeader {
    let (command, flags) = match request.kind {
        Kind::Read => (consts::NBD_CMD_READ, 0),
        Kind::Write => (consts::NBD_CMD_WRITE, 0),
        Kind::Flush => (consts::NBD_CMD_FLUSH, 0),
        Kind::Discard => (consts::NBD_CMD_TRIM, 0),
        Kind::WriteZeroes { unmap: true } => (consts::NBD_CMD_WRITE_ZEROES, 0),
        Kind::WriteZeroes { unmap: false } => {
            (consts::NBD_CMD_WRITE_ZEROES, consts::NBD_CMD_FLAG_NO_HOLE)
        }
        // Answered by the transport itself; never turned into a header.
        Kind::GetId => (consts::NBD_CMD_FLUSH, 0),
    };
    nbd::RequestHeader {
        flags,
        command,
        cookie,
        offset: request.offset_bytes,
        length: request.length_bytes,
    }
}

/// Copies a WRITE's data out of guest memory; `false` if any of it could not be read.
fn gather(mem: &MemGuard, segments: &[Segment], into: &mut [u8]) -> bool {
    let mut at = 0usize;
    for seg in segments {
        let end = at + seg.len as usize;
        let Some(dst) = into.get_mut(at..end) else {
            return false;
        };
        if mem.read_slice(dst, seg.addr).is_err() {
            return false;
        }
        at = end;
    }
    at == into.len()
}

/// Writes `data` into the segments in order; `false` if any of it could not be written.
fn scatter(mem: &MemGuard, segments: &[Segment], data: &[u8]) -> bool {
    let mut at = 0usize;
    for seg in segments {
        let end = (at + seg.len as usize).min(data.len());
        let Some(src) = data.get(at..end) else {
            return false;
        };
        if mem.write_slice(src, seg.addr).is_err() {
            return false;
        }
        at = end;
    }
    at == data.len()
}

/// Answers IOERR at once for a request that cannot go on.
fn fail_now(mem: &MemGuard, vring: &Vring, context: &QueueContext, seq: u64, request: &BlkRequest) {
    write_status(mem, request.status, Status::IoErr);
    if context.order.finish(vring, seq, request.head, 1) {
        context.counters.notify(vring);
    }
}

/// GET_ID: the transport's own request, answered at once (the volume's name).
fn answer_get_id(arrived: &Arrived, request: &BlkRequest, context: &QueueContext) {
    let room = request.length_bytes as usize;
    let ok = scatter(&arrived.mem, &request.data, &context.id[..room]);
    let status = if ok { Status::Ok } else { Status::IoErr };
    write_status(&arrived.mem, request.status, status);
    if context.order.finish(
        &arrived.vring,
        arrived.seq,
        request.head,
        request.length_bytes + 1,
    ) {
        context.counters.notify(&arrived.vring);
    }
}

/// What the submitter goes on with, for a chain not answered at once.
enum Next {
    Run(BlkRequest),
    /// A refused chain: its head, where its status goes, the status and why.
    Refuse(u16, GuestAddress, Status, &'static str),
}

/// What the submitter does with a chain: `None` when it is answered here and now (GET_ID, a
/// chain with no status byte).
fn triage(arrived: &Arrived, context: &QueueContext) -> Option<Next> {
    match &arrived.parsed {
        Parsed::Request(request) if request.kind == Kind::GetId => {
            answer_get_id(arrived, request, context);
            None
        }
        Parsed::Request(request) => Some(Next::Run(request.clone())),
        Parsed::Refused {
            head,
            status_addr,
            status,
            why,
        } => {
            tracing::debug!("vhost-user-blk: descriptor {head} refused: {why}");
            Some(Next::Refuse(*head, *status_addr, *status, why))
        }
        Parsed::Unanswerable { head, .. } => {
            // Used with nothing written: there is no status byte to write.
            if context.order.finish(&arrived.vring, arrived.seq, *head, 0) {
                context.counters.notify(&arrived.vring);
            }
            None
        }
    }
}

async fn submit_arrivals(
    context: QueueContext,
    mut intake: Intake,
    mut arrivals: mpsc::UnboundedReceiver<Arrived>,
    mut close: oneshot::Receiver<()>,
    pending: PendingMap,
) -> Intake {
    let limits = nbd::ExportLimits {
        size_bytes: context.volume.size_bytes(),
        read_only: context.volume.read_only(),
        max_payload_bytes: context.pipeline.limits.max_request_bytes,
        structured_replies: true,
        allocation_context_id: None,
    };
    let mut next_cookie: u64 = 1;
    loop {
        // The chains one kick brought go to the scheduler together (`Intake::hold`): before
        // this task may wait, for a chain, a slot or budget, what is held is submitted.
        if arrivals.is_empty() {
            intake.flush();
        }
        let arrived = tokio::select! {
            biased;
            _ = &mut close => break,
            arrived = arrivals.recv() => match arrived {
                Some(arrived) => arrived,
                None => break,
            },
        };
        let arrival_ns = intake.now_ns();
        let Some(next) = triage(&arrived, &context) else {
            continue;
        };
        let Some(slot) = intake.request_slot_flushing().await else {
            break;
        };
        let cookie = next_cookie;
        next_cookie += 1;
        let Arrived {
            mem, vring, seq, ..
        } = arrived;
        let request = match next {
            Next::Run(request) => request,
            Next::Refuse(head, status_addr, status, why) => {
                lock(&pending).insert(
                    cookie,
                    Pending {
                        seq,
                        head,
                        mem,
                        vring,
                        read_into: Vec::new(),
                        status_addr,
                        refusal: Some(status),
                    },
                );
                // Not a request of any NBD kind: answered, not counted as one.
                intake.refuse(cookie, u16::MAX, (nbd::Errno::Eio, why), slot, arrival_ns);
                continue;
            }
        };
        let nbd_header = header(&request, cookie);
        let pending_of = |mem, vring| Pending {
            seq,
            head: request.head,
            mem,
            vring,
            read_into: if request.kind == Kind::Read {
                request.data.clone()
            } else {
                Vec::new()
            },
            status_addr: request.status,
            refusal: None,
        };
        let valid = match nbd::validate_request(&nbd_header, &limits) {
            Ok(valid) => valid,
            Err(rejection) => {
                lock(&pending).insert(cookie, pending_of(mem, vring));
                let answer = (rejection.errno(), rejection.message());
                intake.refuse(cookie, nbd_header.command, answer, slot, arrival_ns);
                continue;
            }
        };
        let permits = match intake.charge_flushing(&valid, slot).await {
            Ok(Some(permits)) => permits,
            Ok(None) => break,
            Err(err) => {
                tracing::warn!("vhost-user-blk: {err}");
                fail_now(&mem, &vring, &context, seq, &request);
                continue;
            }
        };
        let write_payload = match request.kind {
            Kind::Write => {
                let mut buffer = intake.payload_buffer(valid.length);
                if !gather(&mem, &request.data, buffer.as_mut_slice()) {
                    drop(permits);
                    fail_now(&mem, &vring, &context, seq, &request);
                    continue;
                }
                Some(buffer)
            }
            _ => None,
        };
        lock(&pending).insert(cookie, pending_of(mem, vring));
        intake.hold(Submission {
            request: valid,
            permits,
            write_payload,
            // Every READ comes back as data: guest memory has no holes to leave.
            sparse_read: false,
            arrival_ns,
        });
    }
    intake.flush();
    intake
}

/// Delivers replies in completion order: data and status into guest memory, the chain used,
/// one signal per batch of replies ready together.
async fn complete_replies(
    mut replies: ReplyReceiver,
    pending: PendingMap,
    order: Arc<UsedOrder>,
    counters: Arc<QueueCounters>,
    buffers: Arc<BufferPool>,
) {
    let mut batch = Vec::new();
    while let Some(first) = replies.recv().await {
        batch.push(first);
        while let Ok(more) = replies.try_recv() {
            batch.push(more);
        }
        // One queue's replies: all of them return chains of the same vring.
        let mut signal: Option<Vring> = None;
        for reply in batch.drain(..) {
            let Some(request) = lock(&pending).remove(&reply.cookie) else {
                continue;
            };
            let (status, written) = match (&reply.body, request.refusal) {
                (_, Some(status)) => (status, 0),
                (ReplyBody::Done, None) => (Status::Ok, 0),
                (ReplyBody::Data { data, .. }, None) => {
                    if scatter(&request.mem, &request.read_into, data.as_slice()) {
                        (Status::Ok, data.as_slice().len() as u32)
                    } else {
                        (Status::IoErr, 0)
                    }
                }
                (ReplyBody::Error(errno, message), None) => {
                    tracing::debug!("vhost-user-blk: request failed: {errno:?}: {message}");
                    (Status::IoErr, 0)
                }
                // Not asked for: every READ is submitted without sparse replies, and
                // BLOCK_STATUS is not a virtio-blk request.
                (ReplyBody::Hole { .. } | ReplyBody::BlockStatus { .. }, None) => {
                    (Status::IoErr, 0)
                }
            };
            write_status(&request.mem, request.status_addr, status);
            let returned = order.finish(&request.vring, request.seq, request.head, written + 1);
            if let ReplyBody::Data { data, .. } = reply.body {
                buffers.put(data);
            }
            if returned {
                signal = Some(request.vring);
            }
            // Dropping the rest of the reply (its permits) is delivery.
        }
        if let Some(vring) = &signal {
            counters.notify(vring);
        }
    }
}
