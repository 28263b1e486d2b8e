//! Cross-node arbitration (`storage.rados_arbitration` and the `storage.rados_capacity_*`,
//! `rados_node_id`, `rados_weight`, `rados_arbitration_epoch_ms` keys): checked against the
//! backend, the policy and the cost model together, since the arbiter sets the device model
//! and capacity itself. The only keys whose meaning spans sections, so they get this file.

use headroom_node::arbitration::ArbitrationConfig;
use headroom_node::{NodeConfig, StoreBackend};
use headroom_qos::model::DeviceModel;

use super::{ConfigFile, Invalid};

/// Cross-node arbitration (`storage.rados_arbitration`): its settings, and the device cost
/// model and capacity it paces the node in (`headroom_node::arbitration`, "The unit").
pub(super) fn arbitration_config(
    layer: &ConfigFile,
    config: &mut NodeConfig,
) -> Result<Option<ArbitrationConfig>, Invalid> {
    let st = &layer.storage;
    if st.rados_arbitration != Some(true) {
        for (key, set) in [
            (
                "storage.rados_capacity_iops",
                st.rados_capacity_iops.is_some(),
            ),
            (
                "storage.rados_capacity_bytes_per_s",
                st.rados_capacity_bytes_per_s.is_some(),
            ),
            ("storage.rados_node_id", st.rados_node_id.is_some()),
            ("storage.rados_weight", st.rados_weight.is_some()),
            (
                "storage.rados_arbitration_epoch_ms",
                st.rados_arbitration_epoch_ms.is_some(),
            ),
        ] {
            if set {
                return Err(Invalid::new(
                    key,
                    "set",
                    "needs storage.rados_arbitration = true (--rados-arbitration)",
                ));
            }
        }
        return Ok(None);
    }
    let StoreBackend::Rados { .. } = config.backend else {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "needs the RADOS backend (storage.rados_conf and rados_pool, without memory)",
        ));
    };
    if config.qos.policy.kind().is_none() {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "needs a scheduling policy: qos.policy is off",
        ));
    }
    if layer.qos.cost.device.is_some() || layer.qos.capacity.device_units_per_s.is_some() {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "sets the device cost model and capacity itself (from rados_capacity_iops and \
             rados_capacity_bytes_per_s): remove qos.cost.device and \
             qos.capacity.device_units_per_s",
        ));
    }
    let iops = match st.rados_capacity_iops {
        Some(iops) if (1..=1_000_000_000).contains(&iops) => iops,
        Some(iops) => {
            return Err(Invalid::new(
                "storage.rados_capacity_iops",
                iops,
                "must be between 1 and 1000000000",
            ));
        }
        None => {
            return Err(Invalid::new(
                "storage.rados_arbitration",
                true,
                "needs storage.rados_capacity_iops (--rados-capacity-iops): the pool's capacity \
                 the nodes share",
            ));
        }
    };
    let bytes = st.rados_capacity_bytes_per_s.map(|s| s.0);
    if let Some(b) = bytes
        && b < iops
    {
        return Err(Invalid::new(
            "storage.rados_capacity_bytes_per_s",
            b,
            format!("must be at least rados_capacity_iops ({iops}): one byte per operation"),
        ));
    }
    let epoch_ms = st
        .rados_arbitration_epoch_ms
        .unwrap_or(headroom_node::arbitration::DEFAULT_EPOCH_MS);
    if !(50..=60_000).contains(&epoch_ms) {
        return Err(Invalid::new(
            "storage.rados_arbitration_epoch_ms",
            epoch_ms,
            "must be between 50 and 60000",
        ));
    }
    let weight = st.rados_weight.unwrap_or(1);
    if !(1..=1_000_000).contains(&weight) {
        return Err(Invalid::new(
            "storage.rados_weight",
            weight,
            "must be between 1 and 1000000",
        ));
    }
    let node_id = match &st.rados_node_id {
        Some(id) => id.clone(),
        None => match config.nbd_listen {
            Some(addr) => format!("{}-{}", host_name(), addr.port()),
            None => format!("{}-unix", host_name()),
        },
    };
    if headroom_store::arbiter::validate_node_id(&node_id).is_err() {
        return Err(Invalid::new(
            "storage.rados_node_id",
            format!("{node_id:?}"),
            "must be 1-64 characters of A-Z a-z 0-9 . _ : -",
        ));
    }
    let arb = ArbitrationConfig {
        node_id,
        weight,
        epoch_ms,
        capacity_iops: iops,
        capacity_bytes_per_s: bytes,
        lock_ms: None,
        fallback_epochs: headroom_node::arbitration::DEFAULT_FALLBACK_EPOCHS,
    };
    let workers = u64::try_from(config.qos.workers).unwrap_or(u64::MAX);
    if arb.capacity_units_per_s() < workers.saturating_mul(1000) {
        return Err(Invalid::new(
            "storage.rados_capacity_iops",
            iops,
            "must be at least qos.workers",
        ));
    }
    config.qos.cost_model.device =
        DeviceModel::Vop(headroom_node::arbitration::vop_curve_for(iops, bytes));
    config.qos.capacity.per_second.device_units = arb.capacity_units_per_s();
    Ok(Some(arb))
}

/// The machine's host name, made a valid node id (`node` if there is none).
fn host_name() -> String {
    let name: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(48)
        .collect();
    if name.is_empty() { "node".into() } else { name }
}
