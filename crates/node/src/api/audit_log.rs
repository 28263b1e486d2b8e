//! The management API's audit log: one JSON line per request that could change something
//! (every authenticated request whose method is not GET or HEAD, refused ones included),
//! appended and synced before the response is sent.
//!
//! Why: with several tokens, "who deleted that volume" needs an answer that survives the
//! process. Reads are not recorded (they change nothing, and a dashboard polls every second);
//! requests without a valid token are not either (they have no "who", and a flood of them
//! must not fill the disk). Not to be confused with the promise audit of QoS
//! (`crate::metrics`), which judges the scheduler.
//!
//! A line (docs/operations.md, "Audit log"):
//! `{"time":"2026-12-02T00:40:12.345Z","unix_ms":1796172012345,"token_id":"tok-…",
//! "token_name":"ci","scope":"admin","method":"DELETE","route":"/v1/volumes/{name}",
//! "path":"/v1/volumes/db1","target":"db1","status":204}`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::sync::lock;

/// One audited request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// RFC 3339, UTC, milliseconds.
    pub time: String,
    pub unix_ms: u64,
    /// `bootstrap` for the node's configured token.
    pub token_id: String,
    /// `bootstrap token` for it; absent for an unnamed token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_name: Option<String>,
    /// `admin` or `read` (a read token's attempt is recorded with its 403).
    pub scope: String,
    pub method: String,
    /// The route's template (`/v1/volumes/{name}`); absent for a path no route matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    pub path: String,
    /// What the request acted on: the route's path parameters joined by `/`, else the
    /// body's `name`, `id` or `path`; absent when neither says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The response's status.
    pub status: u16,
}

/// Failures of the audit log.
#[derive(Debug, thiserror::Error)]
#[error("the audit log {path}: {source}")]
pub struct AuditLogError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// The open audit log (append-only: opened with `O_APPEND`, never truncated or rewritten).
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    file: Mutex<File>,
}

impl AuditLog {
    /// Opens (creating, mode 0600) the log at `path`, at start, so a log that cannot be
    /// written stops the node from starting rather than losing records later.
    pub fn open(path: &Path) -> Result<Arc<AuditLog>, AuditLogError> {
        let err = |source| AuditLogError {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(path)
            .map_err(err)?;
        Ok(Arc::new(AuditLog {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record` as one line and syncs it. Blocking.
    pub fn append(&self, record: &AuditRecord) -> Result<(), AuditLogError> {
        let err = |source| AuditLogError {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_vec(record).map_err(|e| err(std::io::Error::other(e)))?;
        line.push(b'\n');
        let mut file = lock(&self.file);
        // One write of the whole line: with O_APPEND it lands after every earlier line.
        file.write_all(&line).map_err(err)?;
        file.sync_data().map_err(err)
    }
}

/// `unix_ms` as RFC 3339 in UTC with milliseconds (`2026-12-02T00:40:12.345Z`).
pub fn rfc3339_utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let ms = unix_ms % 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX);
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = if m <= 2 { y + 1 } else { y };
    (
        year,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

/// The values of `route`'s `{parameters}` in `path`, joined by `/` (`None`: no parameter).
pub fn path_target(route: &str, path: &str) -> Option<String> {
    let values: Vec<&str> = route
        .split('/')
        .zip(path.split('/'))
        .filter(|(template, _)| template.starts_with('{'))
        .map(|(_, value)| value)
        .collect();
    (!values.is_empty()).then(|| values.join("/"))
}

/// The `name`, `id` or `path` string of a JSON object body.
pub fn body_target(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    ["name", "id", "path"]
        .iter()
        .find_map(|key| value.get(key).and_then(|v| v.as_str()).map(str::to_string))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(951_782_400_007), "2000-02-29T00:00:00.007Z");
        assert_eq!(rfc3339_utc(1_796_172_012_345), "2026-12-02T00:40:12.345Z");
    }

    #[test]
    fn targets() {
        assert_eq!(
            path_target("/v1/volumes/{name}", "/v1/volumes/db1").as_deref(),
            Some("db1")
        );
        assert_eq!(
            path_target("/v1/devices/{id}/fail", "/v1/devices/3/fail").as_deref(),
            Some("3")
        );
        assert_eq!(path_target("/v1/volumes", "/v1/volumes"), None);
        assert_eq!(
            body_target(br#"{"name":"v","size_bytes":1}"#).as_deref(),
            Some("v")
        );
        assert_eq!(body_target(br#"{"rate_bytes_per_s":1}"#), None);
        assert_eq!(body_target(b"not json"), None);
    }

    #[test]
    fn records_are_appended_one_line_each() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let record = AuditRecord {
            time: rfc3339_utc(1),
            unix_ms: 1,
            token_id: "bootstrap".into(),
            token_name: None,
            scope: "admin".into(),
            method: "POST".into(),
            route: Some("/v1/volumes".into()),
            path: "/v1/volumes".into(),
            target: Some("v".into()),
            status: 201,
        };
        AuditLog::open(&path).unwrap().append(&record).unwrap();
        // Reopened: appended after, not over.
        AuditLog::open(&path).unwrap().append(&record).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<AuditRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines, vec![record.clone(), record]);
    }
}
