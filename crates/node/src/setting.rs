//! One rule per node-owned setting, in the crate that owns the value.
//!
//! Why: `headroom serve` checked these ranges itself, so a `NodeConfig` built by `calibrate`,
//! the lab or a test went unchecked, and each range was written twice. Now each rule is a
//! function here (or beside its part: `scheduler::config`), `NodeConfig::validate` runs them
//! all at `Node::start`, and the binary calls the same functions to report a file's value
//! in the file's words before anything starts.

/// A setting out of its range: the key as the configuration file writes it, the value, and
/// what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key} = {value}: {allowed}")]
pub struct InvalidSetting {
    pub key: &'static str,
    pub value: u64,
    pub allowed: String,
}

impl InvalidSetting {
    pub(crate) fn new(key: &'static str, value: u64, allowed: impl Into<String>) -> InvalidSetting {
        InvalidSetting {
            key,
            value,
            allowed: allowed.into(),
        }
    }
}

/// Longest coalescing wait accepted: beyond it the wait is latency, not batching.
pub const MAX_COALESCE_US: u64 = 1000;

/// Most I/O executor threads per lane a configuration may ask for.
pub const MAX_IO_THREADS: usize = 256;

/// `server.io_threads`: 0 (inline) to [`MAX_IO_THREADS`].
pub fn check_io_threads(n: usize) -> Result<(), InvalidSetting> {
    if n > MAX_IO_THREADS {
        return Err(InvalidSetting::new(
            "server.io_threads",
            count(n),
            format!("must be between 0 (inline) and {MAX_IO_THREADS}"),
        ));
    }
    Ok(())
}

/// `server.coalesce_us`: 0 (off) to [`MAX_COALESCE_US`].
pub fn check_coalesce_us(us: u64) -> Result<(), InvalidSetting> {
    let max = MAX_COALESCE_US;
    if us > max {
        return Err(InvalidSetting::new(
            "server.coalesce_us",
            us,
            format!("must be between 0 (off) and {max}"),
        ));
    }
    Ok(())
}

/// `server.net_threads`: 0 (the shared runtime) to [`crate::net_threads::MAX_NET_THREADS`].
pub fn check_net_threads(n: usize) -> Result<(), InvalidSetting> {
    let max = crate::net_threads::MAX_NET_THREADS;
    if n > max {
        return Err(InvalidSetting::new(
            "server.net_threads",
            count(n),
            format!("must be between 0 (connections on the shared runtime) and {max}"),
        ));
    }
    Ok(())
}

pub(crate) fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}
