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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use headroom_store::Volume;
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use super::VhostUserError;
use super::backend::{BlkBackend, DeviceOptions};
use super::queue_state::AttachmentState;
use super::watchdog::{self, WatchdogTotals};
use crate::net_threads::NetThreads;
use crate::pipeline::Pipeline;
use crate::sync::lock;

/// A volume served on a vhost-user socket; [`Attachment::stop`] (or dropping it) ends it.
#[derive(Debug)]
pub struct Attachment {
    path: PathBuf,
    stopping: Arc<AtomicBool>,
    current: Arc<Mutex<Option<Connected>>>,
    connections: Arc<AtomicU64>,
    watchdog: Arc<WatchdogTotals>,
    thread: Option<JoinHandle<()>>,
}

/// The frontend being served: the handle that disconnects it, and its device.
struct Connected {
    shutdown: ShutdownHandle,
    backend: Arc<BlkBackend>,
}

/// `ShutdownHandle` has no `Debug`.
impl std::fmt::Debug for Connected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connected")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// What the accepting thread shares with the [`Attachment`].
struct Shared<'a> {
    stopping: &'a AtomicBool,
    current: &'a Mutex<Option<Connected>>,
    connections: &'a AtomicU64,
    watchdog: &'a Arc<WatchdogTotals>,
}

/// Serves `volume` as a device of `options` on `listener` (already bound at `path`, with its
/// mode and owner, and listening); each queue's tasks on one of `threads` (the node's
/// connection threads) or, without them, on the node's runtime.
pub fn serve(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    pipeline: &Arc<Pipeline>,
    volume: Arc<Volume>,
    options: DeviceOptions,
    threads: Option<Arc<NetThreads>>,
) -> Result<Attachment, VhostUserError> {
    listener
        .set_nonblocking(false)
        .map_err(VhostUserError::Socket)?;
    let stopping = Arc::new(AtomicBool::new(false));
    let current = Arc::new(Mutex::new(None));
    let connections = Arc::new(AtomicU64::new(0));
    let watchdog = Arc::new(WatchdogTotals::default());
    let pipeline = Arc::clone(pipeline);
    let thread = {
        let stopping = Arc::clone(&stopping);
        let current = Arc::clone(&current);
        let connections = Arc::clone(&connections);
        let watchdog = Arc::clone(&watchdog);
        std::thread::Builder::new()
            .name(format!("vhost-user {}", volume.name()))
            .spawn(move || {
                let mut listener = Listener::from(listener);
                let shared = Shared {
                    stopping: &stopping,
                    current: &current,
                    connections: &connections,
                    watchdog: &watchdog,
                };
                accept_loop(&mut listener, &pipeline, &volume, options, threads, &shared)
            })
            .map_err(VhostUserError::Socket)?
    };
    Ok(Attachment {
        path,
        stopping,
        current,
        connections,
        watchdog,
        thread: Some(thread),
    })
}

fn accept_loop(
    listener: &mut Listener,
    pipeline: &Arc<Pipeline>,
    volume: &Arc<Volume>,
    options: DeviceOptions,
    threads: Option<Arc<NetThreads>>,
    shared: &Shared<'_>,
) {
    while !shared.stopping.load(Ordering::Acquire) {
        let backend = Arc::new(BlkBackend::new(pipeline, volume, options, threads.as_ref()));
        let queues = Arc::clone(&backend);
        let (stop_watching, watch_stopped) = tokio::sync::oneshot::channel();
        let watching = pipeline.io.runtime.spawn(watchdog::run(
            Arc::clone(&backend),
            Arc::clone(shared.watchdog),
            watch_stopped,
        ));
        let served = serve_one(listener, backend, volume, shared);
        let _ = stop_watching.send(());
        let _ = pipeline.io.runtime.block_on(watching);
        // The daemon and its vring threads are gone; the queues' tasks are stopped and
        // waited for, so that what they hold (the volume, the pipeline, the store) is let go
        // before a stop of the attachment returns.
        for ended in queues.close() {
            let _ = pipeline.io.runtime.block_on(ended);
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
    shared: &Shared<'_>,
) -> bool {
    let Shared {
        stopping, current, ..
    } = shared;
    let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let name = format!("vhost-user {}", volume.name());
    let mut daemon = match VhostUserDaemon::new(name, Arc::clone(&backend), memory) {
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
        *lock(current) = daemon.shutdown_handle().map(|shutdown| Connected {
            shutdown,
            backend: Arc::clone(&backend),
        });
        // A stop between the check above and the handle being stored.
        if stopping.load(Ordering::Acquire) {
            daemon.request_shutdown();
        }
    }
    shared.connections.fetch_add(1, Ordering::Relaxed);
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

    /// The connected frontend's queues, and how many frontends connected so far.
    pub fn state(&self) -> AttachmentState {
        let queues = lock(&self.current)
            .as_ref()
            .map(|connected| connected.backend.queue_states());
        AttachmentState {
            connected: queues.is_some(),
            connections_total: self.connections.load(Ordering::Relaxed),
            watchdog_pops_total: self.watchdog.pops.load(Ordering::Relaxed),
            watchdog_signals_total: self.watchdog.signals.load(Ordering::Relaxed),
            queues: queues.unwrap_or_default(),
        }
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
            handle.shutdown.shutdown();
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
