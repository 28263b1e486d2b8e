//! One closed-loop group: a fixed number of I/Os kept at a fixed queue depth on one
//! connection, every latency recorded.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use headroom_nbd::consts::{NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE};
use headroom_nbd::{MAX_PAYLOAD_BYTES, REQUEST_HEADER_LEN, RequestHeader, encode_request_header};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::client::{LabError, NbdClient};
use crate::replies::{Completion, READ_BIT, read_replies};
use crate::rng::SplitMix64;

/// The deepest queue a group may keep (a spec bound, not a protocol one).
pub const MAX_QUEUE_DEPTH: u32 = 256;

/// Block sizes must be multiples of this (the smallest sector size in use).
const SECTOR_BYTES: u32 = 512;

/// Latencies above one hour are clamped to it (the histogram's upper bound).
const MAX_LATENCY_US: u64 = 3_600_000_000;

/// Where the load goes: an NBD server and one of its exports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port` of the NBD listener.
    pub addr: String,
    /// The export (volume) name.
    pub export: String,
}

/// A closed-loop group's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClosedLoopSpec {
    /// Requests kept in flight, `1..=MAX_QUEUE_DEPTH`.
    pub queue_depth: u32,
    /// Bytes per I/O: a positive multiple of 512, at most `MAX_PAYLOAD_BYTES`.
    pub block_size_bytes: u32,
    /// Share of READs in thousandths (`0..=1000`); the rest are WRITEs.
    pub read_permille: u32,
    /// I/Os go to random block-aligned offsets in `[0, region_bytes)`; at least one block,
    /// at most the export's size.
    pub region_bytes: u64,
    /// I/Os to complete before the group stops.
    pub total_ios: u64,
    /// Seed of the PRNG that picks operations, offsets and the written data.
    pub seed: u64,
}

impl ClosedLoopSpec {
    /// Checks the bounds that do not depend on the export.
    pub fn validate(&self) -> Result<(), LabError> {
        let invalid = |message: String| Err(LabError::InvalidSpec(message));
        if !(1..=MAX_QUEUE_DEPTH).contains(&self.queue_depth) {
            return invalid(format!(
                "queue_depth {} is outside 1..={MAX_QUEUE_DEPTH}",
                self.queue_depth
            ));
        }
        if self.block_size_bytes == 0 || !self.block_size_bytes.is_multiple_of(SECTOR_BYTES) {
            return invalid(format!(
                "block_size_bytes {} is not a positive multiple of {SECTOR_BYTES}",
                self.block_size_bytes
            ));
        }
        if self.block_size_bytes > MAX_PAYLOAD_BYTES {
            return invalid(format!(
                "block_size_bytes {} exceeds the {MAX_PAYLOAD_BYTES}-byte request bound",
                self.block_size_bytes
            ));
        }
        if self.read_permille > 1000 {
            return invalid(format!(
                "read_permille {} is outside 0..=1000",
                self.read_permille
            ));
        }
        if self.region_bytes < u64::from(self.block_size_bytes) {
            return invalid(format!(
                "region_bytes {} is smaller than one block of {} bytes",
                self.region_bytes, self.block_size_bytes
            ));
        }
        Ok(())
    }
}

/// What a group did, as the generator saw it.
#[derive(Debug, Clone)]
pub struct GroupResult {
    /// Successful READs.
    pub ios_read: u64,
    /// Successful WRITEs.
    pub ios_written: u64,
    /// Bytes of successful READs.
    pub bytes_read: u64,
    /// Bytes of successful WRITEs.
    pub bytes_written: u64,
    /// I/Os the server answered with an error.
    pub errors: u64,
    /// Latency of every completed I/O (errors included), submit to reply, in microseconds.
    pub latency_us: Histogram<u64>,
    /// From the first submission to the last reply.
    pub elapsed: Duration,
    /// CPU time (user + system) of this whole process over the run, in nanoseconds: the
    /// generator's own cost, when nothing else runs in the process.
    pub cpu_ns: u64,
}

impl GroupResult {
    /// Completed I/Os, errors included.
    #[must_use]
    pub const fn ios(&self) -> u64 {
        self.ios_read + self.ios_written + self.errors
    }

    /// Completed I/Os per second of `elapsed` (0 for an empty run).
    #[must_use]
    pub fn iops(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.ios() as f64 / secs
        } else {
            0.0
        }
    }

    /// The generator's CPU nanoseconds per completed I/O (0 for an empty run).
    #[must_use]
    pub fn cpu_ns_per_io(&self) -> f64 {
        match self.ios() {
            0 => 0.0,
            ios => self.cpu_ns as f64 / ios as f64,
        }
    }
}

/// Runs one closed-loop group against `target`: connects, keeps `queue_depth` requests in
/// flight (pipelined on one connection; replies matched by cookie, in any order) until
/// `total_ios` have completed, then sends `NBD_CMD_DISC`.
///
/// The spec is validated before anything touches the network.
pub async fn closed_loop(target: &Target, spec: &ClosedLoopSpec) -> Result<GroupResult, LabError> {
    spec.validate()?;
    let client = NbdClient::connect(&target.addr, &target.export).await?;
    let export = client.export();
    if spec.region_bytes > export.size_bytes {
        return Err(LabError::RegionTooLarge {
            region_bytes: spec.region_bytes,
            export_bytes: export.size_bytes,
        });
    }
    if export.read_only() && spec.read_permille < 1000 {
        return Err(LabError::ReadOnlyExport);
    }
    let block = spec.block_size_bytes;
    let blocks = spec.region_bytes / u64::from(block);
    let mut rng = SplitMix64::new(spec.seed);
    // One block of pseudo-random data, written by every WRITE (not zeroes, so the store
    // cannot short-cut it).
    let mut payload = Vec::with_capacity(block as usize);
    while payload.len() < block as usize {
        payload.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    payload.truncate(block as usize);

    let (read_half, mut writer) = client.into_stream().into_split();
    let (tx, mut rx) = mpsc::channel(spec.queue_depth as usize + 1);
    // A READ's reply carries one block.
    let reader = tokio::spawn(read_replies(read_half, block, tx, move |_| block as usize));
    let outcome = async {
        let mut latency_us = Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_US, 3)
            .map_err(|e| LabError::InvalidSpec(format!("latency histogram: {e}")))?;
        let mut result_counts = [0u64; 5]; // reads, writes, read bytes, written bytes, errors
        let mut in_flight: HashMap<u64, Instant> =
            HashMap::with_capacity(spec.queue_depth as usize);
        let mut out = Vec::with_capacity(64 * 1024);
        let mut submitted = 0u64;
        let mut completed = 0u64;
        let cpu_start = process_cpu_ns();
        let started = Instant::now();

        let mut submit = |seq: u64, out: &mut Vec<u8>, in_flight: &mut HashMap<u64, Instant>| {
            let read = rng.below(1000) < u64::from(spec.read_permille);
            let offset = rng.below(blocks) * u64::from(block);
            let cookie = (seq << 1) | if read { READ_BIT } else { 0 };
            encode_request_header(
                out,
                &RequestHeader {
                    flags: 0,
                    command: if read { NBD_CMD_READ } else { NBD_CMD_WRITE },
                    cookie,
                    offset,
                    length: block,
                },
            );
            if !read {
                out.extend_from_slice(&payload);
            }
            in_flight.insert(cookie, Instant::now());
        };

        let initial = spec.total_ios.min(u64::from(spec.queue_depth));
        for _ in 0..initial {
            submit(submitted, &mut out, &mut in_flight);
            submitted += 1;
        }
        writer
            .write_all(&out)
            .await
            .map_err(LabError::io("sending requests"))?;

        while completed < spec.total_ios {
            let Some(first) = rx.recv().await else {
                return Err(LabError::Io {
                    context: "reading replies",
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                });
            };
            let mut next = Some(first);
            out.clear();
            while let Some(reply) = next {
                let reply: Completion = reply?;
                let Some(sent) = in_flight.remove(&reply.cookie) else {
                    return Err(LabError::UnknownCookie {
                        cookie: reply.cookie,
                    });
                };
                let us = u64::try_from(reply.at.saturating_duration_since(sent).as_micros())
                    .unwrap_or(MAX_LATENCY_US);
                latency_us.saturating_record(us);
                completed += 1;
                if reply.error != 0 {
                    result_counts[4] += 1;
                } else if reply.cookie & READ_BIT != 0 {
                    result_counts[0] += 1;
                    result_counts[2] += u64::from(block);
                } else {
                    result_counts[1] += 1;
                    result_counts[3] += u64::from(block);
                }
                if submitted < spec.total_ios {
                    submit(submitted, &mut out, &mut in_flight);
                    submitted += 1;
                }
                // Take every reply already waiting, so their refills go out in one write.
                next = rx.try_recv().ok();
            }
            if !out.is_empty() {
                writer
                    .write_all(&out)
                    .await
                    .map_err(LabError::io("sending requests"))?;
            }
        }
        let elapsed = started.elapsed();
        let cpu_ns = process_cpu_ns().saturating_sub(cpu_start);

        out.clear();
        encode_request_header(
            &mut out,
            &RequestHeader {
                flags: 0,
                command: NBD_CMD_DISC,
                cookie: submitted << 1,
                offset: 0,
                length: 0,
            },
        );
        debug_assert_eq!(out.len(), REQUEST_HEADER_LEN);
        writer
            .write_all(&out)
            .await
            .map_err(LabError::io("sending NBD_CMD_DISC"))?;
        writer
            .shutdown()
            .await
            .map_err(LabError::io("closing the connection"))?;
        let [ios_read, ios_written, bytes_read, bytes_written, errors] = result_counts;
        Ok(GroupResult {
            ios_read,
            ios_written,
            bytes_read,
            bytes_written,
            errors,
            latency_us,
            elapsed,
            cpu_ns,
        })
    }
    .await;
    reader.abort();
    outcome
}

/// CPU time (user + system, all threads) of this process, in nanoseconds:
/// `CLOCK_PROCESS_CPUTIME_ID`, the same sum `getrusage(RUSAGE_SELF)` reports, at
/// nanosecond rather than microsecond resolution.
pub(crate) fn process_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ClosedLoopSpec {
        ClosedLoopSpec {
            queue_depth: 8,
            block_size_bytes: 4096,
            read_permille: 500,
            region_bytes: 64 << 20,
            total_ios: 100,
            seed: 7,
        }
    }

    #[test]
    fn a_sane_spec_is_accepted() {
        assert!(spec().validate().is_ok());
    }

    #[test]
    fn out_of_range_fields_are_refused() {
        for bad in [
            ClosedLoopSpec {
                queue_depth: 0,
                ..spec()
            },
            ClosedLoopSpec {
                queue_depth: 257,
                ..spec()
            },
            ClosedLoopSpec {
                block_size_bytes: 0,
                ..spec()
            },
            ClosedLoopSpec {
                block_size_bytes: 1000,
                ..spec()
            },
            ClosedLoopSpec {
                block_size_bytes: 64 << 20,
                ..spec()
            },
            ClosedLoopSpec {
                read_permille: 1001,
                ..spec()
            },
            ClosedLoopSpec {
                region_bytes: 512,
                ..spec()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(LabError::InvalidSpec(_))),
                "{bad:?} accepted"
            );
        }
    }
}
