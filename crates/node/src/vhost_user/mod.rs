//! vhost-user-blk: a third transport beside NBD and the in-memory one. A volume attached to
//! a Unix socket is a virtio-blk device that QEMU (or any vhost-user frontend) drives
//! directly in the guest's memory: no NBD framing, no copy through a socket for the data.
//!
//! Why it is a transport and nothing more: each virtqueue is a client of the pipeline
//! (`crate::pipeline::Intake`), and each virtio-blk request is translated into the `nbd`
//! crate's request and validated by its checker, so the same request slots, byte budget,
//! scheduler, QoS, statistics and audit apply as to every NBD client of the volume
//! (docs/ARCHITECTURE.md, decisions 52 and 62). What is its own:
//! - `wire`: the virtio-blk feature bits, statuses and config space;
//! - `request`: a descriptor chain read into a request, every bound checked;
//! - `backend`: the device rust-vmm's vhost-user framework drives (features, queues, kicks);
//! - `poll`: the adaptive polling window a queue spins in before it asks for kicks again;
//! - `queue`: one virtqueue's submitter and completer tasks over its `Intake`;
//! - `queue_state`: what each queue is doing now (ring indices, in flight, kicks, signals),
//!   shown with the attachment;
//! - `watchdog`: a look at every ring ten times a second that moves a stuck queue on (a
//!   lost kick, a lost interrupt, the framework's worker gone);
//! - `used_order`: chains returned used in the order they were popped (what makes a restart
//!   of the node safe for a running guest);
//! - `listener`: the socket's accepting thread and the handle that stops it;
//! - `attachments`: which volume is on which socket, stored with the volume, restored at
//!   start.
//!
//! The socket file (checked, bound, given its mode and owner) is the node's business
//! (`crates/node/src/server/vhost_socket.rs`), as the NBD Unix socket's is; this module takes a listening socket
//! from the node's [`SocketBinder`].

mod attachments;
mod backend;
mod listener;
mod poll;
mod queue;
mod queue_state;
mod request;
mod used_order;
mod watchdog;
mod wire;

pub use attachments::{
    AttachmentError, AttachmentSpec, Attachments, BindError, BoundSocket, SocketBinder,
};
pub use backend::{DeviceOptions, MAX_QUEUE_SIZE, MAX_RANGE_BYTES};
pub use listener::{Attachment, serve};
pub use poll::MAX_POLL_US;
pub use queue_state::{AttachmentState, QueueState};

/// Most queues one attachment may offer.
pub const MAX_NUM_QUEUES: u16 = 16;

/// Why a volume could not be served on a vhost-user socket.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("the vhost-user socket: {0}")]
    Socket(std::io::Error),
}
