//! A plan's load on the generator: each tenant's volume name, the generator's groups aimed at
//! wherever a row's server serves them, and the run on a runtime of its own.
//!
//! Why shared: Headroom's rows and every peer's row drive the *same* load (same tenants, same
//! seeds, same phases) and differ only in where each tenant's export lives, so a row's numbers
//! differ by the server alone.

use std::time::Duration;

use crate::error::RunError;
use crate::plan::Plan;
use crate::{GroupLoad, RunOutcome, RunPlan, SplitMix64, Target, TenantLoad};

/// The progress callback of a row: the fraction done, 0 to 1.
pub type Progress = Box<dyn Fn(f64) + Send + Sync>;

/// A volume name for tenant `i` of a group: `lab-GROUP-i`, within the API's rules.
pub fn volume_name(prefix: &str, group: &str, i: u32) -> String {
    let clean: String = group
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let suffix = format!("-{i}");
    let mut name = format!("{prefix}{clean}");
    name.truncate(64 - suffix.len());
    name + &suffix
}

/// The generator's groups; tenant `i` of a group goes to `target(group, i)`.
pub fn group_loads(plan: &Plan, seed: u64, target: impl Fn(&str, u32) -> Target) -> Vec<GroupLoad> {
    plan.groups
        .iter()
        .enumerate()
        .map(|(gi, g)| GroupLoad {
            name: g.name.clone(),
            tenants: match g.mode {
                None => Vec::new(),
                Some(mode) => (0..g.tenants)
                    .map(|ti| TenantLoad {
                        target: target(&g.name, ti),
                        mode,
                        sizes: g.sizes.clone(),
                        read_permille: g.read_permille,
                        region_bytes: g.region_bytes,
                        sequential: g.sequential,
                        phases: g.phases[ti as usize].clone(),
                        seed: SplitMix64::new(
                            seed ^ ((gi as u64) << 32 | u64::from(ti)).wrapping_mul(0x9e37_79b9),
                        )
                        .next_u64(),
                    })
                    .collect(),
            },
            stats_from: g.stats_from,
            stats_to: g.stats_to,
        })
        .collect()
}

/// Runs the generator on a fresh current-thread runtime (one core for the load; the server
/// has the rest).
pub fn drive(
    groups: &[GroupLoad],
    plan: &Plan,
    progress: Progress,
) -> Result<RunOutcome, RunError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RunError::io("starting the generator's runtime"))?;
    let run_plan = RunPlan {
        duration: plan.duration,
        timeline_bucket: plan.timeline,
        drain_timeout: Duration::from_secs(30),
    };
    Ok(runtime.block_on(crate::run(groups, run_plan, Some(progress)))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_names_keep_the_api_rules() {
        assert_eq!(volume_name("lab-", "victim", 3), "lab-victim-3");
        assert_eq!(volume_name("", "a b/c", 0), "a_b_c-0");
        let long = volume_name("lab-", &"x".repeat(100), 12);
        assert_eq!(long.len(), 64);
        assert!(long.ends_with("-12"));
    }
}
