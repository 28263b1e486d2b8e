//! The pipeline's door for a transport: one `Intake` per attached client (an NBD connection in
//! transmission, an in-memory session), which takes each validated request's permits, counts
//! it, splits it if it must be split, and submits it to the scheduler or runs it. Its replies
//! come back, in completion order, on the receiver `Intake::open` returns.
//!
//! What a transport does with a request, whatever its wire:
//! 1. [`Intake::request_slot`]: one of the client's request slots (waits while they are all
//!    taken: the transport stops reading, and its client is pushed back);
//! 2. a request the transport could not validate is answered with [`Intake::refuse`]; a valid
//!    one takes its bytes with [`Intake::charge`] (the client's own budget, then its reserve or
//!    its tenant's share of the node's, `node::budget`);
//! 3. a WRITE's payload goes into [`Intake::payload_buffer`];
//! 4. [`Intake::submit`] hands it on; its [`Reply`] arrives on the receiver with the permits,
//!    which the transport drops once the reply is delivered. A transport that reads several
//!    requests at once holds each ([`Intake::hold`]) and flushes them together
//!    ([`Intake::flush`]) before it may wait: the scheduler then takes them in one lock hold
//!    per worker (docs/ARCHITECTURE.md, decision 74), and it takes its slots and budget with
//!    [`Intake::request_slot_flushing`] and [`Intake::charge_flushing`].

use std::sync::Arc;

use headroom_nbd as nbd;
use headroom_store::Volume;
use tokio::sync::mpsc;

use super::Pipeline;
use super::block_status::BLOCK_STATUS_CHARGE_BYTES;
use super::job::{Answer, ClientJob, IoJob, run_ready_in};
use super::reply::{Permits, Reply, ReplyBody, ReplyPath, Tally};
use super::split::{
    PieceFeeder, SPLIT_PIECES_IN_FLIGHT, SplitRequest, cache_work, needs_split, piece_bytes_of,
    pieces, submit_job,
};
use crate::admission::ConnShared;
use crate::budget::{BudgetError, Charge, TenantAccount};
use crate::buffers::{BufferPool, PooledBuffer};
use crate::metrics::{MetricsRegistry, VolumeOp, VolumeStats};
use crate::scheduler::{Queued, Ready, Scheduler, VolumeHandle};
use crate::slots::{Slots, SlotsTaken};

/// Where a client's replies arrive, in completion order.
pub type ReplyReceiver = mpsc::UnboundedReceiver<Reply>;

/// Completes when a client's reply receiver is gone: [`Intake::watch_closed`].
#[derive(Debug)]
pub struct ClosedWatch(mpsc::UnboundedSender<Reply>);

impl ClosedWatch {
    pub async fn closed(&self) {
        self.0.closed().await;
    }
}

/// One client's way into the pipeline, for one volume.
#[derive(Debug)]
pub struct Intake {
    pipeline: Arc<Pipeline>,
    volume: Arc<Volume>,
    request_slots: Arc<Slots>,
    byte_slots: Arc<Slots>,
    account: TenantAccount,
    handle: Option<Arc<VolumeHandle>>,
    path: Arc<ReplyPath>,
    shared: Option<Arc<ConnShared>>,
    /// Where the last request ended, for the sequential flag without a scheduler.
    last_end_bytes: u64,
    /// The scratch vector of what a submission dispatched (kept: its allocation serves the
    /// next request).
    ready: Vec<Ready<IoJob>>,
    /// Requests [`Intake::hold`] took and [`Intake::flush`] has not submitted yet, in order,
    /// and their arrivals (time, payload bytes), counted when they are submitted.
    held: Vec<Queued<IoJob>>,
    held_arrivals: Vec<(u64, u64)>,
}

/// What a transport hands on: a validated request, the permits [`Intake::charge`] gave it,
/// and a WRITE's payload.
#[derive(Debug)]
pub struct Submission {
    pub request: nbd::ValidRequest,
    pub permits: Permits,
    pub write_payload: Option<PooledBuffer>,
    /// A READ whose range is all hole may be answered with [`ReplyBody::Hole`] (the transport
    /// can say so: NBD's structured replies without DF).
    pub sparse_read: bool,
    /// When the request arrived (node clock: [`Intake::now_ns`]).
    pub arrival_ns: u64,
}

impl Intake {
    /// Attaches a client of `volume`'s tenant. `shared`: the admitted connection's record,
    /// which reports what this client holds (`GET /v1/connections`).
    pub fn open(
        pipeline: &Arc<Pipeline>,
        volume: Arc<Volume>,
        shared: Option<&Arc<ConnShared>>,
    ) -> (Intake, ReplyReceiver) {
        let limits = &pipeline.limits;
        let max_requests = limits.max_inflight_requests_per_conn;
        let request_slots = Slots::new(max_requests);
        let byte_budget = usize::try_from(limits.max_inflight_bytes_per_conn).unwrap_or(usize::MAX);
        let byte_slots = Slots::new(byte_budget);
        if let Some(shared) = shared {
            shared.set_slots(Arc::clone(&request_slots), Arc::clone(&byte_slots));
        }
        let (tx, rx) = mpsc::unbounded_channel::<Reply>();
        let account = pipeline.budget.join(volume.tenant());
        let handle = pipeline
            .scheduler
            .as_ref()
            .map(|scheduler| scheduler_handle(scheduler, &volume));
        let path = Arc::new(ReplyPath {
            tx,
            stats: volume_stats(&pipeline.metrics, &volume),
            metrics: Arc::clone(&pipeline.metrics),
        });
        let intake = Intake {
            pipeline: Arc::clone(pipeline),
            volume,
            request_slots,
            byte_slots,
            account,
            handle,
            path,
            shared: shared.cloned(),
            last_end_bytes: u64::MAX / 2,
            ready: Vec::new(),
            held: Vec::new(),
            held_arrivals: Vec::new(),
        };
        (intake, rx)
    }

    /// The node clock, for a request's arrival.
    pub fn now_ns(&self) -> u64 {
        self.pipeline.io.clock.now_ns()
    }

    /// Whether the receiver of the replies is gone (the transport's writer gave up): nothing
    /// more should be read from the client.
    pub fn is_closed(&self) -> bool {
        self.path.tx.is_closed()
    }

    /// What completes when the receiver of the replies is gone, apart from the intake (so a
    /// transport can wait for it while its reader uses the intake). Drop it before waiting for
    /// the last replies: it holds their channel open.
    pub fn watch_closed(&self) -> ClosedWatch {
        ClosedWatch(self.path.tx.clone())
    }

    /// One of the client's request slots (waits while all are taken); `None` never while
    /// `Limits::validate` keeps at least one slot per connection.
    pub async fn request_slot(&self) -> Option<SlotsTaken> {
        self.request_slots.take(1).await
    }

    /// [`Intake::request_slot`] for a transport that holds requests ([`Intake::hold`]): at
    /// once when one is free, else after submitting what is held (the slot it waits for is
    /// given back by a reply).
    pub async fn request_slot_flushing(&mut self) -> Option<SlotsTaken> {
        if let Some(slot) = self.request_slots.take_now(1) {
            return Some(slot);
        }
        self.flush();
        self.request_slot().await
    }

    /// Answers a request the transport refused (`errno`, `message`) with its slot: counted as a
    /// failed request of its kind when it has one (`command_type`, the wire's command number),
    /// after what is held is submitted (arrivals are counted in order).
    pub fn refuse(
        &mut self,
        cookie: u64,
        command_type: u16,
        (errno, message): (nbd::Errno, &'static str),
        slot: SlotsTaken,
        arrival_ns: u64,
    ) {
        self.flush();
        let reply = Reply {
            cookie,
            body: ReplyBody::Error(errno, message),
            _permits: Permits {
                _request: slot,
                _bytes: None,
            },
        };
        match VolumeOp::of_type(command_type) {
            Some(op) => {
                let tally = Tally {
                    op,
                    payload_bytes: 0,
                    arrival_ns,
                };
                self.path
                    .stats
                    .arrive(&self.pipeline.metrics, arrival_ns, 0);
                self.path.send(tally, reply, self.now_ns());
            }
            None => {
                let _ = self.path.tx.send(reply);
            }
        }
    }

    /// Takes what `request` holds until its reply is delivered: `slot`, and for READ and WRITE
    /// its buffer's bytes (BLOCK_STATUS: its largest reply), first from this client's budget
    /// (waiting for its own replies), then from its reserve or its tenant's share of the node's
    /// pool. `Ok(None)`: the pipeline is closing.
    pub async fn charge(
        &self,
        request: &nbd::ValidRequest,
        slot: SlotsTaken,
    ) -> Result<Option<Permits>, BudgetError> {
        let bytes = match charged_bytes(request) {
            Some((charge_bytes, count)) => {
                let Some(own) = self.byte_slots.take(count).await else {
                    return Ok(None);
                };
                Some((own, self.account.charge(charge_bytes).await?))
            }
            None => None,
        };
        Ok(Some(self.permits(slot, bytes)))
    }

    /// [`Intake::charge`] for a transport that holds requests ([`Intake::hold`]): at once when
    /// the bytes fit in this client's budget and its own reserve, else after submitting what
    /// is held (the budget it waits for is given back by replies).
    pub async fn charge_flushing(
        &mut self,
        request: &nbd::ValidRequest,
        slot: SlotsTaken,
    ) -> Result<Option<Permits>, BudgetError> {
        match self.charge_now(request, slot) {
            Ok(permits) => Ok(Some(permits)),
            Err(slot) => {
                self.flush();
                self.charge(request, slot).await
            }
        }
    }

    /// [`Intake::charge`] when it would not wait: the bytes fit in this client's budget and in
    /// its own reserve now. Else nothing is taken and the slot comes back, for `charge`.
    fn charge_now(
        &self,
        request: &nbd::ValidRequest,
        slot: SlotsTaken,
    ) -> Result<Permits, SlotsTaken> {
        let bytes = match charged_bytes(request) {
            Some((charge_bytes, count)) => {
                let Some(own) = self.byte_slots.take_now(count) else {
                    return Err(slot);
                };
                let Some(charge) = self.account.charge_now(charge_bytes) else {
                    return Err(slot);
                };
                Some((own, charge))
            }
            None => None,
        };
        Ok(self.permits(slot, bytes))
    }

    fn permits(&self, slot: SlotsTaken, bytes: Option<(SlotsTaken, Charge)>) -> Permits {
        if let Some(shared) = &self.shared {
            shared.note_inflight();
        }
        Permits {
            _request: slot,
            _bytes: bytes,
        }
    }

    /// A buffer for a WRITE payload of `len_bytes`.
    pub fn payload_buffer(&self, len_bytes: u32) -> PooledBuffer {
        self.pipeline.io.buffers.get(len_bytes as usize)
    }

    /// Gives a delivered READ's buffer back to the node's pool, as the NBD writer does once
    /// the data is on the wire: the next READ reuses it instead of allocating and zeroing one.
    pub fn recycle(&self, buffer: PooledBuffer) {
        self.pipeline.io.buffers.put(buffer);
    }

    /// Hands a request on: counted as arrived (at its arrival), then split if it must be,
    /// scheduled and run. `NBD_CMD_DISC` is the transport's own and is not submitted.
    pub fn submit(&mut self, submission: Submission) {
        self.submit_with(submission, false);
    }

    #[inline(always)]
    fn submit_with(&mut self, submission: Submission, hold: bool) {
        let Submission {
            request,
            permits,
            write_payload,
            sparse_read,
            arrival_ns,
        } = submission;
        // The transport's side of the contract: what reaches the pipeline was validated,
        // whatever the wire. (Against the size it saw: a live shrink may since have moved the
        // end, which the store answers as out of range; no volume is ever larger than this.)
        assert!(
            request.offset.saturating_add(u64::from(request.length))
                <= headroom_store::MAX_VOLUME_SIZE_BYTES,
            "request at {}+{} past any volume's end",
            request.offset,
            request.length,
        );
        assert!(
            !matches!(request.command, nbd::Command::Read | nbd::Command::Write)
                || request.length <= self.pipeline.limits.max_request_bytes,
            "a {}-byte payload, larger than the node's maximum request",
            request.length
        );
        assert_eq!(
            write_payload.as_ref().map(|p| p.as_slice().len()),
            matches!(request.command, nbd::Command::Write).then_some(request.length as usize),
            "a WRITE carries its whole payload, nothing else carries one"
        );
        let Some(tally) = Tally::of(&request, arrival_ns) else {
            debug_assert!(false, "NBD_CMD_DISC is not submitted");
            return;
        };
        let piece_bytes = piece_bytes_of(&request, self.pipeline.limits.max_request_bytes);
        let batches = self.handle.is_some()
            && self
                .pipeline
                .scheduler
                .as_ref()
                .is_some_and(|s| s.batches());
        let held = hold && batches && !needs_split(&request, piece_bytes);
        if held {
            // Counted as arrived when it is submitted (`flush`), for the reason below.
            self.held_arrivals.push((arrival_ns, tally.payload_bytes));
        } else {
            // After what is held, so that arrivals are counted in order.
            self.flush();
            // Counted as arrived only now that nothing can stop it from being answered: the
            // audit must see every arrival leave.
            self.path
                .stats
                .arrive(&self.pipeline.metrics, arrival_ns, tally.payload_bytes);
        }
        if needs_split(&request, piece_bytes) {
            // One reply for the request, sent when its last piece completes; each piece is
            // scheduled, charged and run as a request of its own, at most
            // `SPLIT_PIECES_IN_FLIGHT` at once (the rest are submitted as those complete).
            let pieces = match request.command {
                nbd::Command::Cache => cache_work(&self.volume, pieces(&request, piece_bytes)),
                _ => pieces(&request, piece_bytes),
            };
            let feeder = PieceFeeder {
                volume: Arc::clone(&self.volume),
                io: Arc::clone(&self.pipeline.io),
                scheduled: self.pipeline.scheduler.clone().zip(self.handle.clone()),
            };
            let split = SplitRequest::new(
                &request,
                pieces,
                permits,
                Arc::clone(&self.path),
                tally,
                feeder,
            );
            for _ in 0..SPLIT_PIECES_IN_FLIGHT {
                match split.next_piece() {
                    Some(job) => self.run(job),
                    None => break,
                }
            }
            return;
        }
        let job = IoJob::Client(ClientJob {
            volume: Arc::clone(&self.volume),
            request,
            write_payload,
            sparse_read,
            answer: Answer::Whole {
                permits,
                reply: Arc::clone(&self.path),
                tally,
            },
        });
        match (&self.pipeline.scheduler, &self.handle) {
            (Some(scheduler), Some(handle)) if held => {
                scheduler.queue(handle, job.desc(), job, &mut self.held);
            }
            _ => self.run(job),
        }
    }

    /// [`Intake::submit`] that holds the request back until [`Intake::flush`]: a transport
    /// that has read several requests at once hands them to the scheduler together
    /// ([`Scheduler::submit_batch`]), each worker's lock taken once for all of them. Submitted
    /// at once: a request that is split (after those held), any without a scheduler or under
    /// stealing dispatch ([`Scheduler::batches`]), and the one that makes
    /// [`HOLD_MAX_REQUESTS`] held (with them). The transport must flush before
    /// anything that may wait (for its client, or for a slot or budget: the `_flushing` takes
    /// do): what waits, waits for replies, and a held request has none yet.
    pub fn hold(&mut self, submission: Submission) {
        self.submit_with(submission, true);
        if self.held.len() >= HOLD_MAX_REQUESTS {
            self.flush();
        }
    }

    /// Submits the requests held, in order.
    #[inline]
    pub fn flush(&mut self) {
        if !self.held.is_empty() {
            self.submit_held();
        }
    }

    fn submit_held(&mut self) {
        let (Some(scheduler), Some(handle)) = (&self.pipeline.scheduler, &self.handle) else {
            debug_assert!(false, "held without a scheduler");
            return;
        };
        for (arrival_ns, payload_bytes) in self.held_arrivals.drain(..) {
            self.path
                .stats
                .arrive(&self.pipeline.metrics, arrival_ns, payload_bytes);
        }
        scheduler.submit_batch(handle, &mut self.held, &mut self.ready);
        if !self.ready.is_empty() {
            run_ready_in(&self.pipeline.io, Some(scheduler), &mut self.ready);
        }
    }

    /// Submits one job (a request or a piece) to the scheduler, or runs it.
    fn run(&mut self, job: IoJob) {
        let io = job.desc();
        let scheduled = self.pipeline.scheduler.as_ref().zip(self.handle.as_ref());
        let end = io.offset_bytes.saturating_add(u64::from(io.len_bytes));
        let sequential = scheduled.is_none()
            && headroom_qos::model::is_sequential(self.last_end_bytes, io.offset_bytes);
        if scheduled.is_none() {
            self.last_end_bytes = end;
        }
        submit_job(
            &self.pipeline.io,
            scheduled,
            job,
            sequential,
            &mut self.ready,
        );
    }

    /// Detaches: no reply is sent from here on but those of requests already submitted. The
    /// tenant's account is returned to be dropped once those are delivered.
    pub fn close(mut self) -> TenantAccount {
        self.flush();
        self.account
    }
}

/// Most requests [`Intake::hold`] holds before the transport must flush: a bound on how long
/// the first of them waits for the others to be read (about a microsecond each).
const HOLD_MAX_REQUESTS: usize = 32;

/// What a request is charged in bytes, and the connection slots that is, for READ, WRITE and
/// BLOCK_STATUS (their buffer's or their largest reply's size); `None` for the others.
fn charged_bytes(request: &nbd::ValidRequest) -> Option<(u64, usize)> {
    let charged_len = match request.command {
        nbd::Command::Read | nbd::Command::Write => request.length,
        nbd::Command::BlockStatus => BLOCK_STATUS_CHARGE_BYTES,
        _ => return None,
    };
    let charge_bytes = BufferPool::charge_bytes(charged_len);
    // At most the class of a 32 MiB request, which `Limits::validate` keeps within the
    // connection's budget (so the take cannot be refused).
    let count = usize::try_from(charge_bytes).unwrap_or(usize::MAX);
    Some((charge_bytes, count))
}

/// The volume's statistics, registering it with its stored QoS if they are new.
pub(crate) fn volume_stats(metrics: &MetricsRegistry, volume: &Volume) -> Arc<VolumeStats> {
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
