//! `[metrics]`: which volumes get series of their own in `/metrics` (the cardinality an
//! operator's Prometheus pays for), declared once here (file name, help, check, the node's
//! [`MetricsConfig`]).

use clap::Args;
use headroom_node::metrics::MetricsConfig;
use merge::Merge;
use serde::Deserialize;

use super::Invalid;

/// `[metrics]`: which volumes get series of their own in `/metrics`.
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct MetricsSection {
    /// Volumes idle longer than this are folded into `volume="_other"`.
    #[arg(skip)]
    pub volume_series_idle_s: Option<u64>,
    /// Most volumes with series of their own.
    #[arg(skip)]
    pub max_volume_series: Option<usize>,
}

impl MetricsSection {
    /// The table over [`MetricsConfig::default`].
    pub(super) fn metrics_config(&self) -> Result<MetricsConfig, Invalid> {
        let d = MetricsConfig::default();
        let config = MetricsConfig {
            volume_series_idle_s: self.volume_series_idle_s.unwrap_or(d.volume_series_idle_s),
            max_volume_series: self.max_volume_series.unwrap_or(d.max_volume_series),
        };
        // The node's rule (the defaults pass it).
        config.validate()?;
        Ok(config)
    }
}
