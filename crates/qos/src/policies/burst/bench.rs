//! Burst's allocation driven alone, for the criterion benchmark (`burst_window_allocation`)
//! and the `overhead_count` example, through `crate::bench_support`.
//!
//! Why a module of its own: the fixture needs the rules' private state (it gives every active
//! volume a window of synthetic usage by writing their `WinState` directly, then runs one
//! window's allocation through `tick`), so it lives inside `burst`; it is not scheduling code,
//! so it is kept apart from the rules and the allocation kernel, and compiled only with the
//! `bench-support` feature (and in unit tests, which share its volumes and check it below).

use super::{BurstRules, BurstVol};
use crate::cost::CostVector;
use crate::engine::{Entry, Rules};
use crate::limiter::Charge;
use crate::policy::PolicyParams;
use crate::sched::Slab;
use crate::vocab::{BurstMode, IoRate, NodeCapacity, VolumeQos};

/// The volumes of the allocation bench and tests: 100 IOPS baselines bursting on demand.
pub(super) fn on_demand_100_iops() -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(100, 10_000_000),
        ceiling: IoRate::new(10_000, 1_000_000_000),
        burst: BurstMode::OnDemand,
        weight: 1,
        io_unit_bytes: 0,
    }
}

/// Drives the per-window allocation alone, for the benchmark (see `crate::bench_support`).
#[derive(Debug)]
pub(crate) struct AllocationBench {
    rules: BurstRules,
    vols: Slab<Entry<BurstVol>>,
    active: Vec<u32>,
    now_ns: u64,
    device_units_per_io: u64,
}

impl AllocationBench {
    /// `defined` volumes, the first `active` of them with usage. `oversold`: the node sold ten
    /// times its device capacity in baselines (1 device, 100 µs of device time per I/O), so
    /// round 1 is rescaled every window; otherwise the node is sized for its baselines (8
    /// workers, 8 devices, 100 GbE, 1 µs of device time per I/O), as Burst's guarantee
    /// assumes.
    pub(crate) fn new(defined: u32, active: u32, oversold: bool) -> Self {
        let capacity = NodeCapacity::new(if oversold {
            CostVector::new(1_000_000_000, 10_000_000_000, 10_000_000_000, 1_000_000_000)
        } else {
            CostVector::new(8_000_000_000, 12_500_000_000, 12_500_000_000, 8_000_000_000)
        });
        let device_units_per_io = if oversold { 100_000 } else { 1_000 };
        let mut rules = BurstRules::new(capacity, &PolicyParams::default());
        let qos = on_demand_100_iops();
        for idx in 0..defined {
            let _ = rules.new_vol(0, idx, &qos);
        }
        let mut vol = rules.new_vol(0, 0, &qos);
        for idx in 0..active {
            rules.became_backlogged(0, idx, &mut vol);
        }
        AllocationBench {
            rules,
            vols: Slab::default(),
            active: (0..active).collect(),
            now_ns: 0,
            device_units_per_io,
        }
    }

    pub(crate) fn set_cpu_level(&mut self, level: crate::cpu::CpuLevel) {
        self.rules.cpu = level;
    }

    /// Simulates one window of usage on every active volume (not part of the measurement).
    pub(crate) fn prepare(&mut self) {
        let dev = self.device_units_per_io;
        for (k, &idx) in self.active.iter().enumerate() {
            let st = self.rules.slot(idx);
            let n = 1 + (k as u64 % 7);
            st.observe(
                Charge {
                    units: 1,
                    bytes: 4096,
                },
                &CostVector::new(2_000, 0, 4096, dev),
            );
            st.consumed = CostVector::new(2_000 * n, 0, 4096 * n, dev * n);
            st.burst_seen = n / 2 > 0;
            if k % 3 == 0 {
                st.throttled = CostVector::new(2_000, 0, 4096, dev);
            }
        }
    }

    /// Runs the next window's allocation; returns the number of active volumes.
    pub(crate) fn allocate(&mut self) -> usize {
        self.now_ns += self.rules.window_ns;
        let _ = self.rules.tick(self.now_ns, &mut self.vols);
        self.rules.last_alloc.active_volumes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuLevel;

    /// What the bench asserts every iteration, checked without running it: each window's
    /// allocation covers exactly the active volumes (of many more defined), on both nodes and
    /// at every vector level, window after window.
    #[test]
    fn allocation_bench_allocates_to_every_active_volume() {
        for oversold in [false, true] {
            for level in CpuLevel::available() {
                let mut b = AllocationBench::new(1_000, 64, oversold);
                b.set_cpu_level(level);
                for _ in 0..3 {
                    b.prepare();
                    assert_eq!(b.allocate(), 64, "oversold {oversold}, {}", level.as_str());
                }
            }
        }
    }
}
