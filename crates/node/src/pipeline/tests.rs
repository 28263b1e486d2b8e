//! Unit tests of the pipeline's stages: lanes, splitting, BLOCK_STATUS walks, routing, the
//! executor glue.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests panic on failure by design

use super::block_status::{BLOCK_STATUS_CHARGE_BYTES, status_descriptors};
use super::emulation::book_per_device;
use super::intake::volume_stats;
use super::job::{Admission, desc_of, execute, lane_of, run_job, runs_off_thread};
use super::reply::{Permits, ReplyBody, ReplyPath, Tally};
use super::split::{
    PieceFeeder, SPLIT_PIECES_IN_FLIGHT, SplitRequest, SplitState, cache_work, piece_bytes_of,
    pieces,
};
use super::*;
use crate::buffers::BufferPool;
use crate::clock::Clock;
use crate::emulated::EmulatedDevice;
use crate::emulated::EmulatedDeviceSpec;
use crate::exec::Lane;
use crate::scheduler::IoDesc;
use crate::sync::lock;
use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_qos::OpKind;
use headroom_qos::model::IoCostModel;
use headroom_qos::routing::ReadRouting;
use headroom_store::EXTENT_SIZE_BYTES as E;
use headroom_store::{Store, Volume};
use std::time::Duration;
use tokio::sync::mpsc;

fn devices(n: usize) -> Vec<Arc<EmulatedDevice>> {
    let spec = EmulatedDeviceSpec {
        model: IoCostModel {
            rbps: 100_000_000,
            rseqiops: 20_000,
            rrandiops: 10_000,
            wbps: 100_000_000,
            wseqiops: 20_000,
            wrandiops: 10_000,
        },
        parallelism: 2,
        write_interference_permille: 0,
        per_device: true,
        streams: 0,
    };
    (0..n)
        .map(|_| EmulatedDevice::start(spec, Clock::new()).unwrap())
        .collect()
}

fn request(command: nbd::Command, offset: u64, length: u32) -> nbd::ValidRequest {
    nbd::ValidRequest {
        command,
        fua: false,
        no_hole: false,
        fast_zero: false,
        df: false,
        req_one: false,
        cookie: 1,
        offset,
        length,
    }
}

fn booked(devices: &[Arc<EmulatedDevice>]) -> Vec<u64> {
    devices.iter().map(|d| d.stats().booked).collect()
}

#[test]
fn per_device_emulation_books_the_devices_a_request_touches() {
    // A RAM store has two devices; a volume's first two extents stripe over them.
    let store = Store::open_memory(64 << 20).unwrap();
    store.create_volume("v", 16 << 20).unwrap();
    let volume = store.open_volume("v").unwrap();
    volume.write_at(0, &[1u8; 4096], false).unwrap();
    volume.write_at(E, &[2u8; 4096], false).unwrap();
    let on = |extent: u64| volume.extent_location(extent).unwrap().device;
    assert_eq!((on(0), on(1)), (0, 1));
    let devices = devices(2);
    let book = |req: nbd::ValidRequest| {
        let job_desc = IoDesc {
            op: match req.command {
                nbd::Command::Flush => OpKind::Flush,
                nbd::Command::Write => OpKind::Write,
                _ => OpKind::Read,
            },
            offset_bytes: req.offset,
            len_bytes: if matches!(req.command, nbd::Command::Flush) {
                0
            } else {
                req.length
            },
            syncs: 0,
        };
        book_per_device(&devices, &volume, &req, job_desc, false, None, 1_000)
            .map(|(device, at)| (Arc::as_ptr(device), at))
    };
    // Within extent 0: device 0 only.
    let (device, at) = book(request(nbd::Command::Read, 0, 4096)).unwrap();
    assert_eq!(booked(&devices), vec![1, 0]);
    assert_eq!(device, Arc::as_ptr(&devices[0]));
    assert!(at > 1_000);
    // Across the boundary of extents 0 and 1: one piece on each device.
    assert!(book(request(nbd::Command::Read, E - 4096, 8192)).is_some());
    assert_eq!(booked(&devices), vec![2, 1]);
    // A read of a hole (extent 5 was never written): no device works, no booking.
    assert!(book(request(nbd::Command::Read, 5 * E, 4096)).is_none());
    assert_eq!(booked(&devices), vec![2, 1]);
    // FLUSH reaches every device; it completes with the later of the two.
    let (_, flush_at) = book(request(nbd::Command::Flush, 0, 0)).unwrap();
    assert_eq!(booked(&devices), vec![3, 2]);
    assert!(flush_at > 1_000);
}

/// A 2-replica volume on a RAM store of two devices, its first extent written.
fn mirrored() -> (Store, Arc<Volume>) {
    let store = Store::open_memory(64 << 20).unwrap();
    store
        .create_volume_with(
            "m",
            16 << 20,
            headroom_store::NewVolume {
                replicas: 2,
                ..headroom_store::NewVolume::default()
            },
        )
        .unwrap();
    let volume = store.open_volume("m").unwrap();
    volume.write_at(0, &[7u8; 4096], false).unwrap();
    (store, volume)
}

#[test]
fn type_aware_routing_splits_random_and_sequential_reads_and_an_idle_copy_steals() {
    let (_store, volume) = mirrored();
    let copies = volume.copies(0);
    let device_of = |copy: u8| copies[usize::from(copy)].unwrap().0.device;
    // The copy on the lower-numbered device is the router's head replica.
    let (head, middle) = if device_of(0) < device_of(1) {
        (0, 1)
    } else {
        (1, 0)
    };
    let router = ReadRouter::new(ReadRouting::TypeAware);
    // Idle: random reads to the head, sequential reads to the middle.
    let random = router.route(&volume, 0, false).unwrap();
    assert_eq!((random.copy, random.device), (head, device_of(head)));
    router.done(random.device);
    let scan = router.route(&volume, 0, true).unwrap();
    assert_eq!((scan.copy, scan.device), (middle, device_of(middle)));
    // The middle busy with that scan, the head idle: the next sequential read is stolen.
    assert_eq!(router.route(&volume, 4096, true).unwrap().copy, head);
    // Both busy: each default keeps its own.
    assert_eq!(router.route(&volume, 8192, true).unwrap().copy, middle);
    assert_eq!(router.route(&volume, 0, false).unwrap().copy, head);
    // A hole and a 1-replica volume are not routed.
    assert!(router.route(&volume, 5 * E, false).is_none());
    let store = Store::open_memory(64 << 20).unwrap();
    store.create_volume("single", 16 << 20).unwrap();
    let single = store.open_volume("single").unwrap();
    single.write_at(0, &[1u8; 4096], false).unwrap();
    assert!(router.route(&single, 0, false).is_none());
    // Primary and round robin, for comparison.
    let primary = ReadRouter::new(ReadRouting::Primary);
    assert!((0..4).all(|_| primary.route(&volume, 0, true).unwrap().copy == head));
    let rr = ReadRouter::new(ReadRouting::RoundRobin);
    let turns: Vec<u8> = (0..4)
        .map(|_| rr.route(&volume, 0, false).unwrap().copy)
        .collect();
    assert_eq!(turns, vec![head, middle, head, middle]);
}

#[test]
fn per_device_emulation_books_the_routed_copy_for_reads_and_every_copy_for_writes() {
    let (_store, volume) = mirrored();
    let copies = volume.copies(0);
    let (d0, d1) = (
        copies[0].unwrap().0.device as usize,
        copies[1].unwrap().0.device as usize,
    );
    assert_ne!(d0, d1);
    let devices = devices(2);
    let desc = |op, len| IoDesc {
        op,
        offset_bytes: 0,
        len_bytes: len,
        syncs: 0,
    };
    let mut expect = vec![0u64; 2];
    book_per_device(
        &devices,
        &volume,
        &request(nbd::Command::Read, 0, 4096),
        desc(OpKind::Read, 4096),
        false,
        Some(1),
        1_000,
    )
    .unwrap();
    expect[d1] += 1;
    assert_eq!(booked(&devices), expect);
    book_per_device(
        &devices,
        &volume,
        &request(nbd::Command::Write, 0, 4096),
        desc(OpKind::Write, 4096),
        false,
        None,
        1_000,
    )
    .unwrap();
    expect[d0] += 1;
    expect[d1] += 1;
    assert_eq!(booked(&devices), expect);
}

#[test]
fn a_grant_waits_for_the_policy_and_its_completion_is_charged_to_its_volume() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let io = Arc::new(IoRuntime {
        lanes: None,
        inline_max_bytes: 0,
        buffers: Arc::new(BufferPool::new(1 << 20)),
        emulation: Emulation::Off,
        clock: Clock::new(),
        runtime: runtime.handle().clone(),
        reads: ReadRouter::new(ReadRouting::Primary),
        work: Default::default(),
    });
    let runner = Arc::new(IoRunner(Arc::clone(&io)));
    let scheduler = Scheduler::start(
        &crate::scheduler::config::QosConfig::default(),
        io.clock,
        runner,
        None,
    )
    .unwrap();
    let qos = crate::repair::rebuild_qos(64 << 20);
    let handle = scheduler.add_volume(crate::repair::REBUILD_SCHEDULER_KEY, &qos);
    let desc = IoDesc {
        op: OpKind::Write,
        offset_bytes: 0,
        len_bytes: E as u32,
        syncs: 0,
    };
    // Dispatched (within its rate), handed to the submitter, completed by it.
    let pending = Grant::submit(&io, &scheduler, &handle, desc);
    let ticket = pending.wait(Duration::from_secs(10)).expect("dispatched");
    assert_eq!(handle.counters.snapshot().ios.iter().sum::<u64>(), 0);
    Grant::complete(&io, &scheduler, ticket);
    let stats = handle.counters.snapshot();
    assert_eq!(stats.ios.iter().sum::<u64>(), 1);
    assert_eq!(stats.bytes.iter().sum::<u64>(), E);
    drop(pending);
    // A grant given up before it is taken is still completed (its dispatch does it).
    let pending = Grant::submit(&io, &scheduler, &handle, desc);
    drop(pending);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while handle.counters.snapshot().ios.iter().sum::<u64>() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the abandoned grant never completed"
        );
        std::thread::yield_now();
    }
    assert_eq!(handle.counters.snapshot().bytes.iter().sum::<u64>(), 2 * E);
    scheduler.stop();
}

fn io_without_executor(runtime: &tokio::runtime::Runtime) -> IoRuntime {
    IoRuntime {
        lanes: None,
        inline_max_bytes: 64 << 10,
        buffers: Arc::new(BufferPool::new(1 << 20)),
        emulation: Emulation::Off,
        clock: Clock::new(),
        runtime: runtime.handle().clone(),
        reads: ReadRouter::new(ReadRouting::Primary),
        work: Default::default(),
    }
}

#[test]
fn every_command_is_charged_the_device_work_it_does_and_what_may_block_leaves_the_thread() {
    use nbd::Command::{BlockStatus, Cache, Flush, Read, Trim, Write, WriteZeroes};
    let model = headroom_qos::model::CostModel::new(
        headroom_qos::model::CpuModel::default(),
        headroom_qos::model::DeviceModel::Linear(IoCostModel::SSD_FAST),
    );
    let store = Store::open_memory(1 << 30).unwrap();
    store.create_volume("v", 1 << 30).unwrap();
    let volume = store.open_volume("v").unwrap();
    assert!(volume.is_zero_fast(), "RAM zeroes in place");
    let device_units = |request: &nbd::ValidRequest| {
        let desc = desc_of(&volume, request);
        model.estimate(desc.op, desc.len_bytes, false).device_units
    };
    let len = 32 << 20;
    let read = device_units(&request(Read, 0, len));
    let write = device_units(&request(Write, 0, len));
    assert!(read > 0 && write > 0);
    // CACHE reads its length into the page cache: charged as that read.
    assert_eq!(device_units(&request(Cache, 0, len)), read);
    // WRITE_ZEROES that may not punch zeroes its range in place: its metadata, far less
    // than a write of its length (were the device to write zeros, it would be that
    // write); one that may punch is a discard.
    let zeroes = |no_hole, fast_zero| nbd::ValidRequest {
        no_hole,
        fast_zero,
        ..request(WriteZeroes, 0, len)
    };
    let zeroing = desc_of(&volume, &zeroes(true, false));
    assert_eq!((zeroing.op, zeroing.len_bytes), (OpKind::WriteZeroes, len));
    let zeroing = device_units(&zeroes(true, false));
    assert!(zeroing > 0 && zeroing * 100 < write, "{zeroing} {write}");
    assert_eq!(device_units(&zeroes(false, false)), 0);
    assert_eq!(desc_of(&volume, &zeroes(false, false)).op, OpKind::Trim);
    // Refused at once.
    assert_eq!(device_units(&zeroes(true, true)), 0);
    // BLOCK_STATUS: one small read's worth, whatever its length.
    let small_read = device_units(&request(Read, 0, 0));
    assert!(small_read > 0);
    assert_eq!(device_units(&request(BlockStatus, 0, u32::MAX)), small_read);
    assert_eq!(device_units(&request(BlockStatus, 0, 4096)), small_read);
    // A FUA request pays for its sync; a FLUSH for one sync per device holding writes
    // not yet durable, at least one.
    let fua = |command| nbd::ValidRequest {
        fua: true,
        ..request(command, 0, 4096)
    };
    assert_eq!(desc_of(&volume, &request(Write, 0, 4096)).syncs, 0);
    assert_eq!(desc_of(&volume, &fua(Write)).syncs, 1);
    assert_eq!(desc_of(&volume, &fua(Trim)).syncs, 1);
    assert_eq!(desc_of(&volume, &request(Flush, 0, 0)).syncs, 1);
    volume.write_at(0, &[1u8; 4096], false).unwrap();
    assert_eq!(volume.unsynced_devices(), 1);
    assert_eq!(desc_of(&volume, &request(Flush, 0, 0)).syncs, 1);
    volume.flush().unwrap();
    assert_eq!(volume.unsynced_devices(), 0);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let io = io_without_executor(&runtime);
    for command in [Flush, Trim, WriteZeroes, Cache, BlockStatus] {
        assert!(
            runs_off_thread(&request(command, 0, 4096), &io),
            "{} would run on the connection's thread",
            command.name()
        );
    }
    let fua_write = nbd::ValidRequest {
        fua: true,
        ..request(Write, 0, 4096)
    };
    assert!(runs_off_thread(&fua_write, &io), "a FUA write syncs");
    // Small READs and WRITEs stay inline (no executor here: nothing else does).
    assert!(!runs_off_thread(&request(Read, 0, 4096), &io));
    assert!(!runs_off_thread(&request(Write, 0, 1 << 20), &io));
}

#[test]
fn a_cache_is_cut_into_pieces_only_where_there_is_data() {
    let store = Store::open_memory(1 << 30).unwrap();
    store.create_volume("v", 256 << 20).unwrap();
    let volume = store.open_volume("v").unwrap();
    let extent = headroom_store::EXTENT_SIZE_BYTES;
    let cache = request(nbd::Command::Cache, 0, 32 << 20);
    let piece_bytes = piece_bytes_of(&cache, 32 << 20);
    assert_eq!(pieces(&cache, piece_bytes).len(), 16);
    // Thin: only the first piece, which answers the request.
    let kept = cache_work(&volume, pieces(&cache, piece_bytes));
    assert_eq!(kept.iter().map(|p| p.offset).collect::<Vec<_>>(), vec![0]);
    // One written extent (the 11th) adds its piece, and only it.
    volume
        .write_at(10 * extent + 5, &[1u8; 4096], false)
        .unwrap();
    let kept = cache_work(&volume, pieces(&cache, piece_bytes));
    assert_eq!(
        kept.iter().map(|p| p.offset).collect::<Vec<_>>(),
        vec![0, 10 * extent]
    );
    assert!(volume.holds_data_in(10 * extent, 1));
    assert!(!volume.holds_data_in(11 * extent, extent));
    assert!(!volume.holds_data_in(1 << 40, 4096), "past the end");
}

#[test]
fn bulk_work_and_syncs_leave_the_lane_of_reads_and_writes() {
    use nbd::Command::{BlockStatus, Cache, Flush, Read, Trim, Write, WriteZeroes};
    let fua = |command| nbd::ValidRequest {
        fua: true,
        ..request(command, 0, 4096)
    };
    for command in [Cache, WriteZeroes, Trim, BlockStatus] {
        assert_eq!(lane_of(&request(command, 0, 1 << 20)), Lane::Bulk);
        // A FUA bulk request is bulk work first: its length is what it costs.
        assert_eq!(lane_of(&fua(command)), Lane::Bulk);
    }
    assert_eq!(lane_of(&request(Flush, 0, 0)), Lane::Sync);
    assert_eq!(lane_of(&fua(Write)), Lane::Sync);
    assert_eq!(lane_of(&fua(Read)), Lane::Sync);
    assert_eq!(lane_of(&request(Read, 0, 1 << 20)), Lane::Data);
    assert_eq!(lane_of(&request(Write, 0, 1 << 20)), Lane::Data);
}

#[test]
fn a_split_request_holds_at_most_two_pieces_in_the_node_and_answers_once() {
    use headroom_store::{FaultConfig, FaultRule, FaultScope};
    // Every write-class operation of the volume takes 2 s longer, so the pieces cannot
    // finish (and feed the next ones) before the check below.
    let store = Store::open_memory(1 << 30).unwrap();
    store.create_volume("v", 1 << 30).unwrap();
    store
        .inject_faults(&FaultConfig {
            seed: 1,
            rules: vec![FaultRule {
                latency_spike_permille: 1000,
                latency_spike_ms: 2_000,
                ..FaultRule::new(FaultScope::Volume("v".into()))
            }],
        })
        .unwrap();
    let volume = Arc::new(store.open_volume("v").unwrap());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let io = Arc::new(io_without_executor(&runtime));
    let metrics = MetricsRegistry::new(crate::metrics::MetricsConfig::default(), io.clock);
    let (tx, mut replies) = mpsc::unbounded_channel();
    let path = Arc::new(ReplyPath {
        tx,
        stats: volume_stats(&metrics, &volume),
        metrics: Arc::clone(&metrics),
    });
    let slots = crate::slots::Slots::new(1);
    let permits = Permits {
        _request: slots.take_now(1).unwrap(),
        _bytes: None,
    };
    // A NO_HOLE zeroing of four extents: four pieces of one extent each.
    let zeroing = nbd::ValidRequest {
        no_hole: true,
        ..request(nbd::Command::WriteZeroes, 0, 4 * E as u32)
    };
    let piece_bytes = piece_bytes_of(&zeroing, 32 << 20);
    assert_eq!(piece_bytes, E as u32);
    let pieces = pieces(&zeroing, piece_bytes);
    assert_eq!(pieces.len(), 4);
    let split = SplitRequest::new(
        &zeroing,
        pieces,
        permits,
        path,
        Tally::of(&zeroing, 0).unwrap(),
        PieceFeeder {
            volume: Arc::clone(&volume),
            io: Arc::clone(&io),
            scheduled: None,
        },
    );
    for _ in 0..SPLIT_PIECES_IN_FLIGHT {
        let job = split.next_piece().unwrap();
        assert!(run_job(&io, None, job, Admission::Unscheduled(true)).is_none());
    }
    let unsubmitted = |split: &SplitRequest| lock_state(split).unsubmitted.len();
    assert_eq!(
        unsubmitted(&split),
        2,
        "the other pieces wait until one of the first two completes"
    );
    // Each completion feeds the next; the last sends the one reply.
    let reply = runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), replies.recv()).await });
    let reply = reply.expect("answered").expect("a reply");
    assert!(matches!(reply.body, ReplyBody::Done));
    assert_eq!(unsubmitted(&split), 0);
    assert!(replies.try_recv().is_err(), "one reply for the request");
    drop(reply);
    assert_eq!(slots.available(), 1, "the permits went with the reply");
    // TRIM stays cut at the maximum block size (metadata per extent).
    assert_eq!(
        piece_bytes_of(&request(nbd::Command::Trim, 0, u32::MAX), 32 << 20),
        32 << 20
    );
}

fn lock_state(split: &SplitRequest) -> std::sync::MutexGuard<'_, SplitState> {
    lock(&split.state)
}

#[test]
fn block_status_is_bounded_and_req_one_answers_one_extent() {
    let store = Store::open_memory(1 << 30).unwrap();
    store.create_volume("v", 1 << 30).unwrap();
    let volume = store.open_volume("v").unwrap();
    // Data in every other extent of the first 300 MiB: runs of 2 MiB, data then hole.
    for extent in (0..150u64).step_by(2) {
        volume.write_at(extent * E, &[1u8; 4096], false).unwrap();
    }
    let status = |offset: u64, length: u32, req_one: bool| {
        let request = nbd::ValidRequest {
            req_one,
            ..request(nbd::Command::BlockStatus, offset, length)
        };
        let body = execute(&BufferPool::new(1 << 20), &volume, &request, None, false, 0);
        match body {
            ReplyBody::BlockStatus { extents } => extents,
            _ => panic!("not a BLOCK_STATUS answer"),
        }
    };
    let described = |extents: &[(u32, u32)]| extents.iter().map(|e| u64::from(e.0)).sum::<u64>();
    let hole = consts::NBD_STATE_HOLE | consts::NBD_STATE_ZERO;
    // The whole volume asked for: at most 64 extents walked, a shorter answer.
    let all = status(0, (1 << 30) - 4096, false);
    assert_eq!(described(&all), BLOCK_STATUS_MAX_WALK_BYTES);
    assert_eq!(all.len(), 64);
    assert!(all.iter().step_by(2).all(|e| e == &(E as u32, 0)));
    assert!(
        all.iter()
            .skip(1)
            .step_by(2)
            .all(|e| e == &(E as u32, hole))
    );
    // REQ_ONE: the first run only, with its real length.
    assert_eq!(status(0, (1 << 30) - 4096, true), vec![(E as u32, 0)]);
    assert_eq!(
        status(E + 4096, 1 << 29, true),
        vec![(E as u32 - 4096, hole)]
    );
    // A long hole: one run, as far as the walk goes.
    let long = status(300 << 20, 700 << 20, true);
    assert_eq!(long, vec![(BLOCK_STATUS_MAX_WALK_BYTES as u32, hole)]);
    // The number of descriptors is bounded too: a prefix of the runs.
    let runs: Vec<headroom_store::Extent> = (0..5000)
        .map(|i| headroom_store::Extent {
            length: 4096,
            hole: i % 2 == 1,
            zero: i % 2 == 1,
        })
        .collect();
    let descriptors = status_descriptors(&runs, false);
    assert_eq!(descriptors.len(), BLOCK_STATUS_MAX_DESCRIPTORS);
    assert!(descriptors.iter().all(|d| d.0 == 4096));
    assert_eq!(status_descriptors(&runs, true).len(), 1);
    assert!(BLOCK_STATUS_CHARGE_BYTES as usize >= BLOCK_STATUS_MAX_DESCRIPTORS * 8);
}

#[test]
fn emulation_parallelism_sums_the_devices() {
    assert_eq!(Emulation::Off.parallelism(), None);
    let two = devices(2);
    assert_eq!(Emulation::Node(Arc::clone(&two[0])).parallelism(), Some(2));
    assert_eq!(Emulation::PerDevice(two).parallelism(), Some(4));
}
