//! The exchange of cross-node arbitration through RADOS: nodes that share a pool report their
//! demand each epoch, one of them (the arbiter) splits the backend's capacity, every node
//! reads its share (Flint's "bandwidth auction"; the split itself is
//! `headroom_qos::arbitration`, the node side `headroom_node::arbitration`).
//!
//! Why RADOS: the nodes already share the cluster and nothing else; the pool is the one
//! place all of them reach, with atomic omap updates and leased locks. No extra service.
//!
//! **The object.** `arbiter` in the namespace `headroom-cluster` of the pool (stores live in
//! namespaces `headroom-<hex>`, so no store can collide with it). Its omap holds
//! - `report.<node id>`: the node's last report (JSON: weight, reserved and total demand per
//!   second, and the epoch of the last split it had seen), written by the node every epoch;
//! - `shares`: the last split (JSON: epoch, arbiter's node id, capacity, and per node its
//!   report and share), written by the arbiter every epoch.
//!
//! **The arbiter** is whichever node holds the RADOS exclusive lock `arbiter` on the object
//! (taken for `lock_ms`, renewed every epoch with a "must renew" flag; every other node tries
//! to take it every epoch). When the arbiter dies, its lock expires and the next node that
//! tries takes it: a new arbiter within `lock_ms` plus one epoch. Each round the arbiter
//! reads all reports, ignores those that have not seen one of the last `stale_epochs` splits
//! (a node that stopped), removes very old ones, computes the shares and writes `shares`
//! with the epoch incremented. The epoch thus counts splits, not any node's clock: no clock
//! needs to agree between nodes.
//!
//! Two arbiters can overlap for at most one round (the old one's lock expired while it was
//! computing): both then write a split of the same reports, so the worst case is one epoch's
//! shares written twice. Shares never add up to more than the capacity either way.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::StoreError;

/// The RADOS namespace of the arbitration object.
pub const ARBITER_NAMESPACE: &str = "headroom-cluster";
/// Longest node id (`[A-Za-z0-9._:-]`).
pub const MAX_NODE_ID_LEN: usize = 64;

/// How a node takes part in arbitration.
#[derive(Clone, Debug)]
pub struct ArbiterSettings {
    /// The cluster's `ceph.conf`.
    pub conf: PathBuf,
    /// The cephx user, without `client.` (`RadosTarget::id`).
    pub id: String,
    pub pool: String,
    /// This node's id among the nodes sharing the pool (unique, `[A-Za-z0-9._:-]`, ≤ 64).
    pub node_id: String,
    /// How long the arbiter's lock lasts without renewal.
    pub lock_ms: u64,
    /// Reports that have not seen one of the last this many splits are ignored.
    pub stale_epochs: u64,
}

/// What a node reports for one epoch (backend capacity units per second).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    pub weight: u64,
    pub reserved: u64,
    pub demand: u64,
}

/// One node in a split: what it reported and what it got.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeShare {
    pub node: String,
    pub weight: u64,
    pub reserved: u64,
    pub demand: u64,
    pub share: u64,
}

/// The arbiter's last split.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    pub epoch: u64,
    /// The node id of the arbiter that wrote it.
    pub arbiter: String,
    /// The backend capacity split (units per second).
    pub capacity: u64,
    pub nodes: Vec<NodeShare>,
}

/// What one round gave.
#[derive(Clone, Debug)]
pub struct Round {
    /// This node held the arbiter lock this round (and wrote `split`).
    pub is_arbiter: bool,
    /// The newest split: the one this node wrote, or the last the arbiter wrote.
    pub split: Option<Split>,
}

/// Checks a node id: 1-64 characters of `[A-Za-z0-9._:-]`.
pub fn validate_node_id(id: &str) -> Result<(), StoreError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_NODE_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidConfig(format!(
            "arbitration node id {id:?}: must be 1-{MAX_NODE_ID_LEN} characters of \
             A-Z a-z 0-9 . _ : -"
        )))
    }
}

#[cfg(feature = "rados")]
pub use imp::Arbiter;

#[cfg(not(feature = "rados"))]
pub use stub::Arbiter;

#[cfg(not(feature = "rados"))]
mod stub {
    use super::*;

    /// Without the `rados` feature there is nothing to arbitrate.
    #[derive(Debug)]
    pub struct Arbiter(());

    impl Arbiter {
        pub fn connect(_settings: ArbiterSettings) -> Result<Arbiter, StoreError> {
            Err(StoreError::InvalidConfig(
                "arbitration needs a build with RADOS support (cargo feature `rados`)".into(),
            ))
        }

        pub fn round(
            &mut self,
            _report: NodeReport,
            _capacity: u64,
            _split: impl FnOnce(u64, &[NodeShare]) -> Vec<u64>,
        ) -> Result<Round, StoreError> {
            Err(StoreError::InvalidConfig("no RADOS support".into()))
        }

        pub fn close(self) {}
    }
}

#[cfg(feature = "rados")]
mod imp {
    use std::ffi::{CStr, CString};
    use std::time::Duration;

    use super::*;
    use crate::rados::{OmapBatch, Pool};

    const OBJECT: &CStr = c"arbiter";
    const LOCK: &CStr = c"arbiter";
    const SHARES_KEY: &str = "shares";
    const REPORT_PREFIX: &str = "report.";
    /// Largest report or split value read back (bytes): bounds what a corrupt object can make us
    /// parse.
    const MAX_VALUE_BYTES: usize = 1 << 20;

    #[derive(Serialize, Deserialize)]
    struct StoredReport {
        #[serde(flatten)]
        report: NodeReport,
        /// The epoch of the newest split the node had read.
        seen_epoch: u64,
    }

    /// A node's connection to the arbitration object.
    pub struct Arbiter {
        pool: Pool,
        settings: ArbiterSettings,
        cookie: CString,
        holds_lock: bool,
    }

    impl std::fmt::Debug for Arbiter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Arbiter")
                .field("node_id", &self.settings.node_id)
                .field("holds_lock", &self.holds_lock)
                .finish()
        }
    }

    fn io_err(e: std::io::Error) -> StoreError {
        StoreError::Io(e)
    }

    impl Arbiter {
        /// Connects to the pool's arbitration namespace (a RADOS client of its own, apart from
        /// the store's, so that fencing a store's client never touches it).
        pub fn connect(settings: ArbiterSettings) -> Result<Arbiter, StoreError> {
            validate_node_id(&settings.node_id)?;
            let pool = Pool::connect(
                &settings.conf,
                &settings.id,
                &settings.pool,
                ARBITER_NAMESPACE,
            )
            .map_err(io_err)?;
            let cookie = CString::new(format!(
                "{}-{}",
                settings.node_id,
                crate::rados::new_namespace().map_err(io_err)?
            ))
            .map_err(|_| StoreError::InvalidConfig("arbiter cookie".into()))?;
            Ok(Arbiter {
                pool,
                settings,
                cookie,
                holds_lock: false,
            })
        }

        /// One epoch: reads the last split, writes this node's report, takes or renews the
        /// arbiter lock, and if it holds it computes the next split with `split` (capacity
        /// and the live nodes' reports, shares returned in their order) and writes it.
        pub fn round(
            &mut self,
            report: NodeReport,
            capacity: u64,
            split: impl FnOnce(u64, &[NodeShare]) -> Vec<u64>,
        ) -> Result<Round, StoreError> {
            let entries = self
                .pool
                .omap_load(OBJECT, c"")
                .map_err(io_err)?
                .unwrap_or_default();
            let mut last: Option<Split> = None;
            let mut reports: Vec<(String, StoredReport)> = Vec::new();
            for (key, value) in &entries {
                if value.len() > MAX_VALUE_BYTES {
                    continue;
                }
                let Ok(key) = std::str::from_utf8(key) else {
                    continue;
                };
                if key == SHARES_KEY {
                    last = serde_json::from_slice(value).ok();
                } else if let Some(node) = key.strip_prefix(REPORT_PREFIX)
                    && validate_node_id(node).is_ok()
                    && let Ok(r) = serde_json::from_slice::<StoredReport>(value)
                {
                    reports.push((node.to_owned(), r));
                }
            }
            let epoch = last.as_ref().map_or(0, |s| s.epoch);
            let mine = StoredReport {
                report,
                seen_epoch: epoch,
            };
            let key = format!("{REPORT_PREFIX}{}", self.settings.node_id);
            let value = serde_json::to_vec(&mine)
                .map_err(|e| StoreError::InvalidConfig(format!("report: {e}")))?;
            self.pool
                .omap_commit(
                    OBJECT,
                    &OmapBatch {
                        set: vec![(key.into_bytes(), value)],
                        ..OmapBatch::default()
                    },
                )
                .map_err(io_err)?;
            reports.retain(|(node, _)| *node != self.settings.node_id);
            reports.push((self.settings.node_id.clone(), mine));
            if !self.take_lock()? {
                return Ok(Round {
                    is_arbiter: false,
                    split: last,
                });
            }
            // Arbiter: split between the nodes that have seen a recent split.
            let stale = self.settings.stale_epochs.max(1);
            let (live, dead): (Vec<_>, Vec<_>) = reports
                .into_iter()
                .partition(|(_, r)| r.seen_epoch.saturating_add(stale) >= epoch);
            let mut nodes: Vec<NodeShare> = live
                .into_iter()
                .map(|(node, r)| NodeShare {
                    node,
                    weight: r.report.weight,
                    reserved: r.report.reserved,
                    demand: r.report.demand,
                    share: 0,
                })
                .collect();
            nodes.sort_by(|a, b| a.node.cmp(&b.node));
            let shares = split(capacity, &nodes);
            for (n, s) in nodes.iter_mut().zip(shares) {
                n.share = s;
            }
            let next = Split {
                epoch: epoch + 1,
                arbiter: self.settings.node_id.clone(),
                capacity,
                nodes,
            };
            let value = serde_json::to_vec(&next)
                .map_err(|e| StoreError::InvalidConfig(format!("split: {e}")))?;
            // Reports of nodes gone for long are dropped with the write.
            let rm = dead
                .into_iter()
                .filter(|(_, r)| r.seen_epoch.saturating_add(stale * 10) < epoch)
                .map(|(node, _)| format!("{REPORT_PREFIX}{node}").into_bytes())
                .collect();
            self.pool
                .omap_commit(
                    OBJECT,
                    &OmapBatch {
                        rm,
                        set: vec![(SHARES_KEY.as_bytes().to_vec(), value)],
                        ..OmapBatch::default()
                    },
                )
                .map_err(io_err)?;
            Ok(Round {
                is_arbiter: true,
                split: Some(next),
            })
        }

        /// Leaves arbitration: removes this node's report and releases the arbiter lock if
        /// it holds it (what dropping it does).
        pub fn close(self) {}

        /// Renews the arbiter lock if this node holds it, else tries to take it.
        fn take_lock(&mut self) -> Result<bool, StoreError> {
            let duration = Duration::from_millis(self.settings.lock_ms.max(1));
            if self.holds_lock {
                match self
                    .pool
                    .lock_exclusive(OBJECT, LOCK, &self.cookie, duration, true)
                {
                    Ok(true) => return Ok(true),
                    Ok(false) | Err(_) => {
                        tracing::warn!(
                            node = self.settings.node_id.as_str(),
                            "lost the arbiter lock (expired or taken over)"
                        );
                        self.holds_lock = false;
                    }
                }
            }
            self.holds_lock = self
                .pool
                .lock_exclusive(OBJECT, LOCK, &self.cookie, duration, false)
                .map_err(io_err)?;
            if self.holds_lock {
                tracing::info!(
                    node = self.settings.node_id.as_str(),
                    "this node is the arbiter now"
                );
            }
            Ok(self.holds_lock)
        }
    }

    impl Drop for Arbiter {
        fn drop(&mut self) {
            // A clean stop leaves the split at the next round instead of after four epochs,
            // and hands the role over at once instead of after the lock's duration.
            let key = format!("{REPORT_PREFIX}{}", self.settings.node_id).into_bytes();
            let batch = OmapBatch {
                rm: vec![key],
                ..OmapBatch::default()
            };
            if let Err(e) = self.pool.omap_commit(OBJECT, &batch) {
                tracing::warn!(error = %e, "removing this node's arbitration report failed");
            }
            if self.holds_lock
                && let Err(e) = self.pool.unlock(OBJECT, LOCK, &self.cookie)
            {
                tracing::warn!(error = %e, "releasing the arbiter lock failed; it expires by itself");
            }
        }
    }
}
