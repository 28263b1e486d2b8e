//! Readers for public block-trace formats, for trace-replay workloads.
//!
//! Two formats are supported:
//! - Alibaba block traces (2020): `device_id,opcode,offset,length,timestamp`, opcode `R`/`W`,
//!   offset and length in bytes, timestamp in microseconds;
//! - MSR Cambridge: `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime`, timestamp
//!   in Windows file-time ticks (100 ns), type `Read`/`Write`, offset and size in bytes.
//!
//! Traces are user input: a malformed line is an error naming the file, the line and the
//! field, never a panic. Each distinct device becomes one simulated tenant; times are made
//! relative to the earliest record in the file.

use crate::error::SimError;
use headroom_qos::OpKind;
use serde::{Deserialize, Serialize};
use std::io::BufRead;

/// Supported trace formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `device_id,opcode,offset,length,timestamp` (µs).
    Alibaba,
    /// `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime` (100 ns ticks).
    Msr,
}

/// One traced I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Issue time relative to the start of the trace, ns.
    pub at_ns: u64,
    /// Read or write.
    pub op: OpKind,
    /// Byte offset.
    pub offset_bytes: u64,
    /// Length in bytes.
    pub len_bytes: u32,
}

/// All records of one traced device, in time order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTrace {
    /// Device key as written in the trace (`17`, or `web_0` for MSR host `web`, disk 0).
    pub key: String,
    /// Records sorted by time.
    pub records: Vec<TraceRecord>,
}

/// A parsed trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// Devices in order of first appearance.
    pub devices: Vec<DeviceTrace>,
}

fn bad(path: &str, line: usize, reason: impl Into<String>) -> SimError {
    SimError::Trace {
        path: path.to_string(),
        line,
        reason: reason.into(),
    }
}

fn field<'a>(
    fields: &[&'a str],
    i: usize,
    name: &str,
    path: &str,
    line: usize,
) -> Result<&'a str, SimError> {
    fields.get(i).map(|s| s.trim()).ok_or_else(|| {
        bad(
            path,
            line,
            format!("missing field {name} (column {})", i + 1),
        )
    })
}

fn number<T: std::str::FromStr>(
    s: &str,
    name: &str,
    path: &str,
    line: usize,
) -> Result<T, SimError> {
    s.parse::<T>().map_err(|_| {
        bad(
            path,
            line,
            format!("field {name}: {s:?} is not a valid number"),
        )
    })
}

/// Parses a trace from a reader. `path` only names the source in error messages.
pub fn parse(reader: impl BufRead, format: TraceFormat, path: &str) -> Result<Trace, SimError> {
    // (device index, raw time in the format's unit, record without time)
    let mut raw: Vec<(usize, u64, TraceRecord)> = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    let mut index: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for (i, line) in reader.lines().enumerate() {
        let lineno = i + 1;
        let line = line.map_err(|e| bad(path, lineno, format!("cannot read: {e}")))?;
        let text = line.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = text.split(',').collect();
        if lineno == 1 && is_header(&fields) {
            continue;
        }
        let (key, raw_time, op, offset, len) = match format {
            TraceFormat::Alibaba => {
                if fields.len() != 5 {
                    return Err(bad(
                        path,
                        lineno,
                        format!(
                            "expected 5 fields device_id,opcode,offset,length,timestamp, got {}",
                            fields.len()
                        ),
                    ));
                }
                let dev: u32 = number(
                    field(&fields, 0, "device_id", path, lineno)?,
                    "device_id",
                    path,
                    lineno,
                )?;
                let op = match field(&fields, 1, "opcode", path, lineno)? {
                    "R" | "r" => OpKind::Read,
                    "W" | "w" => OpKind::Write,
                    other => {
                        return Err(bad(
                            path,
                            lineno,
                            format!("field opcode: {other:?} is not R or W"),
                        ));
                    }
                };
                let offset: u64 = number(
                    field(&fields, 2, "offset", path, lineno)?,
                    "offset",
                    path,
                    lineno,
                )?;
                let len: u32 = number(
                    field(&fields, 3, "length", path, lineno)?,
                    "length",
                    path,
                    lineno,
                )?;
                let ts: u64 = number(
                    field(&fields, 4, "timestamp", path, lineno)?,
                    "timestamp",
                    path,
                    lineno,
                )?;
                (dev.to_string(), ts, op, offset, len)
            }
            TraceFormat::Msr => {
                if fields.len() != 7 {
                    return Err(bad(
                        path,
                        lineno,
                        format!(
                            "expected 7 fields Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime, got {}",
                            fields.len()
                        ),
                    ));
                }
                let ts: u64 = number(
                    field(&fields, 0, "Timestamp", path, lineno)?,
                    "Timestamp",
                    path,
                    lineno,
                )?;
                let host = field(&fields, 1, "Hostname", path, lineno)?;
                if host.is_empty() {
                    return Err(bad(path, lineno, "field Hostname is empty"));
                }
                let disk: u32 = number(
                    field(&fields, 2, "DiskNumber", path, lineno)?,
                    "DiskNumber",
                    path,
                    lineno,
                )?;
                let op = match field(&fields, 3, "Type", path, lineno)?
                    .to_ascii_lowercase()
                    .as_str()
                {
                    "read" => OpKind::Read,
                    "write" => OpKind::Write,
                    other => {
                        return Err(bad(
                            path,
                            lineno,
                            format!("field Type: {other:?} is not Read or Write"),
                        ));
                    }
                };
                let offset: u64 = number(
                    field(&fields, 4, "Offset", path, lineno)?,
                    "Offset",
                    path,
                    lineno,
                )?;
                let len: u32 = number(
                    field(&fields, 5, "Size", path, lineno)?,
                    "Size",
                    path,
                    lineno,
                )?;
                let _resp: u64 = number(
                    field(&fields, 6, "ResponseTime", path, lineno)?,
                    "ResponseTime",
                    path,
                    lineno,
                )?;
                (format!("{host}_{disk}"), ts, op, offset, len)
            }
        };
        if len == 0 {
            return Err(bad(path, lineno, "length is zero"));
        }
        let dev = match index.get(&key) {
            Some(d) => *d,
            None => {
                let d = keys.len();
                index.insert(key.clone(), d);
                keys.push(key);
                d
            }
        };
        raw.push((
            dev,
            raw_time,
            TraceRecord {
                at_ns: 0,
                op,
                offset_bytes: offset,
                len_bytes: len,
            },
        ));
    }
    let t0 = raw.iter().map(|r| r.1).min().unwrap_or(0);
    let ns_per_unit: u64 = match format {
        TraceFormat::Alibaba => 1_000,
        TraceFormat::Msr => 100,
    };
    let mut devices: Vec<DeviceTrace> = keys
        .into_iter()
        .map(|key| DeviceTrace {
            key,
            records: Vec::new(),
        })
        .collect();
    for (dev, t, mut rec) in raw {
        rec.at_ns = (t - t0).saturating_mul(ns_per_unit);
        devices[dev].records.push(rec);
    }
    for d in &mut devices {
        d.records.sort_by_key(|r| r.at_ns);
    }
    Ok(Trace { devices })
}

fn is_header(fields: &[&str]) -> bool {
    fields
        .first()
        .map(|f| {
            f.trim()
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic())
        })
        .unwrap_or(false)
        && fields.iter().any(|f| {
            let f = f.trim().to_ascii_lowercase();
            f == "timestamp" || f == "device_id"
        })
}

/// Reads and parses a trace file.
pub fn load(path: &std::path::Path, format: TraceFormat) -> Result<Trace, SimError> {
    let file = std::fs::File::open(path).map_err(|source| SimError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(
        std::io::BufReader::new(file),
        format,
        &path.display().to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_alibaba_lines_per_device() {
        let text = "device_id,opcode,offset,length,timestamp\n\
                    3,R,4096,4096,1577808000000626\n\
                    1,W,0,8192,1577808000000000\n\
                    3,W,8192,4096,1577808000001626\n";
        let t = parse(text.as_bytes(), TraceFormat::Alibaba, "a.csv").unwrap();
        assert_eq!(t.devices.len(), 2);
        assert_eq!(t.devices[0].key, "3");
        assert_eq!(t.devices[0].records[0].at_ns, 626_000);
        assert_eq!(t.devices[0].records[1].at_ns, 1_626_000);
        assert_eq!(t.devices[1].records[0].op, OpKind::Write);
        assert_eq!(t.devices[1].records[0].len_bytes, 8192);
    }

    #[test]
    fn parses_msr_lines() {
        let text = "128166372003061629,hm,1,Read,383496192,32768,4127\n\
                    128166372016382155,hm,1,Write,3078508544,4096,12355\n\
                    128166372026382245,web,0,Write,0,512,1\n";
        let t = parse(text.as_bytes(), TraceFormat::Msr, "m.csv").unwrap();
        assert_eq!(t.devices.len(), 2);
        assert_eq!(t.devices[0].key, "hm_1");
        assert_eq!(
            t.devices[0].records[1].at_ns,
            (128166372016382155 - 128166372003061629) * 100
        );
        assert_eq!(t.devices[1].records[0].op, OpKind::Write);
    }

    #[test]
    fn malformed_lines_name_line_and_field() {
        let cases = [
            ("1,R,0,4096\n", TraceFormat::Alibaba, 1, "expected 5 fields"),
            (
                "1,R,0,4096,5\n1,X,0,4096,6\n",
                TraceFormat::Alibaba,
                2,
                "opcode",
            ),
            ("1,R,zero,4096,5\n", TraceFormat::Alibaba, 1, "offset"),
            ("1,R,0,0,5\n", TraceFormat::Alibaba, 1, "length is zero"),
            ("1,R,0,4096,-5\n", TraceFormat::Alibaba, 1, "timestamp"),
            ("12,hm,1,Trim,0,4096,1\n", TraceFormat::Msr, 1, "Type"),
            ("12,hm,x,Read,0,4096,1\n", TraceFormat::Msr, 1, "DiskNumber"),
            (
                "12,hm,1,Read,0,4096\n",
                TraceFormat::Msr,
                1,
                "expected 7 fields",
            ),
        ];
        for (text, format, line, needle) in cases {
            let err = parse(text.as_bytes(), format, "t.csv").unwrap_err();
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("t.csv:{line}:")), "{msg}");
            assert!(msg.contains(needle), "{msg} should mention {needle}");
        }
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let err = load(
            std::path::Path::new("/nonexistent/trace.csv"),
            TraceFormat::Msr,
        )
        .unwrap_err();
        assert!(matches!(err, SimError::Io { .. }));
    }
}
