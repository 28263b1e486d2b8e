//! Opening a metadata file safely, and copying one: the pieces both the store's open and
//! `headroom check` use.
//!
//! Why: redb trusts a file at open and may panic on one damaged outside redb (its docs say
//! so); a damaged `meta.redb` must be a clear error that names the file and what to do,
//! never a panic and never a silently "new" database. So every open runs redb's integrity
//! check (`Builder::set_check_integrity_on_open`: the checksum of every page of the committed
//! trees is verified and the allocator state rebuilt; it reads the whole file and commits),
//! inside `catch_unwind`. And since redb initialises an *empty* file as a new database, an
//! empty or missing primary beside a non-empty copy is refused by the caller (`meta.rs`)
//! before redb sees it.
//!
//! The copy (`meta-copy.redb`) is brought up to date by copying the whole file while no
//! transaction runs (every commit is durable, so the file holds exactly the committed
//! state): through a temporary file, fsync, rename and a sync of the directory, so a crash
//! leaves the old copy or the new one.

use std::io;
use std::path::{Path, PathBuf};

use redb::Database;

/// redb page cache; the hot path never reads redb, so it can stay small.
pub(crate) const CACHE_SIZE_BYTES: usize = 32 << 20;

/// How an open of a metadata file failed.
#[derive(Debug)]
pub(crate) enum OpenFailure {
    /// The file is damaged (the integrity check failed, it is truncated, or redb panicked).
    Damaged(String),
    /// Another process has it open (redb's file lock).
    Busy,
    /// The disk is full (ENOSPC or EDQUOT).
    NoSpace(io::Error),
    /// Any other failure (permissions, I/O).
    Other(String),
}

impl std::fmt::Display for OpenFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenFailure::Damaged(d) => write!(f, "damaged: {d}"),
            OpenFailure::Busy => write!(f, "open in another process (is the server running?)"),
            OpenFailure::NoSpace(e) => write!(f, "{e}"),
            OpenFailure::Other(d) => write!(f, "{d}"),
        }
    }
}

fn classify(e: redb::DatabaseError) -> OpenFailure {
    use redb::{DatabaseError as D, StorageError as S};
    match e {
        D::DatabaseAlreadyOpen | D::LockProtocolMismatch => OpenFailure::Busy,
        D::Storage(S::Io(io)) if crate::meta_reserve::is_no_space(&io) => OpenFailure::NoSpace(io),
        // A read past the end: the file was cut short.
        D::Storage(S::Io(io))
            if matches!(
                io.kind(),
                io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidInput
            ) =>
        {
            OpenFailure::Damaged(format!("truncated ({io})"))
        }
        // "Not a redb database: magic number mismatch".
        D::Storage(S::Io(io)) if io.kind() == io::ErrorKind::InvalidData => {
            OpenFailure::Damaged(io.to_string())
        }
        D::Storage(S::Io(io)) => OpenFailure::Other(io.to_string()),
        D::TransactionInProgress => OpenFailure::Other(e.to_string()),
        other => OpenFailure::Damaged(other.to_string()),
    }
}

/// Opens (creating it if missing or empty) the redb file at `path` with the integrity
/// check; a panic inside redb becomes `Damaged`.
pub(crate) fn open_checked(path: &Path) -> Result<Database, OpenFailure> {
    let opened = std::panic::catch_unwind(|| {
        redb::Builder::new()
            .set_cache_size(CACHE_SIZE_BYTES)
            .set_check_integrity_on_open(true)
            .create(path)
    });
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(classify(e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "a panic".into());
            Err(OpenFailure::Damaged(format!(
                "redb panicked reading it: {what}"
            )))
        }
    }
}

/// Length of the file at `path`, 0 if it does not exist.
pub(crate) fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// Replaces `to` with a copy of `from`, durably (temporary file, fsync, rename, directory
/// fsync). The caller makes sure no transaction writes `from` meanwhile and that `to` is
/// not open.
pub(crate) fn copy_file(from: &Path, to: &Path) -> io::Result<()> {
    let tmp: PathBuf = to.with_extension("redb.tmp");
    std::fs::copy(from, &tmp)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, to)?;
    if let Some(dir) = to.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}
