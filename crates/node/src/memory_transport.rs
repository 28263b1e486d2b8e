//! A second transport: clients in the node's own process, which hand typed requests to the
//! pipeline and take typed replies back, with no socket and no framing in between.
//!
//! Why: the pipeline (`node::pipeline`) claims to be transport-neutral, and this is the proof
//! that a transport plugs in beside NBD without touching it — the same admission (a client is
//! admitted from an address and counts against the connection caps), the same intake (request
//! slots, the byte budget, splitting, the scheduler) and the same replies, with only what is
//! the transport's own here: how a request is described and validated, and how a reply is
//! delivered. The in-process harness (`crates/node/tests/`) drives the node through it where
//! the NBD wire is not what a test is about; vhost-user-blk (`node::vhost_user`) is the third.
//!
//! Requests are validated by the `nbd` crate's pure checker (`nbd::validate_request`: range,
//! flags, read-only, the maximum payload), as NBD's are, so both transports refuse the same
//! requests with the same errno. Replies arrive in completion order; a client may keep many
//! requests in flight ([`MemorySession::send`], [`MemorySession::next_completion`]) or one at a
//! time ([`MemorySession::call`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_store::Store;

use crate::admission::{Admitted, Connections, Refusal};
use crate::budget::BudgetError;
use crate::pipeline::{Intake, Pipeline, ReplyBody, ReplyReceiver, Submission};

/// What a client of the in-memory transport asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryOp {
    Read,
    Write,
    Flush,
    Trim,
    /// Zeroes the range; `no_hole` keeps it provisioned (NBD_CMD_FLAG_NO_HOLE).
    WriteZeroes,
    Cache,
    BlockStatus,
}

/// One request of the in-memory transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryRequest {
    pub op: MemoryOp,
    pub offset: u64,
    /// Bytes (a WRITE's is its payload's length).
    pub length: u32,
    /// Durable before it is answered.
    pub fua: bool,
    /// WRITE_ZEROES: do not punch.
    pub no_hole: bool,
    /// BLOCK_STATUS: one extent is enough.
    pub req_one: bool,
    /// A WRITE's data.
    pub payload: Vec<u8>,
}

impl MemoryRequest {
    fn new(op: MemoryOp, offset: u64, length: u32) -> MemoryRequest {
        MemoryRequest {
            op,
            offset,
            length,
            fua: false,
            no_hole: false,
            req_one: false,
            payload: Vec::new(),
        }
    }

    pub fn read(offset: u64, length: u32) -> MemoryRequest {
        MemoryRequest::new(MemoryOp::Read, offset, length)
    }

    /// A WRITE of `data` (at most 4 GiB - 1 bytes: longer is cut to that length and refused by
    /// validation for its size).
    pub fn write(offset: u64, data: Vec<u8>) -> MemoryRequest {
        let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
        MemoryRequest {
            payload: data,
            ..MemoryRequest::new(MemoryOp::Write, offset, length)
        }
    }

    pub fn flush() -> MemoryRequest {
        MemoryRequest::new(MemoryOp::Flush, 0, 0)
    }

    pub fn trim(offset: u64, length: u32) -> MemoryRequest {
        MemoryRequest::new(MemoryOp::Trim, offset, length)
    }

    pub fn write_zeroes(offset: u64, length: u32, no_hole: bool) -> MemoryRequest {
        MemoryRequest {
            no_hole,
            ..MemoryRequest::new(MemoryOp::WriteZeroes, offset, length)
        }
    }

    pub fn cache(offset: u64, length: u32) -> MemoryRequest {
        MemoryRequest::new(MemoryOp::Cache, offset, length)
    }

    pub fn block_status(offset: u64, length: u32, req_one: bool) -> MemoryRequest {
        MemoryRequest {
            req_one,
            ..MemoryRequest::new(MemoryOp::BlockStatus, offset, length)
        }
    }

    /// The same request with FUA.
    pub fn with_fua(self) -> MemoryRequest {
        MemoryRequest { fua: true, ..self }
    }

    /// The request as the `nbd` crate's checker sees it.
    fn header(&self, cookie: u64) -> nbd::RequestHeader {
        let command = match self.op {
            MemoryOp::Read => consts::NBD_CMD_READ,
            MemoryOp::Write => consts::NBD_CMD_WRITE,
            MemoryOp::Flush => consts::NBD_CMD_FLUSH,
            MemoryOp::Trim => consts::NBD_CMD_TRIM,
            MemoryOp::WriteZeroes => consts::NBD_CMD_WRITE_ZEROES,
            MemoryOp::Cache => consts::NBD_CMD_CACHE,
            MemoryOp::BlockStatus => consts::NBD_CMD_BLOCK_STATUS,
        };
        let mut flags = 0;
        if self.fua {
            flags |= consts::NBD_CMD_FLAG_FUA;
        }
        if self.no_hole {
            flags |= consts::NBD_CMD_FLAG_NO_HOLE;
        }
        if self.req_one {
            flags |= consts::NBD_CMD_FLAG_REQ_ONE;
        }
        nbd::RequestHeader {
            flags,
            command,
            cookie,
            offset: self.offset,
            length: self.length,
        }
    }
}

/// What a request's reply carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryOutcome {
    Done,
    /// A READ's data (a hole reads as zeros).
    Data(Vec<u8>),
    /// BLOCK_STATUS: (length, `NBD_STATE_*` flags) per run, from the request's offset.
    BlockStatus(Vec<(u32, u32)>),
}

/// A request the node answered with an error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{errno:?}: {message}")]
pub struct RequestFailed {
    pub errno: nbd::Errno,
    pub message: &'static str,
}

/// One reply, with the cookie [`MemorySession::send`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub cookie: u64,
    pub result: Result<MemoryOutcome, RequestFailed>,
}

/// Why a client could not attach.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// No volume of that name, or one of another tenant (answered alike, as NBD does).
    #[error("no export named {0:?}")]
    UnknownExport(String),
    #[error("connection refused: {0}")]
    Refused(#[from] Refusal),
    #[error("evicted before it could attach")]
    Evicted,
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("the session is closing")]
    Closing,
    #[error("byte budget: {0}")]
    Budget(#[from] BudgetError),
}

/// An attached in-memory client of one volume.
#[derive(Debug)]
pub struct MemorySession {
    intake: Intake,
    replies: ReplyReceiver,
    limits: nbd::ExportLimits,
    next_cookie: u64,
    /// Completions [`MemorySession::call`] took off the receiver for other requests.
    early: VecDeque<Completion>,
    /// Holds the client's place in the node's connection table until it detaches.
    _admitted: Admitted,
}

/// Attaches a client from `peer` to `export` as `tenant` (`None`: the anonymous tenant, which
/// sees only volumes without a tenant): admitted as a connection from `peer` and counted as
/// transmitting from here on.
pub fn attach(
    store: &Store,
    connections: &Arc<Connections>,
    pipeline: &Arc<Pipeline>,
    peer: SocketAddr,
    export: &str,
    tenant: Option<&str>,
) -> Result<MemorySession, AttachError> {
    let unknown = || AttachError::UnknownExport(export.to_owned());
    let volume = store.open_volume(export).map_err(|_| unknown())?;
    if volume.tenant() != tenant {
        return Err(unknown());
    }
    let admitted = connections.admit(peer)?;
    if !admitted.enter_transmission(volume.name(), tenant) {
        return Err(AttachError::Evicted);
    }
    let limits = nbd::ExportLimits {
        size_bytes: volume.size_bytes(),
        read_only: volume.read_only(),
        max_payload_bytes: pipeline.limits.max_request_bytes,
        // Holes and allocation runs come back typed; nothing to negotiate.
        structured_replies: true,
        allocation_context_id: Some(nbd::BASE_ALLOCATION_CONTEXT_ID),
    };
    let (intake, replies) = Intake::open(pipeline, volume, Some(admitted.shared()));
    Ok(MemorySession {
        intake,
        replies,
        limits,
        next_cookie: 1,
        early: VecDeque::new(),
        _admitted: admitted,
    })
}

impl MemorySession {
    /// Hands `request` to the pipeline and returns its cookie; waits while the client's
    /// request slots or its byte budget are all taken (as an NBD reader would stop reading).
    /// A request the checker refuses is answered with its error like any other.
    pub async fn send(&mut self, request: MemoryRequest) -> Result<u64, SendError> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = request.header(cookie);
        let arrival_ns = self.intake.now_ns();
        let slot = self.intake.request_slot().await.ok_or(SendError::Closing)?;
        let valid = match nbd::validate_request(&header, &self.limits) {
            Ok(valid)
                if request.op != MemoryOp::Write
                    || request.payload.len() == valid.length as usize =>
            {
                valid
            }
            Ok(_) => {
                let answer = (
                    nbd::Errno::Einval,
                    "payload length differs from the request's",
                );
                self.intake
                    .refuse(cookie, header.command, answer, slot, arrival_ns);
                return Ok(cookie);
            }
            Err(rejection) => {
                let answer = (rejection.errno(), rejection.message());
                self.intake
                    .refuse(cookie, header.command, answer, slot, arrival_ns);
                return Ok(cookie);
            }
        };
        let permits = self
            .intake
            .charge(&valid, slot)
            .await?
            .ok_or(SendError::Closing)?;
        let write_payload = match request.op {
            MemoryOp::Write => {
                let mut buffer = self.intake.payload_buffer(valid.length);
                buffer.as_mut_slice().copy_from_slice(&request.payload);
                Some(buffer)
            }
            _ => None,
        };
        self.intake.submit(Submission {
            request: valid,
            permits,
            write_payload,
            sparse_read: true,
            arrival_ns,
        });
        Ok(cookie)
    }

    /// The next reply, in completion order; `None` never while requests are in flight.
    pub async fn next_completion(&mut self) -> Option<Completion> {
        if let Some(early) = self.early.pop_front() {
            return Some(early);
        }
        let reply = self.replies.recv().await?;
        let cookie = reply.cookie;
        let result = match reply.body {
            ReplyBody::Done => Ok(MemoryOutcome::Done),
            ReplyBody::Error(errno, message) => Err(RequestFailed { errno, message }),
            ReplyBody::Data { data, .. } => {
                let copied = data.as_slice().to_vec();
                self.intake.recycle(data);
                Ok(MemoryOutcome::Data(copied))
            }
            ReplyBody::Hole { len, .. } => Ok(MemoryOutcome::Data(vec![0; len as usize])),
            ReplyBody::BlockStatus { extents } => Ok(MemoryOutcome::BlockStatus(extents)),
        };
        // Dropping the rest of the reply (its permits; a READ's buffer went back to the pool
        // above) is delivery: the request no longer holds anything.
        Some(Completion { cookie, result })
    }

    /// Sends `request` and waits for its reply (other requests' replies are kept for
    /// [`MemorySession::next_completion`]).
    pub async fn call(
        &mut self,
        request: MemoryRequest,
    ) -> Result<Result<MemoryOutcome, RequestFailed>, SendError> {
        let cookie = self.send(request).await?;
        let mut others = Vec::new();
        let found = loop {
            let Some(completion) = self.next_completion().await else {
                break Err(SendError::Closing);
            };
            if completion.cookie == cookie {
                break Ok(completion.result);
            }
            others.push(completion);
        };
        self.early.extend(others);
        found
    }

    /// Detaches once every reply in flight has come back (they are dropped unread).
    pub async fn detach(self) {
        let MemorySession {
            intake,
            mut replies,
            _admitted,
            ..
        } = self;
        let account = intake.close();
        while replies.recv().await.is_some() {}
        drop(account);
    }
}
