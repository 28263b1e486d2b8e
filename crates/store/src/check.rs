//! `headroom check`: verifies a data directory's metadata offline, and repairs one damaged
//! copy from the other.
//!
//! Why offline: redb locks its file, so this runs only while the server is stopped (a
//! running server makes it fail with "open in another process"); and an operator whose
//! server refuses to start on a damaged `meta.redb` needs a tool that works without one.
//! What it checks is what `Store::open` relies on: both files pass redb's integrity check,
//! they are at the same commit and hold the same rows, every row is consistent (the checks
//! of `rebuild()`: no extent past its volume's end or on a device that does not exist, no
//! physical extent mapped twice, names and sizes valid), and every device file is there with
//! at least its recorded capacity. The open for the check runs redb's integrity check, which
//! commits (it rebuilds the allocator state), so even a check without `--repair` writes to
//! an intact file; it never changes its contents.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::meta::{Loaded, load_loaded};
use crate::meta_file::{OpenFailure, copy_file, file_len, open_checked};

/// The state of one metadata file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum FileState {
    /// Passed redb's integrity check; at this commit number.
    Intact { commit: u64 },
    /// Missing or empty.
    Missing,
    /// Failed the integrity check, cut short, or unreadable; why.
    Damaged { reason: String },
}

/// One metadata file and its state.
#[derive(Clone, Debug, Serialize)]
pub struct FileCheck {
    pub path: PathBuf,
    #[serde(flatten)]
    pub state: FileState,
}

/// What `check_data_dir` found, and what it repaired.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    pub data_dir: PathBuf,
    /// `meta.redb`, then `meta-copy.redb`.
    pub files: Vec<FileCheck>,
    pub devices: usize,
    pub volumes: usize,
    /// Extent-map rows of every replica.
    pub extent_rows: usize,
    /// What is wrong (after the repairs, when repairing); empty: clean.
    pub problems: Vec<String>,
    /// What `--repair` did, one sentence each.
    pub repairs: Vec<String>,
}

impl CheckReport {
    /// No problem left.
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Why the check could not run (exit code 2 of `headroom check`).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("{0}")]
    CannotRun(String),
}

struct Opened {
    state: FileState,
    loaded: Option<Loaded>,
}

fn inspect(path: &Path) -> Result<Opened, CheckError> {
    if file_len(path) == 0 {
        return Ok(Opened {
            state: FileState::Missing,
            loaded: None,
        });
    }
    match open_checked(path) {
        // redb may panic on a malformed page the check let through: damaged too.
        Ok(db) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load_loaded(&db)))
        {
            Ok(Ok((loaded, commit))) => Ok(Opened {
                state: FileState::Intact { commit },
                loaded,
            }),
            Ok(Err(e)) => Ok(Opened {
                state: FileState::Damaged {
                    reason: e.to_string(),
                },
                loaded: None,
            }),
            Err(_) => Ok(Opened {
                state: FileState::Damaged {
                    reason: "redb panicked reading it".into(),
                },
                loaded: None,
            }),
        },
        Err(OpenFailure::Damaged(reason)) => Ok(Opened {
            state: FileState::Damaged { reason },
            loaded: None,
        }),
        Err(OpenFailure::Busy) => Err(CheckError::CannotRun(format!(
            "{} is open in another process: stop the server first",
            path.display()
        ))),
        Err(e) => Err(CheckError::CannotRun(format!("{}: {e}", path.display()))),
    }
}

/// Checks the metadata of `data_dir` (see the module comment); with `repair`, restores a
/// missing, damaged or older primary from an intact copy, or rewrites a missing, damaged or
/// older copy from an intact primary, and checks again.
pub fn check_data_dir(data_dir: &Path, repair: bool) -> Result<CheckReport, CheckError> {
    if !data_dir.is_dir() {
        return Err(CheckError::CannotRun(format!(
            "{} is not a directory",
            data_dir.display()
        )));
    }
    if data_dir.join("rados-namespace").exists() {
        return Err(CheckError::CannotRun(format!(
            "{} is a RADOS store: its metadata is in RADOS, not here",
            data_dir.display()
        )));
    }
    let primary = data_dir.join("meta.redb");
    let copy = data_dir.join("meta-copy.redb");
    if file_len(&primary) == 0 && file_len(&copy) == 0 {
        return Err(CheckError::CannotRun(format!(
            "{} holds no metadata (no meta.redb, no meta-copy.redb)",
            data_dir.display()
        )));
    }
    let mut repairs = Vec::new();
    let mut report = check_once(data_dir, &primary, &copy)?;
    if repair && !report.is_clean() {
        let seq = |f: &FileCheck| match f.state {
            FileState::Intact { commit } => Some(commit),
            _ => None,
        };
        let (p, c) = (seq(&report.files[0]), seq(&report.files[1]));
        let from_copy = match (p, c) {
            (None, Some(_)) => Some(true),
            (Some(_), None) => Some(false),
            (Some(p), Some(c)) if c > p => Some(true),
            (Some(_), Some(_)) => Some(false),
            (None, None) => None,
        };
        match from_copy {
            Some(true) => {
                copy_file(&copy, &primary).map_err(|e| {
                    CheckError::CannotRun(format!("restoring {}: {e}", primary.display()))
                })?;
                repairs.push(format!(
                    "restored {} from {} (commit {})",
                    primary.display(),
                    copy.display(),
                    c.unwrap_or(0)
                ));
            }
            Some(false) => {
                copy_file(&primary, &copy).map_err(|e| {
                    CheckError::CannotRun(format!("rewriting {}: {e}", copy.display()))
                })?;
                repairs.push(format!(
                    "rewrote {} from {} (commit {})",
                    copy.display(),
                    primary.display(),
                    p.unwrap_or(0)
                ));
            }
            None => {}
        }
        if !repairs.is_empty() {
            report = check_once(data_dir, &primary, &copy)?;
        }
    }
    report.repairs = repairs;
    Ok(report)
}

fn check_once(data_dir: &Path, primary: &Path, copy: &Path) -> Result<CheckReport, CheckError> {
    let p = inspect(primary)?;
    let c = inspect(copy)?;
    let mut problems = Vec::new();
    for (path, o) in [(primary, &p), (copy, &c)] {
        match &o.state {
            FileState::Missing => problems.push(format!("{} is missing or empty", path.display())),
            FileState::Damaged { reason } => {
                problems.push(format!("{} is damaged: {reason}", path.display()))
            }
            FileState::Intact { .. } => {}
        }
    }
    if let (FileState::Intact { commit: pc }, FileState::Intact { commit: cc }) =
        (&p.state, &c.state)
    {
        if pc != cc {
            problems.push(format!(
                "{} is at commit {pc}, its copy at commit {cc}",
                primary.display()
            ));
        } else if p.loaded != c.loaded {
            problems.push(format!(
                "{} and its copy are both at commit {pc} but hold different rows",
                primary.display()
            ));
        }
    }
    // The rows of the newest intact file.
    let newest = match (&p.state, &c.state) {
        (FileState::Intact { commit: pc }, FileState::Intact { commit: cc }) if cc > pc => &c,
        (FileState::Intact { .. }, _) => &p,
        _ => &c,
    };
    let (mut devices, mut volumes, mut extent_rows) = (0, 0, 0);
    match &newest.loaded {
        Some(l) => {
            devices = l.devices.len();
            volumes = l.volumes.len();
            extent_rows = l.extents.len() + l.replica_extents.len();
            problems.extend(check_devices_and_rows(data_dir, l));
        }
        None if matches!(newest.state, FileState::Intact { .. }) => {
            problems.push("the metadata was never initialised".into());
        }
        None => problems.push(
            "no intact metadata: both files are missing or damaged; restore the data \
             directory from a backup"
                .into(),
        ),
    }
    Ok(CheckReport {
        data_dir: data_dir.to_path_buf(),
        files: vec![
            FileCheck {
                path: primary.to_path_buf(),
                state: p.state,
            },
            FileCheck {
                path: copy.to_path_buf(),
                state: c.state,
            },
        ],
        devices,
        volumes,
        extent_rows,
        problems,
        repairs: Vec::new(),
    })
}

/// Every device file present with its recorded capacity, and the rows consistent.
fn check_devices_and_rows(data_dir: &Path, l: &Loaded) -> Vec<String> {
    let mut problems = Vec::new();
    let mut devices = l.devices.clone();
    devices.sort_by_key(|(id, _)| *id);
    let mut counts = Vec::new();
    for (i, (id, rec)) in devices.iter().enumerate() {
        if *id as usize != i {
            problems.push(format!("device ids are not contiguous at {id}"));
        }
        counts
            .push(u32::try_from(rec.capacity_bytes / crate::EXTENT_SIZE_BYTES).unwrap_or(u32::MAX));
        if rec.path.starts_with("rados:") || rec.path.starts_with("memory:") {
            continue;
        }
        let path = if rec.relative {
            data_dir.join(&rec.path)
        } else {
            PathBuf::from(&rec.path)
        };
        match device_len(&path) {
            Ok(len) if len >= rec.capacity_bytes => {}
            Ok(len) => problems.push(format!(
                "device {id} ({}) is {len} bytes, smaller than the recorded {}",
                path.display(),
                rec.capacity_bytes
            )),
            Err(e) => problems.push(format!("device {id} ({}): {e}", path.display())),
        }
    }
    if let Err(e) = crate::store::check_rows(&counts, l) {
        problems.push(e.to_string());
    }
    problems
}

/// Length of a device file or block device.
fn device_len(path: &Path) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::End(0))
}
