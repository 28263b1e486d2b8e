//! Which paths `device add` may take into the pool, and how they are checked and opened
//! before anything is written there.
//!
//! Why: adding a device punches it whole and then writes volumes' data on it. Given the wrong
//! path — a mounted partition, a database, the pool's own `meta.redb`, a character device
//! such as a watchdog that acts when opened — that destroys data or does harm no one asked
//! for. So a device is added only on purpose:
//!
//! - a regular file under a directory the configuration allows (`device_dirs`; default
//!   `DATA_DIR/devices/`), created there when it does not exist; or a block device the
//!   configuration names (`block_devices`). Nothing else, and nothing of `DATA_DIR` outside
//!   `devices/`. Paths are compared after canonicalising the parent directory (which must
//!   exist: none is created) and the allowed directories, so `..` and symlinked components
//!   cannot lead outside them;
//! - the type is checked with `lstat` before anything is opened: a symlink, directory,
//!   character device, FIFO or socket is refused without being opened. Files are opened with
//!   `O_NOFOLLOW` (and checked to be the file `lstat` saw), block devices with `O_EXCL`, so a
//!   mounted or otherwise claimed disk is refused (`EBUSY`);
//! - it must hold nothing Headroom did not write: no filesystem, partition, volume manager,
//!   swap, encryption or Headroom signature (`signature::foreign_signature`) and no non-zero
//!   byte — a file's allocated ranges are read whole (`SEEK_DATA`/`SEEK_HOLE`), a block
//!   device's first and last `BLOCK_EDGE_BYTES` and `BLOCK_SAMPLES` samples of
//!   `BLOCK_SAMPLE_BYTES` spread over it — unless the operator says `force`. A device that
//!   carries this pool's own signature is refused even then;
//! - errors about paths outside the allowed places are one text, whether the path exists or
//!   not, and say nothing of its size or type.
//!
//! The size caps (`max_device_bytes`, `max_volume_bytes`) live here too: the policy is the
//! operator's statement of what the node may take.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{OFlags, SeekFrom};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::layout::{EXTENT_SIZE_BYTES, MAX_VOLUME_SIZE_BYTES, VOLUME_SIZE_ALIGN_BYTES};
use crate::signature::{PROBE_LEN, Signature, foreign_signature};

/// Default largest device `device add` takes: 64 TiB.
pub const DEFAULT_MAX_DEVICE_BYTES: u64 = 64 << 40;
/// Bytes read at each end of a block device when looking for data on it.
pub const BLOCK_EDGE_BYTES: u64 = 4 << 20;
/// Samples read spread over a block device between its ends.
pub const BLOCK_SAMPLES: u64 = 64;
/// Bytes of each sample.
pub const BLOCK_SAMPLE_BYTES: u64 = 64 << 10;
/// Read size of the content scan.
const SCAN_CHUNK_BYTES: usize = 1 << 20;

/// What the node may take as devices and how large volumes and devices may be
/// (`[storage] device_dirs`, `block_devices`, `max_device_bytes`, `max_volume_bytes`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionPolicy {
    /// Directories whose regular files `device add` may use or create (subdirectories
    /// included); empty: `DATA_DIR/devices/` only.
    #[serde(default)]
    pub device_dirs: Vec<PathBuf>,
    /// Block devices `device add` may use, by the path the operator will name (a stable name
    /// such as `/dev/disk/by-id/...` is best); the same device by another name is accepted.
    #[serde(default)]
    pub block_devices: Vec<PathBuf>,
    /// Largest device `device add` takes, bytes.
    pub max_device_bytes: u64,
    /// Largest volume that may be created or grown to, bytes (at most 64 TiB).
    pub max_volume_bytes: u64,
}

impl Default for AdmissionPolicy {
    fn default() -> Self {
        AdmissionPolicy {
            device_dirs: Vec::new(),
            block_devices: Vec::new(),
            max_device_bytes: DEFAULT_MAX_DEVICE_BYTES,
            max_volume_bytes: MAX_VOLUME_SIZE_BYTES,
        }
    }
}

impl AdmissionPolicy {
    /// Each entry an absolute UTF-8 path; devices of at least two extents (one holds the
    /// signature); volumes between the size alignment and 64 TiB. The keys are the
    /// configuration file's.
    pub fn validate(&self) -> Result<(), InvalidPolicy> {
        for (key, paths) in [
            ("storage.device_dirs", &self.device_dirs),
            ("storage.block_devices", &self.block_devices),
        ] {
            for path in paths {
                if !path.is_absolute() || path.to_str().is_none_or(|p| p.contains('\0')) {
                    return Err(InvalidPolicy {
                        key,
                        value: path.display().to_string(),
                        allowed: "each entry must be an absolute UTF-8 path".to_string(),
                    });
                }
            }
        }
        let least_device = 2 * EXTENT_SIZE_BYTES;
        if self.max_device_bytes < least_device {
            return Err(InvalidPolicy {
                key: "storage.max_device_bytes",
                value: self.max_device_bytes.to_string(),
                allowed: format!(
                    "must be at least {least_device} (two extents, one for the signature)"
                ),
            });
        }
        if !(VOLUME_SIZE_ALIGN_BYTES..=MAX_VOLUME_SIZE_BYTES).contains(&self.max_volume_bytes) {
            return Err(InvalidPolicy {
                key: "storage.max_volume_bytes",
                value: self.max_volume_bytes.to_string(),
                allowed: format!(
                    "must be between {VOLUME_SIZE_ALIGN_BYTES} and {MAX_VOLUME_SIZE_BYTES} (64 TiB)"
                ),
            });
        }
        Ok(())
    }
}

/// An admission policy value out of range: the key as the configuration file writes it, the
/// value, what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{key} = {value}: {allowed}")]
pub struct InvalidPolicy {
    pub key: &'static str,
    pub value: String,
    pub allowed: String,
}

/// Why a path was not taken.
#[derive(Debug, Error)]
pub(crate) enum AdmissionError {
    /// Refused; the text says why (and never whether a path outside the allowed places
    /// exists).
    #[error("{0}")]
    Refused(String),
    /// The path is a device of the pool already.
    #[error("{0}")]
    AlreadyInPool(String),
}

fn refused(reason: impl Into<String>) -> AdmissionError {
    AdmissionError::Refused(reason.into())
}

/// A device that passed every check, opened read-write.
#[derive(Debug)]
pub(crate) struct Admitted {
    pub file: File,
    /// The path to record: the canonical file for files, the path as named for block devices.
    pub path: PathBuf,
    pub capacity_bytes: u64,
    pub is_block: bool,
    /// A new file was created (its directory needs a sync).
    pub created: bool,
}

/// What `admit` needs to know besides the request.
#[derive(Debug)]
pub(crate) struct AdmissionContext<'a> {
    pub policy: &'a AdmissionPolicy,
    pub data_dir: &'a Path,
    /// Canonical paths of the pool's devices.
    pub existing: &'a [PathBuf],
    /// This pool's id (a signature of it is refused even with `force`).
    pub pool_id: u64,
}

/// `path` with `.` and `..` resolved by text alone (for an error text about a missing
/// parent inside an allowed directory; never used to open anything).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

impl AdmissionContext<'_> {
    /// The allowed directories as given (absolute).
    fn allowed_dirs(&self) -> Vec<PathBuf> {
        if self.policy.device_dirs.is_empty() {
            vec![self.data_dir.join("devices")]
        } else {
            self.policy.device_dirs.clone()
        }
    }

    fn not_allowed(&self) -> AdmissionError {
        let dirs: Vec<String> = self
            .allowed_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        refused(format!(
            "not a file in a device directory ({}) nor a block device named in [storage] \
             block_devices",
            dirs.join(", ")
        ))
    }

    /// Checks `request` and opens it (see the module comment). `capacity_bytes` sizes a file
    /// that is created or empty.
    pub(crate) fn admit(
        &self,
        request: &Path,
        capacity_bytes: u64,
        force: bool,
    ) -> Result<Admitted, AdmissionError> {
        let abs = std::path::absolute(request).map_err(|_| self.not_allowed())?;
        if let Some(named) = self.named_block_device(&abs) {
            return self.admit_block_device(&abs, &named, force);
        }
        self.admit_file(&abs, capacity_bytes, force)
    }

    /// The canonical target of `abs` if the configuration names it as a block device (by
    /// this path, or another path to the same node).
    fn named_block_device(&self, abs: &Path) -> Option<PathBuf> {
        let target = std::fs::canonicalize(abs).ok();
        for listed in &self.policy.block_devices {
            let listed_abs = std::path::absolute(listed).ok()?;
            let listed_target = std::fs::canonicalize(&listed_abs).ok();
            if listed_abs == abs || (target.is_some() && listed_target == target) {
                return Some(target.unwrap_or(listed_abs));
            }
        }
        None
    }

    fn admit_block_device(
        &self,
        abs: &Path,
        target: &Path,
        force: bool,
    ) -> Result<Admitted, AdmissionError> {
        let shown = abs.display();
        let md = std::fs::symlink_metadata(target)
            .map_err(|e| refused(format!("{shown} (named in block_devices): {e}")))?;
        if !md.file_type().is_block_device() {
            return Err(refused(format!(
                "{shown} is named in block_devices but is not a block device ({})",
                kind_of(&md)
            )));
        }
        if self.existing.iter().any(|p| p == target || p == abs) {
            return Err(AdmissionError::AlreadyInPool(shown.to_string()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags(OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC))
            .open(target)
            .map_err(|e| {
                if e.raw_os_error() == Some(Errno::BUSY.raw_os_error()) {
                    refused(format!(
                        "{shown} is in use (mounted, a member of a RAID or LVM volume, or \
                         opened exclusively by another program): EBUSY"
                    ))
                } else {
                    refused(format!("{shown}: {e}"))
                }
            })?;
        let capacity = rustix::fs::seek(&file, SeekFrom::End(0))
            .map_err(|e| refused(format!("{shown}: its size: {e}")))?;
        self.check_size(abs, capacity)?;
        self.check_content(&file, abs, capacity, true, force)?;
        Ok(Admitted {
            file,
            path: abs.to_path_buf(),
            capacity_bytes: capacity,
            is_block: true,
            created: false,
        })
    }

    fn admit_file(
        &self,
        abs: &Path,
        capacity_bytes: u64,
        force: bool,
    ) -> Result<Admitted, AdmissionError> {
        let name = match abs.components().next_back() {
            Some(Component::Normal(name)) => name.to_owned(),
            _ => return Err(self.not_allowed()),
        };
        let allowed: Vec<PathBuf> = self
            .allowed_dirs()
            .iter()
            .filter_map(|d| std::fs::canonicalize(d).ok())
            .collect();
        let parent = abs.parent().ok_or_else(|| self.not_allowed())?;
        let parent = match std::fs::canonicalize(parent) {
            Ok(p) => p,
            Err(_) => {
                // Say that the directory is missing only when it would be inside an allowed
                // one; outside, a missing path reads like an existing one.
                let wanted = lexical(parent);
                if self
                    .allowed_dirs()
                    .iter()
                    .any(|d| wanted.starts_with(lexical(d)))
                {
                    return Err(refused(format!(
                        "the directory {} does not exist (device add creates no directory)",
                        wanted.display()
                    )));
                }
                return Err(self.not_allowed());
            }
        };
        if !allowed.iter().any(|d| parent.starts_with(d)) {
            return Err(self.not_allowed());
        }
        if let Ok(data) = std::fs::canonicalize(self.data_dir)
            && parent.starts_with(&data)
            && !parent.starts_with(data.join("devices"))
        {
            return Err(refused(format!(
                "{} is in the data directory, whose files are the pool's own; only its \
                 devices/ directory holds device files",
                abs.display()
            )));
        }
        let path = parent.join(&name);
        let shown = path.display().to_string();
        if self.existing.contains(&path) {
            return Err(AdmissionError::AlreadyInPool(shown));
        }
        let nofollow = flags(OFlags::NOFOLLOW | OFlags::CLOEXEC);
        let md = match std::fs::symlink_metadata(&path) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .custom_flags(nofollow)
                    .open(&path)
                    .map_err(|e| refused(format!("creating {shown}: {e}")))?;
                file.set_len(capacity_bytes)
                    .map_err(|e| refused(format!("sizing {shown}: {e}")))?;
                return Ok(Admitted {
                    file,
                    path,
                    capacity_bytes,
                    is_block: false,
                    created: true,
                });
            }
            Err(e) => return Err(refused(format!("{shown}: {e}"))),
        };
        let ft = md.file_type();
        if ft.is_block_device() {
            return Err(refused(format!(
                "{shown} is a block device not named in [storage] block_devices"
            )));
        }
        if !ft.is_file() {
            return Err(refused(format!(
                "{shown} is {}: only a regular file or a configured block device is a device \
                 (it was not opened)",
                kind_of(&md)
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nofollow)
            .open(&path)
            .map_err(|e| refused(format!("{shown}: {e}")))?;
        let now = file
            .metadata()
            .map_err(|e| refused(format!("{shown}: {e}")))?;
        if now.dev() != md.dev() || now.ino() != md.ino() || !now.file_type().is_file() {
            return Err(refused(format!("{shown} changed while it was checked")));
        }
        let mut capacity = now.len();
        if capacity == 0 {
            self.check_size(&path, capacity_bytes)?;
            file.set_len(capacity_bytes)
                .map_err(|e| refused(format!("sizing {shown}: {e}")))?;
            capacity = capacity_bytes;
        } else {
            self.check_size(&path, capacity)?;
            self.check_content(&file, &path, capacity, false, force)?;
        }
        Ok(Admitted {
            file,
            path,
            capacity_bytes: capacity,
            is_block: false,
            created: false,
        })
    }

    fn check_size(&self, path: &Path, capacity: u64) -> Result<(), AdmissionError> {
        if capacity > self.policy.max_device_bytes {
            return Err(refused(format!(
                "{} is {capacity} bytes, larger than the {} bytes of [storage] \
                 max_device_bytes",
                path.display(),
                self.policy.max_device_bytes
            )));
        }
        Ok(())
    }

    /// Refuses a device that holds a signature or data (see the module comment).
    fn check_content(
        &self,
        file: &File,
        path: &Path,
        capacity: u64,
        is_block: bool,
        force: bool,
    ) -> Result<(), AdmissionError> {
        let shown = path.display();
        let io_err = |e: io::Error| refused(format!("reading {shown}: {e}"));
        let probe = capacity.min(PROBE_LEN as u64) as usize;
        let mut head = vec![0u8; probe];
        file.read_exact_at(&mut head, 0).map_err(io_err)?;
        // A signature of this pool naming one of its devices: that device under another
        // name.
        if let Ok(sig) = Signature::decode(&head)
            && sig.pool_id == self.pool_id
            && (sig.device_id as usize) < self.existing.len()
        {
            return Err(refused(format!(
                "{shown} carries the signature of device {} of this pool: it is in the pool \
                 already (under another name?)",
                sig.device_id
            )));
        }
        if force {
            return Ok(());
        }
        // This pool's signature naming the device being added (the next id): an add of this
        // very device that stopped (a crash, an error) after it signed the device and before
        // its record was committed. Nothing was allocated on it, and past its reserved
        // extent it holds what the add's punch left, zeros; so it is taken back without
        // `force`, and a `device add` retried after a crash works. Any data past the reserved
        // extent is still refused. (One naming another id the pool does not have needs
        // `force`, like any other signature.)
        let own_leftover = matches!(
            Signature::decode(&head),
            Ok(sig) if sig.pool_id == self.pool_id && sig.device_id as usize == self.existing.len()
        );
        if own_leftover {
            tracing::info!(path = %shown, "taking back a device signed by an add that did not finish");
        } else if let Some(what) = foreign_signature(&head) {
            return Err(refused(format!(
                "{shown} holds {what}; nothing was written. If its contents may be destroyed, \
                 add it with --force"
            )));
        }
        let from = if own_leftover { EXTENT_SIZE_BYTES } else { 0 };
        let found = if is_block {
            first_nonzero_sampled(file, from, capacity)
        } else {
            first_nonzero_allocated(file, from, capacity)
        }
        .map_err(io_err)?;
        if let Some(offset) = found {
            return Err(refused(format!(
                "{shown} holds data (a non-zero byte at offset {offset}); nothing was written. \
                 If its contents may be destroyed, add it with --force"
            )));
        }
        Ok(())
    }
}

/// `OFlags` as `custom_flags` takes them.
fn flags(f: OFlags) -> i32 {
    f.bits() as i32
}

fn kind_of(md: &std::fs::Metadata) -> &'static str {
    let ft = md.file_type();
    if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "of an unknown type"
    }
}

/// The offset of the first non-zero byte in `[start, end)`, reading `SCAN_CHUNK_BYTES` at a
/// time.
fn first_nonzero_in(file: &File, start: u64, end: u64) -> io::Result<Option<u64>> {
    let mut buf = vec![0u8; SCAN_CHUNK_BYTES];
    let mut pos = start;
    while pos < end {
        let n = (end - pos).min(SCAN_CHUNK_BYTES as u64) as usize;
        let chunk = &mut buf[..n];
        file.read_exact_at(chunk, pos)?;
        if let Some(i) = chunk.iter().position(|&b| b != 0) {
            return Ok(Some(pos + i as u64));
        }
        pos += n as u64;
    }
    Ok(None)
}

/// The first non-zero byte of a regular file, reading only its allocated ranges
/// (`SEEK_DATA`/`SEEK_HOLE`; the whole file where the filesystem lacks them).
pub(crate) fn first_nonzero_allocated(file: &File, from: u64, len: u64) -> io::Result<Option<u64>> {
    let mut pos = from;
    while pos < len {
        let data = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(Errno::NXIO) => return Ok(None),
            Err(e) if e == Errno::INVAL || e == Errno::OPNOTSUPP => {
                return first_nonzero_in(file, pos, len);
            }
            Err(e) => return Err(e.into()),
        };
        let hole = match rustix::fs::seek(file, SeekFrom::Hole(data)) {
            Ok(h) => h.min(len),
            Err(Errno::NXIO) => len,
            Err(e) => return Err(e.into()),
        };
        if let Some(at) = first_nonzero_in(file, data, hole)? {
            return Ok(Some(at));
        }
        pos = hole.max(data + 1);
    }
    Ok(None)
}

/// The first non-zero byte found in a block device's bounded sample: its first and last
/// `BLOCK_EDGE_BYTES` and `BLOCK_SAMPLES` reads of `BLOCK_SAMPLE_BYTES` spread between them.
pub(crate) fn first_nonzero_sampled(file: &File, from: u64, len: u64) -> io::Result<Option<u64>> {
    let mut ranges = vec![
        (0, BLOCK_EDGE_BYTES.min(len)),
        (len.saturating_sub(BLOCK_EDGE_BYTES), len),
    ];
    for i in 1..=BLOCK_SAMPLES {
        let at = len / (BLOCK_SAMPLES + 1) * i;
        let at = at - at % 4096;
        ranges.push((at, (at + BLOCK_SAMPLE_BYTES).min(len)));
    }
    for (start, end) in ranges {
        let start = start.max(from);
        if start >= end {
            continue;
        }
        if let Some(at) = first_nonzero_in(file, start, end)? {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn ctx<'a>(policy: &'a AdmissionPolicy, data: &'a Path) -> AdmissionContext<'a> {
        AdmissionContext {
            policy,
            data_dir: data,
            existing: &[],
            pool_id: 7,
        }
    }

    #[test]
    fn the_allocated_scan_finds_data_past_holes_and_passes_sparse_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = File::create_new(&path).unwrap();
        file.set_len(64 << 20).unwrap();
        assert_eq!(first_nonzero_allocated(&file, 0, 64 << 20).unwrap(), None);
        // Zeros written (allocated) are still zeros.
        file.write_all_at(&[0u8; 8192], 1 << 20).unwrap();
        assert_eq!(first_nonzero_allocated(&file, 0, 64 << 20).unwrap(), None);
        file.write_all_at(&[0, 0, 9], (40 << 20) + 5).unwrap();
        assert_eq!(
            first_nonzero_allocated(&file, 0, 64 << 20).unwrap(),
            Some((40 << 20) + 7)
        );
        // The sampled scan of the same content: its sample points miss the byte at 40 MiB
        // + 7 unless one lands there; its edges see a byte at the end.
        file.write_all_at(&[1], (64 << 20) - 1).unwrap();
        assert!(first_nonzero_sampled(&file, 0, 64 << 20).unwrap().is_some());
    }

    #[test]
    fn paths_outside_the_allowed_places_get_one_text() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir_all(data.join("devices")).unwrap();
        let outside = dir.path().join("outside.img");
        std::fs::write(&outside, b"precious").unwrap();
        let policy = AdmissionPolicy::default();
        let c = ctx(&policy, &data);
        let a = c.admit(&outside, 4 << 20, false).unwrap_err().to_string();
        let b = c
            .admit(&dir.path().join("missing.img"), 4 << 20, false)
            .unwrap_err()
            .to_string();
        let d = c
            .admit(&dir.path().join("nodir/x.img"), 4 << 20, false)
            .unwrap_err()
            .to_string();
        assert_eq!(a, b);
        assert_eq!(a, d);
        // `..` out of devices/ is outside too; the pool's own files are refused.
        let e = c
            .admit(&data.join("devices/../../outside.img"), 4 << 20, true)
            .unwrap_err()
            .to_string();
        assert_eq!(a, e);
        assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
        let wide = AdmissionPolicy {
            device_dirs: vec![dir.path().to_path_buf()],
            ..AdmissionPolicy::default()
        };
        std::fs::write(data.join("meta.redb"), b"db").unwrap();
        let m = ctx(&wide, &data)
            .admit(&data.join("meta.redb"), 4 << 20, true)
            .unwrap_err()
            .to_string();
        assert!(m.contains("data directory"), "{m}");
        assert_eq!(std::fs::read(data.join("meta.redb")).unwrap(), b"db");
    }
}
