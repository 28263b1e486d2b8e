//! The NBD Unix socket's file: checked before anything is touched, a stale one replaced,
//! anything else refused, its mode and owner in place before the first client can connect,
//! and removed again when the node stops.
//!
//! Why each rule:
//! - A path that exists and is not a socket (a disk image, a config file, a symlink) is
//!   refused, never unlinked: a typo in `nbd_unix` must not delete an operator's file.
//! - A socket some process still listens on is refused too (a `connect` to it succeeds):
//!   taking it over would silently cut a running server's clients off from new connections.
//!   A socket nobody listens on (`ECONNREFUSED`) is what a server that crashed or was killed
//!   leaves behind, and is replaced, so a restart after a crash needs no hand.
//! - The owner and group are checked first: a server that is not root can give the socket
//!   to itself and its own groups only, and saying so before binding leaves nothing behind.
//! - The socket is bound, then given its mode and owner, and only then listens: until
//!   `listen`, a `connect` is refused, so no client ever reaches it under the umask's mode.
//! - At a clean stop the file is removed only if it is still the one this node bound (same
//!   device and inode): a second server that replaced it keeps its socket.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::{UnixListener, UnixSocket};

use crate::config::UnixSocketConfig;

/// Connections a Unix socket may hold queued before `accept` (as the TCP listener's).
const BACKLOG: u32 = 1024;

/// Why the Unix socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum UnixSocketError {
    #[error(
        "{path} exists and is not a socket: refusing to replace it (server.nbd_unix names \
         a path for the server's socket; remove the file yourself if it is yours to remove)"
    )]
    NotASocket { path: PathBuf },
    #[error("{path} is a socket another process is listening on: refusing to take it over")]
    InUse { path: PathBuf },
    #[error("{path}: its directory {dir} does not exist or is not a directory")]
    NoDirectory { path: PathBuf, dir: PathBuf },
    #[error(
        "server.nbd_unix_owner: giving the socket to uid {uid} needs root (CAP_CHOWN); this \
         server runs as uid {euid}"
    )]
    Owner { uid: u32, euid: u32 },
    #[error(
        "server.nbd_unix_owner: giving the socket to group {gid} needs root or membership of \
         that group; this server runs as uid {euid} and is not a member"
    )]
    Group { gid: u32, euid: u32 },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> UnixSocketError {
    let path = path.to_path_buf();
    move |source| UnixSocketError::Io { what, path, source }
}

/// The socket file this node bound; dropping it removes the file if it is still that one.
#[derive(Debug)]
pub(super) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) if meta.dev() == self.dev && meta.ino() == self.ino => {
                match std::fs::remove_file(&self.path) {
                    Ok(()) => tracing::info!("removed the NBD socket {}", self.path.display()),
                    Err(err) => tracing::warn!(
                        "could not remove the NBD socket {}: {err}",
                        self.path.display()
                    ),
                }
            }
            Ok(_) => tracing::info!(
                "left {} in place: it is no longer the socket this server bound",
                self.path.display()
            ),
            Err(_) => {}
        }
    }
}

/// Whether the owner and group asked for can be given, and what lies at the path: nothing,
/// a stale socket (`true`: to be replaced), or an error. Touches nothing.
pub(super) async fn check(config: &UnixSocketConfig) -> Result<bool, UnixSocketError> {
    check_owner(config.uid, config.gid)?;
    let path = &config.path;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(UnixSocketError::NoDirectory {
            path: path.clone(),
            dir,
        });
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(io("inspecting", path)(err)),
    };
    if !meta.file_type().is_socket() {
        return Err(UnixSocketError::NotASocket { path: path.clone() });
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(_) => Err(UnixSocketError::InUse { path: path.clone() }),
        Err(err) if err.kind() == ErrorKind::ConnectionRefused => Ok(true),
        // A full backlog (EAGAIN) means a live listener as well; anything else we cannot
        // read as stale.
        Err(err) if err.kind() == ErrorKind::WouldBlock => {
            Err(UnixSocketError::InUse { path: path.clone() })
        }
        Err(err) => Err(io("probing the existing socket", path)(err)),
    }
}

/// The ownership rule of `chown(2)` for a process without `CAP_CHOWN`: itself as owner, one
/// of its own groups as group.
fn check_owner(uid: Option<u32>, gid: Option<u32>) -> Result<(), UnixSocketError> {
    let euid = rustix::process::geteuid().as_raw();
    let egid = rustix::process::getegid().as_raw();
    let groups: Vec<u32> = rustix::process::getgroups()
        .unwrap_or_default()
        .iter()
        .map(|g| g.as_raw())
        .collect();
    owner_allowed(
        uid,
        gid,
        Credentials {
            euid,
            egid,
            groups: &groups,
        },
    )
}

/// Who the server runs as.
#[derive(Clone, Copy, Debug)]
struct Credentials<'a> {
    euid: u32,
    egid: u32,
    groups: &'a [u32],
}

fn owner_allowed(
    uid: Option<u32>,
    gid: Option<u32>,
    us: Credentials<'_>,
) -> Result<(), UnixSocketError> {
    let euid = us.euid;
    if euid == 0 {
        return Ok(());
    }
    if let Some(uid) = uid
        && uid != euid
    {
        return Err(UnixSocketError::Owner { uid, euid });
    }
    if let Some(gid) = gid
        && gid != us.egid
        && !us.groups.contains(&gid)
    {
        return Err(UnixSocketError::Group { gid, euid });
    }
    Ok(())
}

/// Checks (`check`), replaces a stale socket, binds, sets the mode and owner, then listens.
pub(super) async fn bind(
    config: &UnixSocketConfig,
) -> Result<(UnixListener, SocketFile), UnixSocketError> {
    let path = &config.path;
    if check(config).await? {
        std::fs::remove_file(path).map_err(io("removing the stale socket", path))?;
        tracing::info!("replaced the stale NBD socket {}", path.display());
    }
    let socket = UnixSocket::new_stream().map_err(io("creating a socket for", path))?;
    socket.bind(path).map_err(io("binding", path))?;
    let meta = std::fs::symlink_metadata(path).map_err(io("inspecting", path))?;
    // From here on an error removes the file again (the guard's drop).
    let file = SocketFile {
        path: path.clone(),
        dev: meta.dev(),
        ino: meta.ino(),
    };
    if let Some(mode) = config.mode {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(io("setting the mode of", path))?;
    }
    if config.uid.is_some() || config.gid.is_some() {
        std::os::unix::fs::lchown(path, config.uid, config.gid)
            .map_err(io("setting the owner of", path))?;
    }
    let listener = socket.listen(BACKLOG).map_err(io("listening on", path))?;
    Ok((listener, file))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn config(path: &Path) -> UnixSocketConfig {
        UnixSocketConfig {
            path: path.to_path_buf(),
            ..UnixSocketConfig::default()
        }
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        // A socket nobody listens on any more: what a killed server leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let (listener, file) = bind(&config(&path)).await.expect("stale socket replaced");
        // Now it is live: a second server must not take it over.
        let err = bind(&config(&path)).await.unwrap_err();
        assert!(matches!(err, UnixSocketError::InUse { .. }), "{err}");
        assert!(path.exists(), "the live socket stays");
        drop(listener);
        drop(file);
        assert!(!path.exists(), "removed when the node is done with it");
    }

    #[tokio::test]
    async fn a_path_that_is_not_a_socket_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        std::fs::write(&image, b"precious").unwrap();
        let err = bind(&config(&image)).await.unwrap_err();
        assert!(matches!(err, UnixSocketError::NotASocket { .. }), "{err}");
        assert!(err.to_string().contains("is not a socket"), "{err}");
        assert_eq!(std::fs::read(&image).unwrap(), b"precious");
        // A symlink to a stale socket is not followed either.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&stale, &link).unwrap();
        let err = bind(&config(&link)).await.unwrap_err();
        assert!(matches!(err, UnixSocketError::NotASocket { .. }), "{err}");
        assert!(link.symlink_metadata().is_ok() && stale.exists());
        // A missing directory is named.
        let err = bind(&config(&dir.path().join("no/such/dir.sock")))
            .await
            .unwrap_err();
        assert!(matches!(err, UnixSocketError::NoDirectory { .. }), "{err}");
    }

    #[tokio::test]
    async fn the_mode_and_owner_are_set_before_clients_can_connect() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let euid = rustix::process::geteuid().as_raw();
        let egid = rustix::process::getegid().as_raw();
        let mut wanted = config(&path);
        wanted.mode = Some(0o660);
        // Root may give the socket away; anyone else may give it to themselves.
        let (uid, gid) = if euid == 0 {
            (64_055, 64_056)
        } else {
            (euid, egid)
        };
        wanted.uid = Some(uid);
        wanted.gid = Some(gid);
        let (_listener, _file) = bind(&wanted).await.unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o777, 0o660);
        assert_eq!((meta.uid(), meta.gid()), (uid, gid));
    }

    #[test]
    fn an_owner_the_server_cannot_give_is_refused() {
        let user = Credentials {
            euid: 1000,
            egid: 1000,
            groups: &[1000, 64_055],
        };
        assert!(owner_allowed(Some(1000), Some(64_055), user).is_ok());
        assert!(owner_allowed(None, Some(1000), user).is_ok());
        let err = owner_allowed(Some(0), None, user).unwrap_err();
        assert!(
            matches!(err, UnixSocketError::Owner { uid: 0, euid: 1000 }),
            "{err}"
        );
        let err = owner_allowed(None, Some(4), user).unwrap_err();
        assert!(
            matches!(err, UnixSocketError::Group { gid: 4, .. }),
            "{err}"
        );
        // Root may give it to anyone.
        let root = Credentials {
            euid: 0,
            egid: 0,
            groups: &[],
        };
        assert!(owner_allowed(Some(12_345), Some(54_321), root).is_ok());
    }

    #[tokio::test]
    async fn a_refused_owner_leaves_a_stale_socket_untouched() {
        let euid = rustix::process::geteuid().as_raw();
        if euid == 0 {
            // Root may give the socket to anyone; `owner_allowed` covers the refusal.
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let before = std::fs::symlink_metadata(&path).unwrap().ino();
        let mut wanted = config(&path);
        wanted.uid = Some(euid + 1);
        let err = bind(&wanted).await.unwrap_err();
        assert!(matches!(err, UnixSocketError::Owner { .. }), "{err}");
        assert_eq!(std::fs::symlink_metadata(&path).unwrap().ino(), before);
    }
}
