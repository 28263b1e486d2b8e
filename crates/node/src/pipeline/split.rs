//! Requests larger than one backend operation, cut into pieces fed a few at a time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use headroom_nbd as nbd;
use headroom_store::Volume;

use super::job::{Admission, Answer, ClientJob, IoJob, run_job, run_ready_in};
use super::reply::{Permits, Reply, ReplyBody, ReplyPath, Tally};
use super::runtime::IoRuntime;
use crate::scheduler::{Ready, Scheduler, VolumeHandle};
use crate::sync::lock;

/// Smallest piece a split request is cut into, whatever `max_request_bytes` says (a tiny
/// configured maximum must not turn a 4 GiB TRIM into millions of pieces).
const MIN_PIECE_BYTES: u32 = 1 << 20;

/// Submits `job` to the scheduler (and runs what it dispatches, with `ready` as the
/// scratch vector), or without one runs it at once, as `sequential` or not: what a session
/// does with each request and a split request with each piece it feeds.
pub(super) fn submit_job(
    io: &Arc<IoRuntime>,
    scheduled: Option<(&Arc<Scheduler<IoJob>>, &Arc<VolumeHandle>)>,
    job: IoJob,
    sequential: bool,
    ready: &mut Vec<Ready<IoJob>>,
) {
    match scheduled {
        Some((scheduler, handle)) => {
            let desc = job.desc();
            scheduler.submit(handle, desc, job, ready);
            if !ready.is_empty() {
                run_ready_in(io, Some(scheduler), ready);
            }
        }
        None => {
            if let Some(released) = run_job(io, None, job, Admission::Unscheduled(sequential)) {
                debug_assert!(released.is_empty());
            }
        }
    }
}

/// How many pieces of one split request the node holds at once (queued at the scheduler or
/// running): one running and one waiting, so a request's pieces keep its device busy
/// without taking every I/O worker. Submitting all of them at once let one client at queue
/// depth 1 run eight 32 MiB zeroings in parallel (the executor started helper threads for
/// them) and take both cores of a small machine from everyone else.
pub(super) const SPLIT_PIECES_IN_FLIGHT: usize = 2;

/// Pieces of the commands whose work grows with their length (zeroing in place, CACHE's
/// readahead) are at most one extent, so no single dispatch holds the scheduler's capacity
/// (or a worker) for long; TRIM and a releasing WRITE_ZEROES are metadata per extent and
/// keep the maximum block size.
const WORK_PIECE_BYTES: u32 = headroom_store::EXTENT_SIZE_BYTES as u32;

/// The piece size `request` is cut into when it is larger (`needs_split`).
pub(super) fn piece_bytes_of(request: &nbd::ValidRequest, max_request_bytes: u32) -> u32 {
    let whole = max_request_bytes.max(MIN_PIECE_BYTES);
    let per_byte_work = matches!(request.command, nbd::Command::Cache)
        || (matches!(request.command, nbd::Command::WriteZeroes) && request.no_hole);
    if per_byte_work {
        whole.min(WORK_PIECE_BYTES)
    } else {
        whole
    }
}

/// Whether `request` is run as several pieces of at most `piece_bytes`. WRITE_ZEROES, TRIM and
/// CACHE carry no payload, so validation accepts them up to the export size (4 GiB - 1 on the
/// wire); cutting them at the maximum block size keeps every backend operation (a zero-filled
/// write, a punch, a readahead) and every scheduler charge bounded, and lets other volumes'
/// requests run between the pieces. BLOCK_STATUS is not split but cut short instead: its reply
/// describes one contiguous run of extents, and may end early ([`BLOCK_STATUS_MAX_WALK_BYTES`]).
pub(super) fn needs_split(request: &nbd::ValidRequest, piece_bytes: u32) -> bool {
    matches!(
        request.command,
        nbd::Command::WriteZeroes | nbd::Command::Trim | nbd::Command::Cache
    ) && request.length > piece_bytes
}

/// The pieces of a CACHE that have something to read ahead: the first one (so the request is
/// charged and answered as any split request is), and every later one over an allocated
/// extent. A piece over holes does nothing (`Volume::cache` skips them) but would cost a
/// scheduler charge and an executor hop: a client looping 32 MiB CACHEs over a thin volume
/// sent 16 of them per request, about 30,000 a second.
pub(super) fn cache_work(
    volume: &Volume,
    pieces: Vec<nbd::ValidRequest>,
) -> Vec<nbd::ValidRequest> {
    pieces
        .into_iter()
        .enumerate()
        .filter(|(i, p)| *i == 0 || volume.holds_data_in(p.offset, u64::from(p.length)))
        .map(|(_, p)| p)
        .collect()
}

/// Cuts `request` at multiples of `piece_bytes` (absolute offsets, so that pieces cover whole
/// extents except at the request's ends).
pub(super) fn pieces(request: &nbd::ValidRequest, piece_bytes: u32) -> Vec<nbd::ValidRequest> {
    let piece_bytes = u64::from(piece_bytes.max(1));
    let end = request.offset.saturating_add(u64::from(request.length));
    let mut out = Vec::with_capacity(
        usize::try_from(u64::from(request.length) / piece_bytes + 2).unwrap_or(0),
    );
    let mut offset = request.offset;
    while offset < end {
        let boundary = (offset / piece_bytes)
            .saturating_add(1)
            .saturating_mul(piece_bytes);
        let piece_end = boundary.min(end);
        // piece_end - offset <= piece_bytes <= u32::MAX.
        let length = u32::try_from(piece_end - offset).unwrap_or(u32::MAX);
        out.push(nbd::ValidRequest {
            offset,
            length,
            ..*request
        });
        offset = piece_end;
    }
    out
}

/// The shared state of a request split into pieces: the last piece to complete sends the one
/// reply, with the first failure (by offset) if any piece failed, and releases the permits.
/// It also feeds the pieces to the scheduler, [`SPLIT_PIECES_IN_FLIGHT`] at a time.
#[derive(Debug)]
pub(super) struct SplitRequest {
    cookie: u64,
    remaining: AtomicUsize,
    pub(super) state: Mutex<SplitState>,
    reply: Arc<ReplyPath>,
    tally: Tally,
    feeder: PieceFeeder,
}

#[derive(Debug)]
pub(super) struct SplitState {
    /// (piece index, errno, message) of the lowest failed piece.
    failure: Option<(usize, nbd::Errno, &'static str)>,
    permits: Option<Permits>,
    /// Pieces not submitted yet, in offset order, and the index of the first of them.
    pub(super) unsubmitted: std::collections::VecDeque<nbd::ValidRequest>,
    next_index: usize,
}

/// What submitting a piece needs, from the session that received the request.
#[derive(Debug)]
pub(super) struct PieceFeeder {
    pub(super) volume: Arc<Volume>,
    pub(super) io: Arc<IoRuntime>,
    pub(super) scheduled: Option<(Arc<Scheduler<IoJob>>, Arc<VolumeHandle>)>,
}

impl SplitRequest {
    pub(super) fn new(
        request: &nbd::ValidRequest,
        pieces: Vec<nbd::ValidRequest>,
        permits: Permits,
        reply: Arc<ReplyPath>,
        tally: Tally,
        feeder: PieceFeeder,
    ) -> Arc<SplitRequest> {
        Arc::new(SplitRequest {
            cookie: request.cookie,
            remaining: AtomicUsize::new(pieces.len()),
            state: Mutex::new(SplitState {
                failure: None,
                permits: Some(permits),
                unsubmitted: pieces.into(),
                next_index: 0,
            }),
            reply,
            tally,
            feeder,
        })
    }

    /// The next piece to submit, as a job, if any is left.
    pub(super) fn next_piece(self: &Arc<Self>) -> Option<IoJob> {
        let mut state = lock(&self.state);
        let piece = state.unsubmitted.pop_front()?;
        let index = state.next_index;
        state.next_index += 1;
        drop(state);
        Some(IoJob::Client(ClientJob {
            volume: Arc::clone(&self.feeder.volume),
            request: piece,
            write_payload: None,
            sparse_read: false,
            answer: Answer::Piece {
                split: Arc::clone(self),
                index,
            },
        }))
    }

    /// Submits the next piece, if any, after one completed (on the completing thread). Its
    /// pieces never run inline (`runs_off_thread`), so this does not recurse.
    fn feed(self: &Arc<Self>) {
        let Some(job) = self.next_piece() else {
            return;
        };
        let scheduled = self.feeder.scheduled.as_ref().map(|(s, h)| (s, h));
        // The pieces are contiguous: each follows the previous one.
        submit_job(&self.feeder.io, scheduled, job, true, &mut Vec::new());
    }

    /// Records one piece's outcome; answers the request when it was the last, and otherwise
    /// submits the next piece.
    pub(super) fn piece_done(self: &Arc<Self>, index: usize, body: ReplyBody, now_ns: u64) {
        let mut state = lock(&self.state);
        if let ReplyBody::Error(errno, message) = body
            && state.failure.is_none_or(|(first, _, _)| index < first)
        {
            state.failure = Some((index, errno, message));
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            drop(state);
            self.feed();
            return;
        }
        let Some(permits) = state.permits.take() else {
            return;
        };
        let body = match state.failure {
            Some((_, errno, message)) => ReplyBody::Error(errno, message),
            None => ReplyBody::Done,
        };
        drop(state);
        self.reply.send(
            self.tally,
            Reply {
                cookie: self.cookie,
                body,
                _permits: permits,
            },
            now_ns,
        );
    }
}
