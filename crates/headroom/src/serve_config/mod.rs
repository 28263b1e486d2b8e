//! The `serve` configuration: a TOML file, the command line over it, and the file
//! `headroom calibrate` wrote under it.
//!
//! A [`ConfigFile`] is one layer of settings, every key optional. Layers are merged highest
//! first, key by key ([`ConfigFile::over`]):
//!
//! 1. command-line flags (`serve --io-threads 4`, `--policy off`, ...);
//! 2. `--config FILE`;
//! 3. `DATA_DIR/calibration.toml`, when the data directory holds one;
//! 4. built-in defaults ([`resolve`] applies them: those of [`NodeConfig::new`],
//!    [`Limits::default`] and [`QosConfig::default`]).
//!
//! A few keys are merged as a unit: `storage.emulated` (a device is described whole), each of
//! `qos.cost.cpu.read|write|other`, and `qos.cost.device`. A layer that sets `qos.cost.device`
//! also decides `qos.capacity.device_units_per_s` (absent there: unlimited), because device
//! units mean device-ns for a linear model and milli-VOPs for a VOP curve; a lower layer's
//! capacity in the other unit would be wrong.
//!
//! One description of each setting: a key is a field of its section's struct (one file per
//! section: `server.rs`, `storage.rs`, ...), which gives its name in the file (serde), its
//! flag where it has one (clap: the same struct is flattened into `serve`'s arguments, so a
//! flag is an attribute on the field), its help (the field's doc comment), how two layers
//! merge (`merge`), its check and where it lands in the `NodeConfig` (the section's `check`
//! and `apply`). docs/configuration.md documents each key; `config_docs` fails when a key or
//! a flag is missing there.
//!
//! Every table rejects unknown keys. Sizes are bytes or strings such as `"64KiB"`, `"4GiB"`,
//! `"2GB"` (the CLI's size syntax). Values out of range fail with the key, the value and
//! what is allowed: `qos.workers = 0: must be between 1 and 64`. docs/operations.md
//! ("Configuration file") describes every key.

mod api;
mod arbitration;
mod cost;
mod emulated;
mod faults;
mod invalid;
mod limits;
mod metrics;
mod qos;
mod server;
mod size;
mod storage;
mod tls;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use headroom_node::{NodeConfig, StoreBackend};
use headroom_qos::model::DeviceModel;
use headroom_store::FaultConfig;
use merge::Merge;
use serde::Deserialize;

pub use api::ApiSection;
pub use faults::{FaultsSection, faults_config};
pub use invalid::Invalid;
pub use limits::LimitsSection;
pub use metrics::MetricsSection;
pub use qos::QosSection;
pub use server::ServerSection;
pub use size::Size;
pub use storage::StorageSection;
pub use tls::TlsSection;

/// The file `headroom calibrate` writes in the data directory, loaded under `--config`.
pub const CALIBRATION_FILE: &str = "calibration.toml";
/// Data directory when neither a flag nor a file names one.
pub const DEFAULT_DATA_DIR: &str = "./headroom-data";
/// Device files in a new data directory by default.
pub const DEFAULT_DEVICES: u32 = 2;
/// Capacity of each device file in a new data directory by default (sparse).
pub const DEFAULT_DEVICE_SIZE: u64 = 64 << 30;

/// One layer of settings (a file, or the command line). Every key is optional. As clap
/// arguments (flattened into `serve` and `demo`) it is the command line's layer, each
/// section under a heading of its own in `--help`.
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigFile {
    #[command(flatten, next_help_heading = "Server")]
    pub server: ServerSection,
    #[command(flatten, next_help_heading = "Storage")]
    pub storage: StorageSection,
    #[command(flatten, next_help_heading = "Limits")]
    pub limits: LimitsSection,
    #[command(flatten, next_help_heading = "Scheduling")]
    pub qos: QosSection,
    #[command(flatten, next_help_heading = "TLS")]
    pub tls: TlsSection,
    #[command(flatten)]
    pub metrics: MetricsSection,
    #[command(flatten)]
    pub api: ApiSection,
    /// Fault injection (a testing tool); absent: off.
    #[arg(skip)]
    #[merge(strategy = merge::option::overwrite_none)]
    pub faults: Option<FaultsSection>,
}

impl ConfigFile {
    /// Parses a file's text and checks every value on its own (`origin` names the file in
    /// errors). Checks between keys, which may come from different layers, are [`resolve`]'s.
    pub fn parse(text: &str, origin: &Path) -> Result<ConfigFile> {
        let layer: ConfigFile = toml::from_str(text)
            .with_context(|| format!("configuration file {}", origin.display()))?;
        layer
            .check()
            .with_context(|| format!("configuration file {}", origin.display()))?;
        Ok(layer)
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading configuration file {}", path.display()))?;
        Self::parse(&text, path)
    }

    /// This layer's keys where it has them, `lower`'s elsewhere, key by key (the derived
    /// [`Merge`]; the keys merged as a unit are `Option`s of a whole table or line, see the
    /// module doc). A layer that sets `qos.cost.device` also decides
    /// `qos.capacity.device_units_per_s`: a lower layer's capacity would be in another unit.
    pub fn over(mut self, mut lower: ConfigFile) -> ConfigFile {
        if self.qos.cost.device.is_some() {
            lower.qos.capacity.device_units_per_s = None;
        }
        self.merge(lower);
        self
    }

    /// The data directory in force (where `calibration.toml` is looked for).
    pub fn data_dir(&self) -> PathBuf {
        self.storage
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
    }

    /// Checks every value that can be checked on its own, section by section.
    pub fn check(&self) -> Result<(), Invalid> {
        self.server.check()?;
        self.storage.check()?;
        self.limits.check()?;
        self.qos.check()?;
        if let Some(faults) = &self.faults {
            faults.config()?;
        }
        self.api.check()?;
        Ok(())
    }
}

/// Applies the built-in defaults to a merged layer and checks it whole: the configuration
/// `Node::start` gets.
pub fn resolve(layer: &ConfigFile) -> Result<NodeConfig, Invalid> {
    layer.check()?;
    let st = &layer.storage;
    let mut config = NodeConfig::new(st.backend(layer.data_dir())?);
    st.apply(&mut config);
    layer.api.apply(&mut config);
    layer.server.apply(&mut config);
    config.nbd_unix = layer.server.unix_config()?;
    // Injected latency spikes block the thread a request runs on; run inline on a network
    // thread, a spike would stall every connection of that thread, which no real memory
    // device does. Unless the operator chose an inline size, nothing runs inline then.
    let spikes = layer
        .faults
        .as_ref()
        .is_some_and(|f| f.rules.iter().any(|r| r.latency_spike_permille > 0));
    if spikes && config.inline_max_bytes.is_none() {
        config.inline_max_bytes = Some(0);
    }
    config.limits = layer.limits.limits()?;
    if let Some(ms) = layer.qos.credit_save_period_ms {
        config.credit_save_period_ms = ms;
    }
    config.qos = layer.qos.qos_config()?;
    config.arbitration = arbitration::arbitration_config(layer, &mut config)?;
    config.tls = layer.tls.tls_config()?;
    config.metrics = layer.metrics.metrics_config()?;
    Ok(config)
}

/// Settings that are allowed but probably not what was meant.
pub fn warnings(layer: &ConfigFile, config: &NodeConfig) -> Vec<String> {
    let mut out = Vec::new();
    if config.emulated_device.is_some()
        && config.qos.policy.kind().is_some()
        && layer.qos.cost.device.is_none()
    {
        out.push(
            "storage.emulated is set but qos.cost.device is not: the scheduler charges no device \
             cost, so it cannot share the emulated device (set qos.cost.device = { linear = ... } \
             to the same model)"
                .to_string(),
        );
    }
    if config.qos.cost_model.device == DeviceModel::None
        && layer.qos.capacity.device_units_per_s.is_some()
    {
        out.push(
            "qos.capacity.device_units_per_s is set but qos.cost.device is \"none\": requests \
             cost no device units, so it never binds"
                .to_string(),
        );
    }
    out
}

/// A configuration ready for `Node::start`, and where it came from.
#[derive(Debug)]
pub struct Loaded {
    pub node: NodeConfig,
    /// Fault injection to install on the store once it is open (`[faults]`).
    pub faults: Option<FaultConfig>,
    /// `--config`, if given.
    pub config_file: Option<PathBuf>,
    /// `DATA_DIR/calibration.toml`, if it was loaded.
    pub calibration_file: Option<PathBuf>,
    pub warnings: Vec<String>,
    /// Where the API token may come from (`token::server_token` decides).
    pub token: crate::token::TokenSettings,
}

/// Merges the command line over `--config` over the data directory's calibration file over
/// the defaults, and checks the result.
pub fn load(cli: ConfigFile, config_path: Option<&Path>) -> Result<Loaded> {
    let file = match config_path {
        Some(path) => ConfigFile::load(path)?,
        None => ConfigFile::default(),
    };
    let upper = cli.over(file);
    let data_dir = upper.data_dir();
    let calibration = data_dir.join(CALIBRATION_FILE);
    let same_as_config = config_path.is_some_and(|p| same_file(p, &calibration));
    let (merged, calibration_file) = if !same_as_config && calibration.is_file() {
        let lower = ConfigFile::load(&calibration)?;
        (upper.over(lower), Some(calibration))
    } else {
        (upper, None)
    };
    let sources = match (config_path, &calibration_file) {
        (Some(c), Some(k)) => format!("the command line, {} and {}", c.display(), k.display()),
        (Some(c), None) => format!("the command line and {}", c.display()),
        (None, Some(k)) => format!("the command line and {}", k.display()),
        (None, None) => "the command line".to_string(),
    };
    let node =
        resolve(&merged).with_context(|| format!("invalid configuration (from {sources})"))?;
    let faults = faults_config(&merged)
        .with_context(|| format!("invalid configuration (from {sources})"))?;
    let warnings = warnings(&merged, &node);
    // A memory node keeps its token in the data directory only when one was named.
    let token_dir = match &node.backend {
        StoreBackend::Files { data_dir, .. } | StoreBackend::Rados { data_dir, .. } => {
            Some(data_dir.clone())
        }
        StoreBackend::Memory { .. } => merged.storage.data_dir.clone(),
    };
    let mut node = node;
    if let Some(dir) = &token_dir {
        node.api_tokens_file = Some(dir.join(crate::token::TOKENS_FILE));
        node.audit_log = Some(dir.join(crate::token::AUDIT_LOG_FILE));
    }
    if let Some(path) = &merged.api.audit_log {
        node.audit_log = Some(path.clone());
    }
    let token = crate::token::TokenSettings {
        configured: merged.api.token.clone(),
        data_dir: token_dir,
    };
    Ok(Loaded {
        node,
        faults,
        config_file: config_path.map(Path::to_path_buf),
        calibration_file,
        warnings,
        token,
    })
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests;
