//! One attachment's socket: a thread that accepts one frontend at a time and runs a
//! vhost-user daemon for it until it disconnects, then waits for the next; and the handle
//! that stops it.
//!
//! Why a frontend at a time: a vhost-user socket is one device, and two drivers of one
//! virtqueue set would corrupt each other's rings. A frontend that reconnects (a restarted
//! QEMU, a guest rebooted by a new process) is served again from the rings' start; the
//! inflight-descriptor protocol that would let it resume requests in flight is not done.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use headroom_store::Volume;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use super::VhostUserError;
use super::backend::{BlkBackend, DeviceOptions};
use crate::pipeline::Pipeline;
use crate::sync::lock;

/// A volume served on a vhost-user socket; [`Attachment::stop`] (or dropping it) ends it.
#[derive(Debug)]
pub struct Attachment {
    path: PathBuf,
    stopping: Arc<AtomicBool>,
    current: Arc<Mutex<Option<ShutdownHandleDebug>>>,
    thread: Option<JoinHandle<()>>,
}

/// `ShutdownHandle` has no `Debug`.
struct ShutdownHandleDebug(ShutdownHandle);

impl std::fmt::Debug for ShutdownHandleDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShutdownHandle")
    }
}

/// Serves `volume` as a device of `options` on `listener` (already bound at `path`, with its
/// mode and owner, and listening).
pub fn serve(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    pipeline: &Arc<Pipeline>,
    volume: Arc<Volume>,
    options: DeviceOptions,
) -> Result<Attachment, VhostUserError> {
    listener
        .set_nonblocking(false)
        .map_err(VhostUserError::Socket)?;
    let stopping = Arc::new(AtomicBool::new(false));
    let current = Arc::new(Mutex::new(None));
    let pipeline = Arc::clone(pipeline);
    let thread = {
        let stopping = Arc::clone(&stopping);
        let current = Arc::clone(&current);
        std::thread::Builder::new()
            .name(format!("vhost-user {}", volume.name()))
            .spawn(move || {
                let mut listener = Listener::from(listener);
                accept_loop(
                    &mut listener,
                    &pipeline,
                    &volume,
                    options,
                    &stopping,
                    &current,
                )
            })
            .map_err(VhostUserError::Socket)?
    };
    Ok(Attachment {
        path,
        stopping,
        current,
        thread: Some(thread),
    })
}

fn accept_loop(
    listener: &mut Listener,
    pipeline: &Arc<Pipeline>,
    volume: &Arc<Volume>,
    options: DeviceOptions,
    stopping: &AtomicBool,
    current: &Mutex<Option<ShutdownHandleDebug>>,
) {
    while !stopping.load(Ordering::Acquire) {
        let backend = Arc::new(BlkBackend::new(pipeline, volume, options));
        let queues = Arc::clone(&backend);
        let served = serve_one(listener, backend, volume, stopping, current);
        // The daemon and its vring threads are gone; the queues' tasks are stopped and
        // waited for, so that what they hold (the volume, the pipeline, the store) is let go
        // before a stop of the attachment returns.
        for tasks in queues.close() {
            let _ = pipeline.io.runtime.block_on(tasks);
        }
        if !served {
            return;
        }
    }
}

/// Accepts one frontend on `listener` and serves it with `backend` until it leaves or the
/// attachment stops; `false` if the daemon could not even be made (nothing more to try).
fn serve_one(
    listener: &mut Listener,
    backend: Arc<BlkBackend>,
    volume: &Arc<Volume>,
    stopping: &AtomicBool,
    current: &Mutex<Option<ShutdownHandleDebug>>,
) -> bool {
    let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let name = format!("vhost-user {}", volume.name());
    let mut daemon = match VhostUserDaemon::new(name, backend, memory) {
        Ok(daemon) => daemon,
        Err(err) => {
            tracing::error!("vhost-user-blk {}: {err}", volume.name());
            return false;
        }
    };
    if let Err(err) = daemon.start(listener) {
        tracing::warn!(
            "vhost-user-blk {}: accepting a frontend: {err}",
            volume.name()
        );
        return true;
    }
    if stopping.load(Ordering::Acquire) {
        daemon.request_shutdown();
    } else {
        *lock(current) = daemon.shutdown_handle().map(ShutdownHandleDebug);
        // A stop between the check above and the handle being stored.
        if stopping.load(Ordering::Acquire) {
            daemon.request_shutdown();
        }
    }
    tracing::info!("vhost-user-blk {}: a frontend connected", volume.name());
    if let Err(err) = daemon.wait() {
        tracing::info!("vhost-user-blk {}: the frontend left: {err}", volume.name());
    }
    *lock(current) = None;
    true
}

impl Attachment {
    /// The socket's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Disconnects the frontend, if one is connected, stops accepting and waits for the
    /// accepting thread. Blocking.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.signal_stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Disconnects the frontend and wakes the accepting thread, which then ends.
    fn signal_stop(&self) {
        self.stopping.store(true, Ordering::Release);
        if let Some(handle) = lock(&self.current).as_ref() {
            handle.0.shutdown();
        }
        // Wakes an `accept` with nobody connecting; the loop sees `stopping` and ends.
        let _ = UnixStream::connect(&self.path);
    }
}

impl Drop for Attachment {
    /// Dropped without [`Attachment::stop`] (a node dropped without its shutdown): the thread
    /// is told to end but not waited for, since a drop may run on a thread the frontend's
    /// last requests need.
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.signal_stop();
        }
    }
}
