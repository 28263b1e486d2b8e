//! The node's vhost-user attachments: which volume is served on which socket, made and
//! ended by the operator (`POST`/`DELETE /v1/volumes/{name}/attachments`), kept with the
//! volume's record in the store and made again when the node starts.
//!
//! Why with the volume's record: an attachment is a property of the volume an operator set,
//! like its QoS, so it survives a restart and goes away with the volume; the store keeps it
//! as opaque JSON (`Store::set_volume_attachments`), as it keeps the QoS. Why the socket is
//! bound through a [`SocketBinder`] the node hands in: the rules of a socket file (refuse what
//! is not a socket and never unlink it, replace a stale one, set the mode and owner before
//! `listen`) are the node's, shared with the NBD Unix socket (`crates/node/src/server/vhost_socket.rs`), and this
//! layer must not name the node's. Every input is checked before anything is touched: the
//! volume exists, the path is absolute, well formed and not attached already, the queue count is in
//! range, the owner can be given (the binder's check).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use headroom_store::Store;
use serde::{Deserialize, Serialize};

use super::backend::DeviceOptions;
use super::listener::{Attachment, serve};
use super::queue_state::AttachmentState;
use super::{MAX_NUM_QUEUES, MAX_POLL_US, VhostUserError};
use crate::net_threads::NetThreads;
use crate::pipeline::Pipeline;
use crate::sync::lock;

/// One attachment as asked for, stored and shown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttachmentSpec {
    /// The vhost-user socket's path.
    #[schema(value_type = String)]
    pub vhost_user: PathBuf,
    /// Virtqueues offered (1 to 16; default 1).
    #[serde(default = "one_queue")]
    pub num_queues: u16,
    /// The socket file's permission bits; absent: what the umask leaves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// The socket file's owner and group; absent: the server's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Adaptive polling: the longest a queue keeps looking at its ring after draining it
    /// before it asks the driver for kicks again, µs (0 to 1,000; absent or 0: event mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_us: Option<u32>,
}

fn one_queue() -> u16 {
    1
}

/// A socket bound, with its mode and owner, and listening; `guard` removes the file when
/// dropped (if it is still the one bound).
#[derive(Debug)]
pub struct BoundSocket {
    pub listener: std::os::unix::net::UnixListener,
    pub guard: Box<dyn std::fmt::Debug + Send + Sync>,
}

/// A boxed error of the node's socket rules.
pub type BindError = Box<dyn std::error::Error + Send + Sync>;

/// How the node binds a socket file: its rules, not this layer's.
pub trait SocketBinder: Send + Sync + std::fmt::Debug {
    /// Checks `spec`'s path, mode and owner and touches nothing if they are refused.
    fn check<'a>(
        &'a self,
        spec: &'a AttachmentSpec,
    ) -> Pin<Box<dyn Future<Output = Result<(), BindError>> + Send + 'a>>;
    /// Binds `spec`'s socket: a stale one replaced, anything else at the path refused.
    fn bind<'a>(
        &'a self,
        spec: &'a AttachmentSpec,
    ) -> Pin<Box<dyn Future<Output = Result<BoundSocket, BindError>> + Send + 'a>>;
}

/// Why an attachment could not be made or ended.
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    #[error("no volume named {0:?}")]
    UnknownVolume(String),
    #[error("num_queues {0}: must be 1 to {MAX_NUM_QUEUES}")]
    NumQueues(u16),
    #[error("poll_us {0}: must be 0 to {MAX_POLL_US}")]
    PollUs(u32),
    #[error(
        "{0}: the socket's path must be absolute (a relative one would name a file in the server's working directory)"
    )]
    RelativePath(PathBuf),
    #[error("{0} is already an attachment of volume {1:?}")]
    Taken(PathBuf, String),
    #[error("volume {0:?} is not attached at {1}")]
    NotAttached(String, PathBuf),
    #[error("{0}")]
    Socket(BindError),
    #[error("{0}")]
    Serve(#[from] VhostUserError),
    #[error("storing the attachment: {0}")]
    Store(#[from] headroom_store::StoreError),
}

/// An attachment being served.
#[derive(Debug)]
struct Live {
    volume: String,
    spec: AttachmentSpec,
    attachment: Attachment,
    _socket: Box<dyn std::fmt::Debug + Send + Sync>,
}

/// Stops an attachment off the runtime's threads: its frontend's last requests complete on
/// them while the accepting thread is joined. The socket file goes after.
async fn stop_live(live: Live) {
    let Live {
        attachment,
        _socket,
        ..
    } = live;
    let stopped = tokio::task::spawn_blocking(move || {
        attachment.stop();
        drop(_socket);
    });
    if stopped.await.is_err() {
        tracing::warn!("vhost-user-blk: stopping an attachment panicked");
    }
}

/// Every attachment of the node.
#[derive(Debug)]
pub struct Attachments {
    store: Arc<Store>,
    pipeline: Arc<Pipeline>,
    binder: Box<dyn SocketBinder>,
    live: Mutex<BTreeMap<PathBuf, Live>>,
    /// The node's connection threads, where every queue's tasks run (`None`: on the node's
    /// runtime). Held until [`Attachments::stop_all`]: the threads end only once nothing
    /// can put a queue on them.
    threads: Mutex<Option<Arc<NetThreads>>>,
    /// One change at a time (a change awaits the binder, so not under `live`'s lock).
    changing: tokio::sync::Mutex<()>,
}

/// A volume's attachments as stored.
fn stored(store: &Store, volume: &str) -> Result<Vec<AttachmentSpec>, AttachmentError> {
    let volume = store
        .open_volume(volume)
        .map_err(|_| AttachmentError::UnknownVolume(volume.to_owned()))?;
    Ok(volume
        .attachments()
        .and_then(|json| serde_json::from_str(&json).ok())
        .unwrap_or_default())
}

impl Attachments {
    /// The node's attachments, none yet. `threads`: the NBD connection threads, which
    /// serve the queues too (BurstCBS's I/O threads; `None` puts them on the node's runtime).
    pub fn new(
        store: Arc<Store>,
        pipeline: Arc<Pipeline>,
        binder: Box<dyn SocketBinder>,
        threads: Option<Arc<NetThreads>>,
    ) -> Self {
        Attachments {
            store,
            pipeline,
            binder,
            live: Mutex::new(BTreeMap::new()),
            threads: Mutex::new(threads),
            changing: tokio::sync::Mutex::new(()),
        }
    }

    /// The attachments being served, of `volume` or of all, and what their frontends are
    /// doing; by path.
    pub fn list(&self, volume: Option<&str>) -> Vec<(String, AttachmentSpec, AttachmentState)> {
        lock(&self.live)
            .values()
            .filter(|live| volume.is_none_or(|v| v == live.volume))
            .map(|live| {
                let state = live.attachment.state();
                (live.volume.clone(), live.spec.clone(), state)
            })
            .collect()
    }

    /// Serves `volume` at `spec`'s socket, listening when this returns, and stores it.
    pub async fn attach(&self, volume: &str, spec: AttachmentSpec) -> Result<(), AttachmentError> {
        let _one = self.changing.lock().await;
        let mut specs = stored(&self.store, volume)?;
        self.start(volume, &spec).await?;
        specs.retain(|s| s.vhost_user != spec.vhost_user);
        specs.push(spec.clone());
        if let Err(err) = self.save(volume, &specs) {
            self.stop(&spec.vhost_user).await;
            return Err(err);
        }
        Ok(())
    }

    /// Stops serving `volume` at `path` (its frontend is disconnected, the socket removed)
    /// and forgets it.
    pub async fn detach(&self, volume: &str, path: &Path) -> Result<(), AttachmentError> {
        let _one = self.changing.lock().await;
        let mut specs = stored(&self.store, volume)?;
        let is_ours = lock(&self.live)
            .get(path)
            .is_some_and(|live| live.volume == volume);
        let was_stored = specs.iter().any(|s| s.vhost_user == path);
        if !is_ours && !was_stored {
            return Err(AttachmentError::NotAttached(
                volume.to_owned(),
                path.to_path_buf(),
            ));
        }
        specs.retain(|s| s.vhost_user != path);
        self.save(volume, &specs)?;
        if is_ours {
            self.stop(path).await;
        }
        Ok(())
    }

    /// Serves every stored attachment (at start); one that fails is logged and stays stored,
    /// so fixing its cause and restarting serves it.
    pub async fn restore(&self) {
        let names: Vec<String> = self
            .store
            .list_volumes()
            .into_iter()
            .map(|v| v.name)
            .collect();
        for name in names {
            let Ok(specs) = stored(&self.store, &name) else {
                continue;
            };
            for spec in specs {
                let _one = self.changing.lock().await;
                if let Err(err) = self.start(&name, &spec).await {
                    tracing::error!(
                        "vhost-user attachment of {name:?} at {}: {err}",
                        spec.vhost_user.display()
                    );
                }
            }
        }
    }

    /// Stops every attachment (at shutdown), keeping them stored, and lets go of the
    /// connection threads (an attachment made after this runs its queues on the runtime).
    pub async fn stop_all(&self) {
        let all = std::mem::take(&mut *lock(&self.live));
        for live in all.into_values() {
            stop_live(live).await;
        }
        lock(&self.threads).take();
    }

    async fn start(&self, volume: &str, spec: &AttachmentSpec) -> Result<(), AttachmentError> {
        if spec.num_queues == 0 || spec.num_queues > MAX_NUM_QUEUES {
            return Err(AttachmentError::NumQueues(spec.num_queues));
        }
        let poll_us = spec.poll_us.unwrap_or(0);
        if poll_us > MAX_POLL_US {
            return Err(AttachmentError::PollUs(poll_us));
        }
        if !spec.vhost_user.is_absolute() {
            return Err(AttachmentError::RelativePath(spec.vhost_user.clone()));
        }
        let opened = self
            .store
            .open_volume(volume)
            .map_err(|_| AttachmentError::UnknownVolume(volume.to_owned()))?;
        if let Some(live) = lock(&self.live).get(&spec.vhost_user) {
            return Err(AttachmentError::Taken(
                spec.vhost_user.clone(),
                live.volume.clone(),
            ));
        }
        self.binder
            .check(spec)
            .await
            .map_err(AttachmentError::Socket)?;
        let bound = self
            .binder
            .bind(spec)
            .await
            .map_err(AttachmentError::Socket)?;
        let attachment = serve(
            bound.listener,
            spec.vhost_user.clone(),
            &self.pipeline,
            opened,
            DeviceOptions {
                num_queues: spec.num_queues,
                poll_us,
            },
            lock(&self.threads).clone(),
        )?;
        tracing::info!(
            "vhost-user-blk: volume {volume:?} attached at {}",
            spec.vhost_user.display()
        );
        lock(&self.live).insert(
            spec.vhost_user.clone(),
            Live {
                volume: volume.to_owned(),
                spec: spec.clone(),
                attachment,
                _socket: bound.guard,
            },
        );
        Ok(())
    }

    async fn stop(&self, path: &Path) {
        let live = lock(&self.live).remove(path);
        if let Some(live) = live {
            tracing::info!(
                "vhost-user-blk: volume {:?} detached from {}",
                live.volume,
                path.display()
            );
            stop_live(live).await;
        }
    }

    fn save(&self, volume: &str, specs: &[AttachmentSpec]) -> Result<(), AttachmentError> {
        let json = match specs {
            [] => None,
            _ => Some(serde_json::to_string(specs).unwrap_or_default()),
        };
        self.store.set_volume_attachments(volume, json)?;
        Ok(())
    }
}
