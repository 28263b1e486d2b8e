//! `[faults]`: fault injection, a testing tool (EIO, ENOSPC, latency spikes, a device that
//! disappears), off unless the section is there, taken whole from the highest layer that has
//! it. The rules are the store's ([`FaultRule`]), checked there.

use headroom_store::{FaultConfig, FaultRule, FaultScope};
use serde::Deserialize;

use super::{ConfigFile, Invalid, Size};

/// `[faults]`: fault injection, a testing tool, off unless the section is there. Taken whole
/// from the highest layer that has it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsSection {
    /// The same seed and the same order of requests give the same faults (default 0).
    pub seed: Option<u64>,
    /// `[[faults.rule]]` tables.
    #[serde(rename = "rule")]
    pub rules: Vec<FaultRuleSection>,
}

/// `[[faults.rule]]`: one [`FaultRule`]; exactly one of `volume` and `device`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultRuleSection {
    /// Every request of this volume.
    pub volume: Option<String>,
    /// Every operation on this pool device (whichever volume).
    pub device: Option<u32>,
    pub offset_bytes: Option<Size>,
    pub length_bytes: Option<Size>,
    pub eio_read_permille: u32,
    pub eio_write_permille: u32,
    pub eio_sync_permille: u32,
    pub enospc_write_permille: u32,
    pub enospc_sync_permille: u32,
    pub enospc_after_bytes: Option<Size>,
    pub latency_spike_permille: u32,
    pub latency_spike_ms: u64,
    pub disappear_after_ops: Option<u64>,
    pub disappear_after_ms: Option<u64>,
}

impl FaultsSection {
    /// The store's fault configuration; the error names `faults.rule[i].KEY`.
    pub fn config(&self) -> Result<FaultConfig, Invalid> {
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.iter().enumerate() {
            let key = |k: &str| format!("faults.rule[{i}].{k}");
            let scope = match (&r.volume, r.device) {
                (Some(name), None) => FaultScope::Volume(name.clone()),
                (None, Some(id)) => FaultScope::Device(id),
                _ => {
                    return Err(Invalid::new(
                        format!("faults.rule[{i}]"),
                        "",
                        "needs exactly one of volume = \"NAME\" and device = ID",
                    ));
                }
            };
            let rule = FaultRule {
                scope,
                offset_bytes: r.offset_bytes.map_or(0, |s| s.0),
                length_bytes: r.length_bytes.map(|s| s.0),
                eio_read_permille: r.eio_read_permille,
                eio_write_permille: r.eio_write_permille,
                eio_sync_permille: r.eio_sync_permille,
                enospc_write_permille: r.enospc_write_permille,
                enospc_sync_permille: r.enospc_sync_permille,
                enospc_after_bytes: r.enospc_after_bytes.map(|s| s.0),
                latency_spike_permille: r.latency_spike_permille,
                latency_spike_ms: r.latency_spike_ms,
                disappear_after_ops: r.disappear_after_ops,
                disappear_after_ms: r.disappear_after_ms,
            };
            rule.validate()
                .map_err(|e| Invalid::new(key(&e.key), e.value, e.allowed))?;
            if rule.is_inert() {
                return Err(Invalid::new(
                    format!("faults.rule[{i}]"),
                    "",
                    "does nothing: set a *_permille, enospc_after_bytes or disappear_after_* key",
                ));
            }
            rules.push(rule);
        }
        Ok(FaultConfig {
            seed: self.seed.unwrap_or(0),
            rules,
        })
    }
}

/// The fault injection in force: `None` without a `[faults]` section or rules.
pub fn faults_config(layer: &ConfigFile) -> Result<Option<FaultConfig>, Invalid> {
    match &layer.faults {
        None => Ok(None),
        Some(section) => {
            let config = section.config()?;
            Ok((!config.rules.is_empty()).then_some(config))
        }
    }
}
