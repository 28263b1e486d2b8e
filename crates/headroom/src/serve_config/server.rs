//! `[server]`: the listeners and the threads that carry requests. Each key is declared once
//! here: its file name (serde), its flag (clap), its help (the doc comment), its check and
//! where it lands in the `NodeConfig`.

use std::net::SocketAddr;

use clap::Args;
use headroom_node::{NodeConfig, setting};
use merge::Merge;
use serde::Deserialize;

use super::{Invalid, Size};

/// `[server]`: listeners and the I/O threads.
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct ServerSection {
    /// NBD listen address [default: 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR")]
    pub nbd_listen: Option<SocketAddr>,
    /// Management API listen address [default: 127.0.0.1:10810].
    #[arg(long, value_name = "ADDR")]
    pub api_listen: Option<SocketAddr>,
    /// Worker threads executing block I/O (0 = inline on the network threads) [default: 2].
    #[arg(long, value_name = "N")]
    pub io_threads: Option<usize>,
    /// Requests moving at most this many bytes run inline on the network threads
    /// [default: 64KiB when every device is in RAM (--memory, or device files on tmpfs), else 0].
    #[arg(long, value_name = "SIZE")]
    pub inline_max_bytes: Option<Size>,
    /// Microseconds a network thread about to sleep waits for more requests, to answer
    /// several per wake-up; adaptive, 0 = off
    /// [default: 10 with --memory or --rados-conf, 0 with device files].
    #[arg(long, value_name = "US")]
    pub coalesce_us: Option<u64>,
    /// Threads that own the NBD connections (each connection lives on one, reader and writer
    /// together); 0 = connections share the async runtime's threads [default: one per CPU].
    #[arg(long, value_name = "N")]
    pub net_threads: Option<usize>,
}

impl ServerSection {
    /// Checks every value on its own (the thread and wait rules are the node's:
    /// `headroom_node::setting`).
    pub(super) fn check(&self) -> Result<(), Invalid> {
        if let Some(n) = self.io_threads {
            setting::check_io_threads(n)?;
        }
        if let Some(size) = self.inline_max_bytes
            && u32::try_from(size.0).is_err()
        {
            return Err(Invalid::new(
                "server.inline_max_bytes",
                size,
                "must be less than 4GiB",
            ));
        }
        if let Some(us) = self.coalesce_us {
            setting::check_coalesce_us(us)?;
        }
        if let Some(n) = self.net_threads {
            setting::check_net_threads(n)?;
        }
        Ok(())
    }

    /// Sets what this layer has over the node's defaults.
    pub(super) fn apply(&self, config: &mut NodeConfig) {
        if let Some(addr) = self.nbd_listen {
            config.nbd_listen = addr;
        }
        if let Some(addr) = self.api_listen {
            config.api_listen = addr;
        }
        if let Some(n) = self.io_threads {
            config.io_threads = n;
        }
        if let Some(us) = self.coalesce_us {
            config.coalesce_us = Some(us);
        }
        if let Some(n) = self.net_threads {
            config.net_threads = Some(n);
        }
        // `check` made sure it fits.
        config.inline_max_bytes = self
            .inline_max_bytes
            .map(|s| u32::try_from(s.0).unwrap_or(u32::MAX));
    }
}
