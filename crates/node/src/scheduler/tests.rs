//! The scheduler as a whole: charges, pinned volumes, the gate behind the policy, the global
//! pool. (The gate alone is tested in `gate.rs`.)

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use headroom_qos::model::{CpuModel, DeviceModel, IoCostModel};
use headroom_qos::{CostModel, CostVector, NodeCapacity, Phase, PolicyKind, VolumeQos};

use super::config::PolicyChoice;
use super::volume::too_small_to_split;
use super::*;

/// Keeps what the wake-up thread releases, for the test to run.
#[derive(Default)]
struct Collect(Mutex<Vec<Ready<u32>>>);
impl Runner<u32> for Collect {
    fn run(&self, _: &Arc<Scheduler<u32>>, ready: Vec<Ready<u32>>) {
        lock(&self.0).extend(ready);
    }
}

/// The device model of [`scheduler`]: a 4 KiB random read costs 50,000 units.
const TEST_DEVICE: IoCostModel = IoCostModel {
    rbps: 200_000_000,
    rseqiops: 48_828,
    rrandiops: 20_000,
    wbps: 150_000_000,
    wseqiops: 36_621,
    wrandiops: 15_000,
};

/// One worker, Burst, a device capacity so large that the pacer hardly binds (10¹² units
/// per second; a 4 KiB random read costs 50,000), and a gate of two requests.
fn scheduler() -> (Arc<Scheduler<u32>>, Arc<Collect>) {
    let model = TEST_DEVICE;
    let config = QosConfig {
        policy: PolicyChoice::Policy(PolicyKind::Burst),
        capacity: NodeCapacity::new(CostVector::new(
            u64::MAX,
            u64::MAX,
            u64::MAX,
            1_000_000_000_000,
        )),
        cost_model: CostModel::new(CpuModel::default(), DeviceModel::Linear(model)),
        workers: 1,
        burst_in_flight: Some(2),
        ..QosConfig::default()
    };
    let collect = Arc::new(Collect::default());
    let s = Scheduler::start(&config, Clock::new(), collect.clone(), None).expect("scheduler");
    (s, collect)
}

fn read(offset_bytes: u64) -> IoDesc {
    IoDesc {
        op: OpKind::Read,
        offset_bytes,
        len_bytes: 4096,
        syncs: 0,
    }
}

/// Everything the policy dispatched (by a submission or by the wake-up thread), once the
/// policy holds nothing more for `handle` (waits up to a deadline for the wake-up thread).
fn dispatched(
    s: &Scheduler<u32>,
    collect: &Collect,
    handle: &VolumeHandle,
    mut ready: Vec<Ready<u32>>,
) -> Vec<Ready<u32>> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.queued_requests(handle) > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        s.queued_requests(handle),
        0,
        "the policy never released everything"
    );
    ready.append(&mut lock(&collect.0));
    ready.sort_by_key(|r| r.job);
    ready
}

fn waiting(s: &Scheduler<u32>) -> usize {
    lock(&s.gate.state).waiting.len()
}

#[test]
fn a_request_is_charged_every_sync_it_causes() {
    let (s, collect) = scheduler();
    let volume = s.add_volume(1, &VolumeQos::default());
    let model = CostModel::new(CpuModel::default(), DeviceModel::Linear(TEST_DEVICE));
    let charged = |desc: IoDesc| {
        let before = s.dispatched_cost_total();
        let mut ready = Vec::new();
        s.submit(&volume, desc, 0, &mut ready);
        let ran = dispatched(&s, &collect, &volume, ready);
        let cost = s.dispatched_cost_total().saturating_sub(before);
        for r in ran {
            s.complete(r.ticket, &mut Vec::new());
        }
        cost
    };
    let write = IoDesc {
        op: OpKind::Write,
        offset_bytes: 1 << 30,
        len_bytes: 4096,
        syncs: 0,
    };
    // The online corrections only scale estimates up (from 1000 permille), and may move
    // between requests here: compare within that.
    let plain = charged(write);
    // Far from the first (both random, as the cost model sees them).
    let fua = charged(IoDesc {
        syncs: 1,
        offset_bytes: 3 << 30,
        ..write
    });
    let sync = model.estimate_sync(4096);
    assert!(
        fua.cpu_ns >= plain.cpu_ns + sync.cpu_ns,
        "{fua:?} {plain:?}"
    );
    assert!(fua.device_units >= plain.device_units + sync.device_units);
    assert_eq!((fua.ingress_bytes, fua.egress_bytes), (4096, 0));
    let flush = IoDesc {
        op: OpKind::Flush,
        offset_bytes: 0,
        len_bytes: 0,
        syncs: 3,
    };
    let sync = model.estimate_sync(0);
    let three = charged(flush);
    assert!(three.cpu_ns >= 3 * sync.cpu_ns, "{three:?}");
    assert!(three.device_units >= 3 * sync.device_units);
    let none = charged(IoDesc { syncs: 0, ..flush });
    assert!(
        none.cpu_ns < sync.cpu_ns / 10,
        "a FLUSH's own work is small: {none:?}"
    );
    // Bounded: a FLUSH of a pool of a thousand dirty devices pays for MAX_CHARGED_SYNCS.
    let many = charged(IoDesc {
        syncs: 1_000,
        ..flush
    });
    assert!(many.cpu_ns >= u64::from(MAX_CHARGED_SYNCS) * sync.cpu_ns);
    assert!(many.cpu_ns < 200 * sync.cpu_ns, "{many:?}");
    s.stop();
}

#[test]
fn a_ceiling_below_the_worker_count_still_runs_under_one_to_n() {
    // 3 IOPS over 4 workers would be 0 IOPS per worker: the volume runs whole on its home
    // worker instead, under every policy, and its first request runs at once.
    for kind in PolicyKind::ALL {
        let config = QosConfig {
            policy: PolicyChoice::Policy(kind),
            workers: 4,
            dispatch: DispatchMode::OneToN,
            ..QosConfig::default()
        };
        let collect = Arc::new(Collect::default());
        let s = Scheduler::start(&config, Clock::new(), collect.clone(), None).expect("scheduler");
        let tiny = VolumeQos::fixed(headroom_qos::IoRate::new(3, u64::MAX));
        let volume = s.add_volume(7, &tiny);
        let mut ready = Vec::new();
        s.submit(&volume, read(0), 0, &mut ready);
        let ran = dispatched(&s, &collect, &volume, ready);
        assert_eq!(ran.len(), 1, "{kind}: the request never ran");
        // A QoS that splits again spreads the volume over the workers again.
        s.update_qos(
            &volume,
            &VolumeQos::fixed(headroom_qos::IoRate::new(4_000, u64::MAX)),
        );
        assert!(!volume.pinned.load(Ordering::Relaxed), "{kind}");
        s.stop();
    }
    assert!(too_small_to_split(
        &VolumeQos::fixed(headroom_qos::IoRate::new(u64::MAX, 3)),
        4
    ));
    assert!(!too_small_to_split(&VolumeQos::default(), 4));
    assert!(!too_small_to_split(
        &VolumeQos::fixed(headroom_qos::IoRate::new(3, u64::MAX)),
        1
    ));
}

#[test]
fn burst_work_in_flight_is_bounded_and_released_by_completions() {
    let (s, collect) = scheduler();
    let burster = s.add_volume(1, &VolumeQos::default());
    let mut ready = Vec::new();
    for i in 0..5u32 {
        // Far apart: random reads.
        s.submit(&burster, read(u64::from(i) << 30), i, &mut ready);
    }
    // The policy lets all five go; the gate lets two run and holds three, in order.
    let mut running = dispatched(&s, &collect, &burster, ready);
    assert_eq!(
        running.iter().map(|r| r.job).collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert!(running.iter().all(|r| r.ticket.phase() != Phase::Baseline));
    assert_eq!(waiting(&s), 3);
    let mut released = Vec::new();
    s.complete(running.remove(0).ticket, &mut released);
    assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![2]);
    assert_eq!(waiting(&s), 2);
    s.stop();
}

#[test]
fn the_global_pool_rebalances_no_faster_than_its_shortest_period() {
    // A 1 ms policy window still rebalances every 10 ms; a longer window sets the period.
    for (window_ns, period_ns) in [(1_000_000, 10_000_000), (50_000_000, 50_000_000)] {
        let mut config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            workers: 2,
            ..QosConfig::default()
        };
        config.params.window_ns = window_ns;
        let collect = Arc::new(Collect::default());
        let s = Scheduler::start(&config, Clock::new(), collect, None).expect("scheduler");
        assert_eq!(s.pool.as_ref().map(|p| p.period_ns), Some(period_ns));
    }
}

#[test]
fn the_global_pool_lends_an_idle_workers_capacity_to_a_busy_one() {
    let config = QosConfig {
        policy: PolicyChoice::Policy(PolicyKind::Burst),
        capacity: NodeCapacity::new(CostVector::new(u64::MAX, u64::MAX, u64::MAX, 1_000_000_000)),
        workers: 2,
        dispatch: DispatchMode::OneToOne,
        ..QosConfig::default()
    };
    let collect = Arc::new(Collect::default());
    let s = Scheduler::start(&config, Clock::new(), collect, None).expect("scheduler");
    let device = |v: &CostVector| v.dims()[3];
    assert_eq!(
        s.worker_shares().iter().map(device).collect::<Vec<_>>(),
        vec![500_000_000; 2]
    );
    // Over 10 ms, worker 0 used its whole share and held requests back; worker 1 idled.
    {
        let mut busy = lock(&s.workers[0].state);
        busy.used = CostVector::new(0, 0, 0, 5_000_000);
        busy.held_back = true;
    }
    let mut ready = Vec::new();
    s.rebalance(s.clock.now_ns(), 10_000_000, &mut ready);
    let shares: Vec<u64> = s.worker_shares().iter().map(device).collect();
    assert_eq!(shares, vec![975_000_000, 25_000_000]);
    // Worker 1's tenants wake up within their baseline and fill its share: the next period
    // gives it its static half back.
    {
        let mut busy = lock(&s.workers[0].state);
        busy.used = CostVector::new(0, 0, 0, 9_000_000);
        busy.held_back = true;
        let mut woken = lock(&s.workers[1].state);
        woken.used = CostVector::new(0, 0, 0, 250_000);
        woken.used_baseline = woken.used;
        woken.held_back = true;
    }
    s.rebalance(s.clock.now_ns(), 10_000_000, &mut ready);
    let shares: Vec<u64> = s.worker_shares().iter().map(device).collect();
    assert_eq!(shares, vec![500_000_000, 500_000_000]);
    s.stop();
}

/// What a request's dispatch says, to compare two ways of submitting the same requests.
fn dispatch_record(r: &Ready<u32>) -> (u32, usize, u64, bool, Phase, CostVector) {
    let t = &r.ticket;
    (
        r.job,
        t.worker,
        t.request.id,
        t.sequential,
        t.phase,
        t.request.cost,
    )
}

fn two_workers(kind: PolicyKind) -> (Arc<Scheduler<u32>>, Arc<Collect>) {
    let config = QosConfig {
        policy: PolicyChoice::Policy(kind),
        workers: 2,
        dispatch: DispatchMode::OneToN,
        ..QosConfig::default()
    };
    let collect = Arc::new(Collect::default());
    let s = Scheduler::start(&config, Clock::new(), collect.clone(), None).expect("scheduler");
    (s, collect)
}

/// Offsets with runs of sequential requests among random ones, so the sequential flag and the
/// worker each request is sprayed to both matter.
fn batch_offsets() -> Vec<u64> {
    vec![
        0,
        4096,
        8192,
        1 << 30,
        5 << 20,
        (5 << 20) + 4096,
        7 << 30,
        12288,
        3 << 20,
        64 << 20,
    ]
}

#[test]
fn a_batch_dispatches_what_the_same_requests_submitted_one_by_one_dispatch() {
    for kind in PolicyKind::ALL {
        let (single, _) = two_workers(kind);
        let (batched, _) = two_workers(kind);
        // A class that never binds here, so that every policy runs the whole batch at once.
        let roomy = VolumeQos::fixed(headroom_qos::IoRate::UNLIMITED);
        let one = single.add_volume(3, &roomy);
        let all = batched.add_volume(3, &roomy);
        let mut by_one = Vec::new();
        let mut queue = Vec::new();
        for (job, offset) in (0u32..).zip(batch_offsets()) {
            single.submit(&one, read(offset), job, &mut by_one);
            batched.queue(&all, read(offset), job, &mut queue);
        }
        let mut together = Vec::new();
        batched.submit_batch(&all, &mut queue, &mut together);
        assert!(queue.is_empty(), "{kind}: the batch was not emptied");
        let records = |ready: &[Ready<u32>]| {
            let mut r: Vec<_> = ready.iter().map(dispatch_record).collect();
            r.sort_by_key(|d| d.0);
            r
        };
        assert_eq!(by_one.len(), batch_offsets().len(), "{kind}");
        assert_eq!(records(&by_one), records(&together), "{kind}");
        assert!(
            together.iter().any(|r| r.ticket.worker == 1)
                && together.iter().any(|r| r.ticket.sequential),
            "{kind}: the case covers both workers and sequential requests"
        );
        single.stop();
        batched.stop();
    }
}

#[test]
fn a_batch_the_policy_holds_back_in_part_is_dispatched_whole_and_once() {
    // 200 IOPS over two workers: a batch of ten runs in part at once, the rest as the wake-up
    // thread releases it.
    let (s, collect) = two_workers(PolicyKind::Burst);
    let volume = s.add_volume(
        5,
        &VolumeQos::fixed(headroom_qos::IoRate::new(200, u64::MAX)),
    );
    let mut queue = Vec::new();
    for (job, offset) in (0u32..).zip(batch_offsets()) {
        s.queue(&volume, read(offset), job, &mut queue);
    }
    let mut ready = Vec::new();
    s.submit_batch(&volume, &mut queue, &mut ready);
    assert!(
        ready.len() < batch_offsets().len(),
        "the QoS held nothing back"
    );
    let ran = dispatched(&s, &collect, &volume, ready);
    let jobs: Vec<u32> = ran.iter().map(|r| r.job).collect();
    assert_eq!(
        jobs,
        (0u32..).take(batch_offsets().len()).collect::<Vec<_>>()
    );
    s.stop();
}

#[test]
fn only_stealing_dispatch_submits_each_request_at_once_instead_of_in_batches() {
    for (dispatch, batches) in [
        (DispatchMode::OneToN, true),
        (DispatchMode::OneToOne, true),
        (DispatchMode::Stealing, false),
    ] {
        let config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            workers: 2,
            dispatch,
            ..QosConfig::default()
        };
        let s = Scheduler::<u32>::start(&config, Clock::new(), Arc::new(Collect::default()), None)
            .expect("scheduler");
        assert_eq!(s.batches(), batches, "{dispatch:?}");
        s.stop();
    }
}
