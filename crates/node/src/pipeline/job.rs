//! What the scheduler runs and how a dispatched job executes against the store.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use headroom_nbd as nbd;
use headroom_qos::OpKind;
use headroom_store::{StoreError, Volume};

use crate::buffers::{BufferPool, PooledBuffer};
use crate::exec::Lane;
use crate::scheduler::{IoDesc, Ready, Runner, Scheduler, Ticket, VolumeHandle};
use crate::sync::lock;

/// How a job's outcome reaches the client.
#[derive(Debug)]
pub(super) enum Answer {
    /// The job is the whole request: its reply goes out when it completes.
    Whole {
        permits: Permits,
        reply: Arc<ReplyPath>,
        tally: Tally,
    },
    /// The job is piece `index` of a split request.
    Piece {
        split: Arc<SplitRequest>,
        index: usize,
    },
}

impl Answer {
    /// Answers the request at `now_ns` (node clock).
    fn deliver(self, cookie: u64, body: ReplyBody, now_ns: u64) {
        match self {
            Answer::Whole {
                permits,
                reply,
                tally,
            } => reply.send(
                tally,
                Reply {
                    cookie,
                    body,
                    _permits: permits,
                },
                now_ns,
            ),
            Answer::Piece { split, index } => split.piece_done(index, body, now_ns),
        }
    }
}

/// What the scheduler runs: a client's request, or a grant for the node's own work (the
/// rebuild of lost copies), which is charged and paced by the same policy as a tenant of its
/// own, so that it takes its share of the node and no more.
#[derive(Debug)]
pub enum IoJob {
    Client(ClientJob),
    Grant(Grant),
}

impl IoJob {
    /// The request as the scheduler sees it.
    pub(super) fn desc(&self) -> IoDesc {
        match self {
            IoJob::Client(job) => job.desc(),
            IoJob::Grant(grant) => grant.desc,
        }
    }
}

/// Node-internal work that waits for the scheduler: submitted with
/// [`Grant::submit`], dispatched by the policy like a request (the runner then hands the
/// ticket over instead of running anything), done by the submitter, and completed with
/// [`Grant::complete`], which is when the policy learns the work is over.
#[derive(Debug)]
pub struct Grant {
    desc: IoDesc,
    slot: Arc<GrantSlot>,
}

/// Where a dispatched grant's ticket waits for its submitter.
#[derive(Debug, Default)]
pub struct GrantSlot {
    state: Mutex<GrantState>,
    dispatched: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GrantState {
    ticket: Option<Ticket>,
    /// The submitter stopped waiting: a later dispatch completes the grant at once.
    abandoned: bool,
}

impl Grant {
    /// Submits `desc` for `handle` (a volume key the caller registered with
    /// `Scheduler::add_volume`); [`PendingGrant::wait`] then blocks until the policy
    /// dispatches it. Dropping the pending grant before that gives it up: it is completed as
    /// soon as it is dispatched, so the scheduler's books stay right.
    pub fn submit(
        io: &Arc<IoRuntime>,
        scheduler: &Arc<Scheduler<IoJob>>,
        handle: &Arc<VolumeHandle>,
        desc: IoDesc,
    ) -> PendingGrant {
        let slot = Arc::new(GrantSlot::default());
        let mut ready = Vec::new();
        scheduler.submit(
            handle,
            desc,
            IoJob::Grant(Grant {
                desc,
                slot: Arc::clone(&slot),
            }),
            &mut ready,
        );
        if !ready.is_empty() {
            run_ready(io, Some(scheduler), ready);
        }
        PendingGrant {
            slot,
            io: Arc::clone(io),
            scheduler: Arc::clone(scheduler),
        }
    }

    /// The work a dispatched grant admitted is done: the policy is told, and whatever that
    /// releases runs.
    pub fn complete(io: &Arc<IoRuntime>, scheduler: &Arc<Scheduler<IoJob>>, ticket: Ticket) {
        let mut released = Vec::new();
        scheduler.complete_at(ticket, io.clock.now_ns(), &mut released);
        if !released.is_empty() {
            run_ready(io, Some(scheduler), released);
        }
    }

    /// The runner's side: hands the ticket to the waiting submitter, or completes it at once
    /// when nobody waits any more. Returns what that completion released.
    fn dispatched(
        self,
        io: &IoRuntime,
        scheduler: Option<&Arc<Scheduler<IoJob>>>,
        admission: Admission,
    ) -> Option<Vec<Ready<IoJob>>> {
        let Scheduled(ticket) = admission else {
            return None;
        };
        let mut state = lock(&self.slot.state);
        if !state.abandoned {
            state.ticket = Some(ticket);
            drop(state);
            self.slot.dispatched.notify_all();
            return None;
        }
        drop(state);
        let scheduler = scheduler?;
        let mut released = Vec::new();
        scheduler.complete_at(ticket, io.clock.now_ns(), &mut released);
        Some(released)
    }
}

/// A submitted grant whose submitter waits for its dispatch ([`Grant::submit`]).
#[derive(Debug)]
pub struct PendingGrant {
    slot: Arc<GrantSlot>,
    io: Arc<IoRuntime>,
    scheduler: Arc<Scheduler<IoJob>>,
}

impl PendingGrant {
    /// The ticket once the policy dispatched the grant, or `None` after `timeout` (call
    /// again to keep waiting).
    pub fn wait(&self, timeout: Duration) -> Option<Ticket> {
        let deadline = std::time::Instant::now() + timeout;
        let mut state = lock(&self.slot.state);
        loop {
            if let Some(t) = state.ticket.take() {
                return Some(t);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return None;
            }
            state = self
                .slot
                .dispatched
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for PendingGrant {
    fn drop(&mut self) {
        // Under the lock, so a dispatch either came before (its ticket is here) or sees this
        // and completes the grant itself.
        let mut state = lock(&self.slot.state);
        state.abandoned = true;
        let ticket = state.ticket.take();
        drop(state);
        if let Some(ticket) = ticket {
            Grant::complete(&self.io, &self.scheduler, ticket);
        }
    }
}

/// One validated request (or piece of one) with everything needed to run it and answer it.
#[derive(Debug)]
pub struct ClientJob {
    pub(super) volume: Arc<Volume>,
    pub(super) request: nbd::ValidRequest,
    pub(super) write_payload: Option<PooledBuffer>,
    /// A READ whose range is all hole may be answered with `ReplyBody::Hole`.
    pub(super) sparse_read: bool,
    pub(super) answer: Answer,
}

impl ClientJob {
    /// The request as the scheduler sees it ([`desc_of`]).
    fn desc(&self) -> IoDesc {
        desc_of(&self.volume, &self.request)
    }

    /// Whether it must leave the calling thread: [`runs_off_thread`].
    fn runs_on_executor(&self, io: &IoRuntime) -> bool {
        runs_off_thread(&self.request, io)
    }
}

/// The request as the scheduler sees it: every request is charged, reads of holes too,
/// and each as the device work it does. CACHE is readahead, a read of its length from the
/// device (its egress, which it does not send, is counted too: over, not under);
/// WRITE_ZEROES that may not punch provisions and zeroes its range (`OpKind::WriteZeroes`:
/// CPU and metadata per KiB, no payload), and where the volume's devices cannot zero a range
/// in place it writes zeros, a write of its length; one that may punch is a discard, a TRIM;
/// BLOCK_STATUS walks the extent map and asks the device where its data is, one small read's
/// worth (its walk is bounded: [`BLOCK_STATUS_MAX_WALK_BYTES`]). A FUA request also pays for
/// the device sync it runs, and a FLUSH for one sync per device with writes not yet durable
/// (the pool-wide commit it causes: `Volume::unsynced_devices`), at least one.
pub(super) fn desc_of(volume: &Volume, request: &nbd::ValidRequest) -> IoDesc {
    let (op, len_bytes) = match request.command {
        nbd::Command::Read => (OpKind::Read, request.length),
        nbd::Command::Write => (OpKind::Write, request.length),
        nbd::Command::Flush => (OpKind::Flush, 0),
        // Refused at once (not faster than a write): costs what a refusal costs.
        nbd::Command::WriteZeroes if request.no_hole && request.fast_zero => (OpKind::Trim, 0),
        nbd::Command::WriteZeroes if request.no_hole && !volume.is_zero_fast() => {
            (OpKind::Write, request.length)
        }
        nbd::Command::WriteZeroes if request.no_hole => (OpKind::WriteZeroes, request.length),
        nbd::Command::WriteZeroes => (OpKind::Trim, request.length),
        nbd::Command::Trim => (OpKind::Trim, request.length),
        nbd::Command::Cache => (OpKind::Read, request.length),
        nbd::Command::BlockStatus => (OpKind::Read, 0),
        nbd::Command::Disc => (OpKind::Trim, 0),
    };
    let syncs = match request.command {
        nbd::Command::Flush => volume.unsynced_devices().max(1),
        nbd::Command::Read | nbd::Command::Cache | nbd::Command::BlockStatus => 0,
        _ => u32::from(request.fua),
    };
    IoDesc {
        op,
        offset_bytes: request.offset,
        len_bytes,
        syncs,
    }
}

/// Whether it must leave the calling thread (a network thread, which carries other
/// connections, of other tenants too): whatever may block in the kernel always (FLUSH's
/// fsync and any FUA request's `fdatasync`, TRIM's and WRITE_ZEROES' fallocate, CACHE's
/// readahead, BLOCK_STATUS's lseeks over the device files), large copies when there are
/// workers; small READs and WRITEs
/// run inline, where a thread hop would cost more than they do.
pub(super) fn runs_off_thread(request: &nbd::ValidRequest, io: &IoRuntime) -> bool {
    let moved = match request.command {
        nbd::Command::Read | nbd::Command::Write => request.length,
        _ => 0,
    };
    let blocking = matches!(
        request.command,
        nbd::Command::Flush
            | nbd::Command::Trim
            | nbd::Command::WriteZeroes
            | nbd::Command::Cache
            | nbd::Command::BlockStatus
    ) || request.fua;
    blocking || (io.lanes.is_some() && moved > io.inline_max_bytes)
}

/// The executor lane a request runs on when it leaves the calling thread: bulk work (CACHE,
/// WRITE_ZEROES, TRIM, BLOCK_STATUS, FUA or not: its length is the work) on the low-priority
/// lane, FLUSH and FUA READs and WRITEs on the sync lane, the rest on the data lane; so a 4 KiB
/// read never queues behind a neighbour's zeroing or `fdatasync` (exec.rs, "Lanes").
pub(super) fn lane_of(request: &nbd::ValidRequest) -> Lane {
    match request.command {
        nbd::Command::Cache
        | nbd::Command::WriteZeroes
        | nbd::Command::Trim
        | nbd::Command::BlockStatus => Lane::Bulk,
        nbd::Command::Flush => Lane::Sync,
        _ if request.fua => Lane::Sync,
        _ => Lane::Data,
    }
}

/// Runs jobs for the scheduler's wake-up thread.
#[derive(Debug)]
pub struct IoRunner(pub Arc<IoRuntime>);

impl Runner<IoJob> for IoRunner {
    fn run(&self, scheduler: &Arc<Scheduler<IoJob>>, ready: Vec<Ready<IoJob>>) {
        run_ready(&self.0, Some(scheduler), ready);
    }
}

/// Why a job runs: the scheduler dispatched it, or there is no scheduler (then with the
/// IOCost sequential flag the session computed).
pub(super) enum Admission {
    Scheduled(Ticket),
    Unscheduled(bool),
}
use super::block_status::{block_status, status_descriptors};
use super::emulation::{Emulation, book_per_device};
use super::reply::{Permits, Reply, ReplyBody, ReplyPath, Tally};
use super::runtime::IoRuntime;
use super::split::SplitRequest;
use Admission::{Scheduled, Unscheduled};

impl Admission {
    fn sequential(&self) -> bool {
        match self {
            Scheduled(ticket) => ticket.sequential(),
            Unscheduled(sequential) => *sequential,
        }
    }
}

/// Runs dispatched jobs and whatever their completions release, in order.
fn run_ready(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    mut ready: Vec<Ready<IoJob>>,
) {
    run_ready_in(io, scheduler, &mut ready);
}

/// `run_ready` on a vector the caller keeps (a session's): its allocation serves the next
/// request too. Leaves it empty.
pub(super) fn run_ready_in(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    ready: &mut Vec<Ready<IoJob>>,
) {
    let mut work: std::collections::VecDeque<Ready<IoJob>> = std::mem::take(ready).into();
    while let Some(Ready { job, ticket }) = work.pop_front() {
        if let Some(released) = run_job(io, scheduler, job, Scheduled(ticket)) {
            work.extend(released);
        }
    }
    // Empty, hence contiguous: the conversion keeps the buffer.
    *ready = work.into();
}

/// Runs one job inline or on the executor. Returns the jobs its completion released when it
/// completed inline (the caller runs them), so a chain of releases never recurses.
pub(super) fn run_job(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: IoJob,
    admission: Admission,
) -> Option<Vec<Ready<IoJob>>> {
    let job = match job {
        IoJob::Client(job) => job,
        IoJob::Grant(grant) => return grant.dispatched(io, scheduler, admission),
    };
    // `None`: it went to the cluster asynchronously and is answered from its completion.
    let (job, admission) = start_async(io, scheduler, job, admission)?;
    if !job.runs_on_executor(io) {
        return execute_and_finish(io, scheduler, job, admission);
    }
    let lane = lane_of(&job.request);
    let task = {
        let io = Arc::clone(io);
        let scheduler = scheduler.cloned();
        move || {
            if let Some(released) = execute_and_finish(&io, scheduler.as_ref(), job, admission) {
                run_ready(&io, scheduler.as_ref(), released);
            }
        }
    };
    let task = io.work.counted(task);
    match &io.lanes {
        Some(lanes) => {
            if let Err(task) = lanes.get(lane).submit(Box::new(task)) {
                task();
            }
        }
        // FLUSH may take milliseconds (fsync): never on a runtime thread.
        None => {
            io.runtime.spawn_blocking(task);
        }
    }
    None
}

/// A READ, or a WRITE without FUA, of a volume on RADOS goes to the cluster asynchronously
/// (headroom_store's volume_aio.rs; docs/ARCHITECTURE.md, decision 25):
/// prepared on the calling thread, answered from librados' completion thread, so no I/O
/// thread waits for the cluster and many requests are in flight without a thread each.
/// `Some` hands the job back for the synchronous path (other requests and backends, holes,
/// FUA, an emulated device, injected faults).
fn start_async(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: ClientJob,
    admission: Admission,
) -> Option<(ClientJob, Admission)> {
    let write = match job.request.command {
        nbd::Command::Read => false,
        nbd::Command::Write if !job.request.fua => true,
        _ => return Some((job, admission)),
    };
    if job.request.length == 0 || !matches!(io.emulation, Emulation::Off) {
        return Some((job, admission));
    }
    let request = job
        .volume
        .start_async(job.request.offset, u64::from(job.request.length), write);
    let request = match request {
        Ok(None) => return Some((job, admission)),
        Ok(Some(request)) => Ok(request),
        Err(err) => Err(err),
    };
    let ClientJob {
        request: nbd_request,
        write_payload,
        answer,
        ..
    } = job;
    let (cookie, offset) = (nbd_request.cookie, nbd_request.offset);
    let finish = {
        let io = Arc::clone(io);
        let scheduler = scheduler.cloned();
        move |body: ReplyBody| {
            let now_ns = io.clock.now_ns();
            answer.deliver(cookie, body, now_ns);
            let (Some(scheduler), Scheduled(ticket)) = (scheduler, admission) else {
                return;
            };
            let mut released = Vec::new();
            scheduler.complete_at(ticket, now_ns, &mut released);
            if released.is_empty() {
                return;
            }
            // Not here: this may be librados' completion thread, which must not block (a
            // released FLUSH or TRIM would) and serves the other completions.
            let task = {
                let io = Arc::clone(&io);
                move || run_ready(&io, Some(&scheduler), released)
            };
            let task = io.work.counted(task);
            match &io.lanes {
                Some(lanes) => {
                    if let Err(task) = lanes.get(Lane::Data).submit(Box::new(task)) {
                        io.runtime.spawn_blocking(task);
                    }
                }
                None => {
                    io.runtime.spawn_blocking(task);
                }
            }
        }
    };
    let error = move |err: &StoreError| {
        tracing::debug!("request at {offset} failed: {err}");
        let (errno, message) = store_errno(err);
        ReplyBody::Error(errno, message)
    };
    let buffers = Arc::clone(&io.buffers);
    match (request, write_payload) {
        (Err(err), payload) => {
            if let Some(payload) = payload {
                buffers.put(payload);
            }
            finish(error(&err));
        }
        (Ok(request), Some(payload)) if write => request.submit(
            payload,
            Box::new(move |payload, result| {
                buffers.put(payload);
                finish(match result {
                    Ok(()) => ReplyBody::Done,
                    Err(err) => error(&err),
                });
            }),
        ),
        // validate_request only yields WRITE with its payload read; keep the errno honest.
        (Ok(_), None) if write => {
            finish(ReplyBody::Error(nbd::Errno::Eio, "write payload missing"))
        }
        (Ok(request), payload) => {
            if let Some(payload) = payload {
                buffers.put(payload);
            }
            let data = buffers.get(nbd_request.length as usize);
            request.submit(
                data,
                Box::new(move |data, result| match result {
                    Ok(()) => finish(ReplyBody::Data { offset, data }),
                    Err(err) => {
                        buffers.put(data);
                        finish(error(&err));
                    }
                }),
            );
        }
    }
    None
}

/// Performs the request, then answers it and reports its completion: at once, or when the
/// emulated device says it is done. Returns what the completion released if it happened here.
fn execute_and_finish(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: ClientJob,
    admission: Admission,
) -> Option<Vec<Ready<IoJob>>> {
    let desc = job.desc();
    let sequential = admission.sequential();
    let ClientJob {
        volume,
        request,
        write_payload,
        sparse_read,
        answer,
    } = job;
    let routed = match desc.op {
        OpKind::Read => io.reads.route(&volume, request.offset, sequential),
        _ => None,
    };
    let body = execute(
        &io.buffers,
        &volume,
        &request,
        write_payload,
        sparse_read,
        routed.map_or(0, |r| r.copy),
    );
    let cookie = request.cookie;
    let clock = io.clock;
    let routed_on = routed.map(|r| (Arc::clone(io), r.device));
    let finish = move |scheduler: Option<&Arc<Scheduler<IoJob>>>| {
        // One clock read for the reply's statistics and the scheduler's completion.
        let now_ns = clock.now_ns();
        answer.deliver(cookie, body, now_ns);
        if let Some((io, device)) = &routed_on {
            io.reads.done(*device);
        }
        let mut released = Vec::new();
        if let (Some(scheduler), Scheduled(ticket)) = (scheduler, admission) {
            scheduler.complete_at(ticket, now_ns, &mut released);
        }
        released
    };
    let (device, done_ns) = match &io.emulation {
        Emulation::Off => return Some(finish(scheduler)),
        Emulation::Node(device) => {
            let now_ns = io.clock.now_ns();
            // One device for the whole pool: each volume has its own region of it.
            let position = volume
                .id()
                .wrapping_mul(headroom_store::MAX_VOLUME_SIZE_BYTES)
                .wrapping_add(request.offset);
            (
                device,
                device.book(now_ns, desc.op, position, desc.len_bytes, sequential),
            )
        }
        Emulation::PerDevice(devices) => {
            let copy = routed.map(|r| r.copy);
            let now_ns = io.clock.now_ns();
            match book_per_device(devices, &volume, &request, desc, sequential, copy, now_ns) {
                Some(booked) => booked,
                None => return Some(finish(scheduler)),
            }
        }
    };
    let io = Arc::clone(io);
    let scheduler = scheduler.cloned();
    device.complete_at(
        done_ns,
        Box::new(move || {
            let released = finish(scheduler.as_ref());
            if !released.is_empty() {
                run_ready(&io, scheduler.as_ref(), released);
            }
        }),
    );
    None
}

/// Performs the block operation and builds the reply.
pub(super) fn execute(
    buffers: &BufferPool,
    volume: &Volume,
    request: &nbd::ValidRequest,
    write_payload: Option<PooledBuffer>,
    sparse_read: bool,
    first_copy: u8,
) -> ReplyBody {
    let offset = request.offset;
    let length = u64::from(request.length);
    let outcome = match request.command {
        nbd::Command::Read => {
            let mut data = buffers.get(request.length as usize);
            let read = if sparse_read && request.length > 0 {
                volume.read_at_unless_hole_from(offset, data.as_mut_slice(), first_copy)
            } else {
                volume
                    .read_at_from(offset, data.as_mut_slice(), first_copy)
                    .map(|()| false)
            };
            match read {
                Ok(true) => {
                    buffers.put(data);
                    return ReplyBody::Hole {
                        offset,
                        len: request.length,
                    };
                }
                Ok(false) => return ReplyBody::Data { offset, data },
                Err(err) => {
                    buffers.put(data);
                    Err(err)
                }
            }
        }
        nbd::Command::Write => match write_payload {
            Some(payload) => {
                let result = volume.write_at(offset, payload.as_slice(), request.fua);
                buffers.put(payload);
                result
            }
            // validate_request only yields WRITE with its payload read; keep the errno honest.
            None => return ReplyBody::Error(nbd::Errno::Eio, "write payload missing"),
        },
        nbd::Command::Flush => volume.flush(),
        nbd::Command::Trim => volume.trim(offset, length, request.fua),
        nbd::Command::WriteZeroes => {
            if request.fast_zero && request.no_hole {
                // Zeroing without punching means writing zeros: not faster than a write.
                return ReplyBody::Error(nbd::Errno::Enotsup, "fast zero needs hole punching");
            }
            volume.write_zeroes(offset, length, !request.no_hole, request.fua)
        }
        nbd::Command::Cache => volume.cache(offset, length),
        nbd::Command::BlockStatus => match block_status(volume, offset, length, request.req_one) {
            Ok(extents) => {
                return ReplyBody::BlockStatus {
                    extents: status_descriptors(&extents, request.req_one),
                };
            }
            Err(err) => Err(err),
        },
        nbd::Command::Disc => Ok(()),
    };
    match outcome {
        Ok(()) => ReplyBody::Done,
        Err(err) => {
            tracing::debug!("request at {offset}+{length} failed: {err}");
            let (errno, message) = store_errno(&err);
            ReplyBody::Error(errno, message)
        }
    }
}

/// The errno the spec names for each store failure.
fn store_errno(err: &StoreError) -> (nbd::Errno, &'static str) {
    match err {
        StoreError::NoSpace => (nbd::Errno::Enospc, "no space left in the pool"),
        StoreError::OutOfRange { .. } => (nbd::Errno::Einval, "range outside the volume"),
        StoreError::VolumeDeleted(_) => (nbd::Errno::Eio, "volume was deleted"),
        _ => (nbd::Errno::Eio, "I/O error"),
    }
}
