//! A lab run of a scenario file as a whole: the policies checked and every variant translated
//! before anything starts (so a bad file or flag fails at once), the ledger of what the lab
//! does not honour, the rows to run (variant x policy or peer, or variant x the target's own
//! policy), and each row run by the module that knows its server ([`server`],
//! [`peers`]).
//!
//! Why a session rather than one function: the caller shows the ledger before the first row
//! starts and its own progress between rows (the `headroom` binary prints on stderr and draws
//! a progress bar); the session holds the plans between those steps.

use std::path::{Path, PathBuf};

use headroom_sim::Scenario;

use crate::api::Connector;
use crate::drive::Progress;
use crate::error::RunError;
use crate::peers::{self, PEERS};
use crate::plan::{self, NotHonoured, Plan};
use crate::report::{LabReport, LabResult};
use crate::server;

/// What a lab run is asked to do.
#[derive(Clone, Debug, Default)]
pub struct SessionSpec {
    /// The scenario file.
    pub file: PathBuf,
    /// Seed of every tenant's operations, sizes, offsets, arrivals and phases.
    pub seed: u64,
    /// Policies or peers asked for; empty: the scenario's list.
    pub policies: Vec<String>,
    /// The API of a server already running, to run against instead of starting servers.
    pub target: Option<String>,
    /// The target's API token.
    pub token: Option<String>,
}

/// One row to run: a variant's plan under a policy or peer (empty with a target: its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// Index into the session's plans.
    pub plan: usize,
    pub policy: String,
    /// `policy`, or `policy [variant]`, for messages.
    pub label: String,
}

/// A scenario translated and checked, ready to run row by row.
#[derive(Debug)]
pub struct Session {
    spec: SessionSpec,
    scenario: String,
    plans: Vec<Plan>,
    not_honoured: Vec<NotHonoured>,
    rows: Vec<Row>,
}

impl Session {
    /// Loads the scenario, checks the policies and translates every variant.
    pub fn prepare(spec: SessionSpec) -> Result<Session, RunError> {
        let file = &spec.file;
        let scenario = Scenario::load(file).map_err(|source| RunError::LoadScenario {
            file: file.clone(),
            source,
        })?;
        let requested = &spec.policies;
        let policies = if requested.is_empty() {
            scenario.default_policies()
        } else {
            requested.clone()
        };
        for p in &policies {
            if !peers::is_peer(p) && plan::server_policy(p).is_none() {
                return Err(RunError::UnknownPolicy {
                    policy: p.clone(),
                    peers: PEERS.join(", "),
                });
            }
        }
        let target = spec.target.is_some();
        if target && policies.iter().any(|p| peers::is_peer(p)) {
            return Err(RunError::TargetWithPeers);
        }
        // Every variant is translated before anything starts, so a bad file fails at once.
        let mut plans = Vec::new();
        for (variant, s) in scenario.variants() {
            plans.push(plan::plan(file, variant, s, spec.seed)?);
        }
        let mut not_honoured: Vec<NotHonoured> = Vec::new();
        for n in plans.iter().flat_map(|p| &p.not_honoured) {
            if !not_honoured.iter().any(|m| m.key == n.key) {
                not_honoured.push(n.clone());
            }
        }
        not_honoured.extend(session_notes(&policies, target, requested.is_empty()));
        let rows = if target {
            (0..plans.len())
                .map(|i| Row {
                    plan: i,
                    policy: String::new(),
                    label: label("", &plans[i].variant),
                })
                .collect()
        } else {
            (0..plans.len())
                .flat_map(|i| {
                    let plans = &plans;
                    policies.iter().map(move |p| Row {
                        plan: i,
                        policy: p.clone(),
                        label: label(p, &plans[i].variant),
                    })
                })
                .collect()
        };
        Ok(Session {
            scenario: scenario.name().to_string(),
            spec,
            plans,
            not_honoured,
            rows,
        })
    }

    /// The scenario's name.
    pub fn scenario(&self) -> &str {
        &self.scenario
    }

    /// Scenario keys the lab does not honour (or only approximately), once each.
    pub fn not_honoured(&self) -> &[NotHonoured] {
        &self.not_honoured
    }

    /// The rows, in the order they run.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// The translated variants.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// Runs one row. `exe` is the `headroom` binary (started as `EXE serve` for Headroom's
    /// rows); `connector` reaches the servers' APIs.
    pub fn run_row(
        &self,
        row: &Row,
        exe: &Path,
        connector: &dyn Connector,
        progress: Progress,
    ) -> Result<LabResult, RunError> {
        let plan = &self.plans[row.plan];
        let seed = self.spec.seed;
        match &self.spec.target {
            Some(url) => server::run_target(
                connector,
                plan,
                url,
                self.spec.token.as_deref(),
                &self.spec.policies,
                seed,
                progress,
            ),
            None if peers::is_peer(&row.policy) => {
                peers::run_peer(plan, &row.policy, seed, progress)
            }
            None => server::run_headroom(exe, connector, plan, &row.policy, seed, progress),
        }
    }

    /// The report of the rows run.
    pub fn report(self, results: Vec<LabResult>) -> LabReport {
        LabReport {
            scenario: self.scenario,
            seed: self.spec.seed,
            results,
            not_honoured: self.not_honoured,
        }
    }
}

/// `policy`, or `policy [variant]`.
fn label(policy: &str, variant: &str) -> String {
    if variant.is_empty() {
        policy.to_string()
    } else {
        format!("{policy} [{variant}]")
    }
}

/// What the rows themselves do not honour: the peers' missing device and limits, a target's
/// own node and policy.
fn session_notes(policies: &[String], target: bool, none_requested: bool) -> Vec<NotHonoured> {
    let mut notes = Vec::new();
    if policies.iter().any(|p| p.starts_with("qsd-")) || policies.iter().any(|p| p == "nbdkit-rate")
    {
        notes.push(NotHonoured {
            key: "node.devices (peer rows)".into(),
            reason: "qemu-storage-daemon and nbdkit have no emulated device: their rows run at this machine's RAM and CPU speed".into(),
        });
    }
    if policies.iter().any(|p| p == "nbdkit-rate") {
        notes.push(NotHonoured {
            key: "groups.*.qos (nbdkit-rate row)".into(),
            reason: "nbdkit's rate filter limits bandwidth only: each tenant gets its baseline bytes/s (else its ceiling), no IOPS limit, no burst".into(),
        });
    }
    if target {
        notes.push(NotHonoured {
            key: "node".into(),
            reason: "--target runs on the target's own device, scheduler workers and capacity"
                .into(),
        });
    }
    if target && none_requested {
        notes.push(NotHonoured {
            key: "policies".into(),
            reason: "--target runs the target's own policy (the row's \"policy\"), not the scenario's list".into(),
        });
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_the_variant() {
        assert_eq!(label("burst", ""), "burst");
        assert_eq!(label("burst", "vop"), "burst [vop]");
    }

    #[test]
    fn peers_and_targets_add_their_notes() {
        let keys = |n: Vec<NotHonoured>| n.into_iter().map(|n| n.key).collect::<Vec<_>>();
        assert!(session_notes(&["burst".into()], false, false).is_empty());
        assert_eq!(
            keys(session_notes(&["nbdkit-rate".into()], false, false)),
            ["node.devices (peer rows)", "groups.*.qos (nbdkit-rate row)"]
        );
        assert_eq!(
            keys(session_notes(&["burst".into()], true, true)),
            ["node", "policies"]
        );
    }
}
