//! The node driven through its second transport: in-memory clients (`node::memory_transport`)
//! attached to the same pipeline NBD sessions use, in this test's own process.
//!
//! Why: these tests are about the request path below the wire — permits and budgets,
//! splitting, the scheduler, execution, completion, the statistics — and they prove that a
//! transport plugs into the pipeline without touching it. No socket and no framing: each
//! test is exact about what the pipeline answered (data, errno, cookie, the budget's books)
//! and none waits on a clock. The NBD wire is tested beside them (`in_process*.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use headroom_nbd::Errno;
use headroom_node::memory_transport::{
    AttachError, MemoryOutcome, MemoryRequest, MemorySession, RequestFailed,
};
use headroom_node::metrics::VolumeOp;
use headroom_node::server::RunningNode;
use headroom_store::NewVolume;

const MIB: u64 = 1 << 20;

fn peer(n: u8) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, n], 40_000))
}

async fn attach(node: &RunningNode, name: &str) -> MemorySession {
    node.attach_in_memory(peer(1), name, None)
        .expect("the client attaches")
}

fn data(outcome: Result<MemoryOutcome, RequestFailed>) -> Vec<u8> {
    match outcome.expect("the request succeeds") {
        MemoryOutcome::Data(bytes) => bytes,
        other => panic!("expected data, got {other:?}"),
    }
}

fn errno(outcome: Result<MemoryOutcome, RequestFailed>) -> Errno {
    outcome.expect_err("the request fails").errno
}

/// Checks the scheduler's invariants (tracked in a debug build: the tests') after a test's
/// traffic, then shuts the node down.
async fn finish(node: RunningNode) {
    if let Some(scheduler) = node.scheduler() {
        scheduler
            .check_invariants()
            .expect("the policies kept their invariants");
    }
    node.shutdown().await.unwrap();
}

/// Whether a future is still waiting after one poll (it is then dropped: cancelled).
fn still_waits<F: std::future::Future>(future: F) -> bool {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    matches!(future.as_mut().poll(&mut cx), Poll::Pending)
}

#[tokio::test]
async fn a_write_is_read_back_through_the_pipeline_and_lands_in_the_store() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    let mut client = attach(&node, "v").await;
    let written: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let done = client
        .call(MemoryRequest::write(4096, written.clone()))
        .await
        .unwrap();
    assert_eq!(done, Ok(MemoryOutcome::Done));
    assert_eq!(
        data(client.call(MemoryRequest::read(4096, 8192)).await.unwrap()),
        written
    );
    let mut stored = vec![0u8; 8192];
    node.store()
        .open_volume("v")
        .unwrap()
        .read_at(4096, &mut stored)
        .unwrap();
    assert_eq!(stored, written, "the store holds what the client wrote");
    client.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn a_never_written_range_reads_as_zeros() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    let mut client = attach(&node, "v").await;
    let read = data(
        client
            .call(MemoryRequest::read(8 * MIB, 65536))
            .await
            .unwrap(),
    );
    assert_eq!(read, vec![0u8; 65536]);
    client.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn the_checker_refuses_what_nbd_refuses_with_the_same_errno() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    node.store()
        .create_volume_with(
            "ro",
            16 * MIB,
            NewVolume {
                read_only: true,
                ..NewVolume::default()
            },
        )
        .unwrap();
    let mut client = attach(&node, "v").await;
    // Past the end: EINVAL (the NBD spec's answer for a range outside the export).
    let past_end = client.call(MemoryRequest::read(64 * MIB - 4096, 8192));
    assert_eq!(errno(past_end.await.unwrap()), Errno::Einval);
    // Larger than the maximum payload: refused before any byte is charged.
    let huge = client.call(MemoryRequest::read(0, 64 << 20));
    assert_eq!(errno(huge.await.unwrap()), Errno::Einval);
    client.detach().await;
    let mut read_only = attach(&node, "ro").await;
    let write = read_only.call(MemoryRequest::write(0, vec![1; 4096]));
    assert_eq!(errno(write.await.unwrap()), Errno::Eperm);
    let trim = read_only.call(MemoryRequest::trim(0, 4096));
    assert_eq!(errno(trim.await.unwrap()), Errno::Eperm);
    // Reads still work.
    let read = read_only.call(MemoryRequest::read(0, 4096));
    assert_eq!(data(read.await.unwrap()), vec![0u8; 4096]);
    read_only.detach().await;
    // Refusals are counted as failed requests of their kind.
    let id = node.store().open_volume("v").unwrap().id();
    let stats = node.api_state().metrics.get(id).unwrap().ops();
    assert_eq!(stats[0].ops, 2, "two reads answered");
    assert_eq!(stats[0].errors, 2, "both refused");
    finish(node).await;
}

#[tokio::test]
async fn a_client_sees_only_volumes_of_its_tenant() {
    let node = common::start_with_volume("open", 16 * MIB).await;
    node.store().create_tenant("alice").unwrap();
    node.store()
        .create_volume_with(
            "alices",
            16 * MIB,
            NewVolume {
                tenant: Some("alice".into()),
                ..NewVolume::default()
            },
        )
        .unwrap();
    let unknown =
        |r: Result<MemorySession, AttachError>| matches!(r, Err(AttachError::UnknownExport(_)));
    assert!(unknown(node.attach_in_memory(peer(1), "alices", None)));
    assert!(unknown(node.attach_in_memory(
        peer(1),
        "open",
        Some("alice")
    )));
    assert!(unknown(node.attach_in_memory(peer(1), "nothing", None)));
    let mut alice = node
        .attach_in_memory(peer(1), "alices", Some("alice"))
        .expect("alice sees her volume");
    let done = alice.call(MemoryRequest::flush()).await.unwrap();
    assert_eq!(done, Ok(MemoryOutcome::Done));
    alice.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn pipelined_requests_are_all_answered_once_with_their_own_cookies() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    let mut client = attach(&node, "v").await;
    let mut sent = std::collections::BTreeMap::new();
    for i in 0..64u64 {
        let cookie = client
            .send(MemoryRequest::write(i * 4096, vec![i as u8; 4096]))
            .await
            .unwrap();
        assert!(sent.insert(cookie, i).is_none(), "cookies are unique");
    }
    let mut answered = std::collections::BTreeSet::new();
    for _ in 0..64 {
        let completion = client.next_completion().await.expect("a reply");
        assert_eq!(completion.result, Ok(MemoryOutcome::Done));
        assert!(
            sent.contains_key(&completion.cookie),
            "a reply to a request sent"
        );
        assert!(answered.insert(completion.cookie), "answered once");
    }
    for i in [0u64, 31, 63] {
        let read = client
            .call(MemoryRequest::read(i * 4096, 4096))
            .await
            .unwrap();
        assert_eq!(data(read), vec![i as u8; 4096]);
    }
    client.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn trim_and_write_zeroes_read_back_as_zeros_and_block_status_sees_the_holes() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    let mut client = attach(&node, "v").await;
    let extent = headroom_store::EXTENT_SIZE_BYTES;
    for at in [0, extent, 2 * extent] {
        let write = client.call(MemoryRequest::write(at, vec![9; 65536]));
        assert_eq!(write.await.unwrap(), Ok(MemoryOutcome::Done));
    }
    // Extent 1 trimmed whole: a hole again.
    let trim = client.call(MemoryRequest::trim(extent, extent as u32));
    assert_eq!(trim.await.unwrap(), Ok(MemoryOutcome::Done));
    // Zeroes kept provisioned in extent 2.
    let zeroes = client.call(MemoryRequest::write_zeroes(2 * extent, 65536, true));
    assert_eq!(zeroes.await.unwrap(), Ok(MemoryOutcome::Done));
    for at in [extent, 2 * extent] {
        let read = client.call(MemoryRequest::read(at, 65536)).await.unwrap();
        assert_eq!(data(read), vec![0u8; 65536], "zeros at {at}");
    }
    let status = client
        .call(MemoryRequest::block_status(0, (2 * extent) as u32, false))
        .await
        .unwrap()
        .unwrap();
    let MemoryOutcome::BlockStatus(runs) = status else {
        panic!("expected allocation runs, got {status:?}");
    };
    let hole_flag = headroom_nbd::consts::NBD_STATE_HOLE;
    let total: u64 = runs.iter().map(|(len, _)| u64::from(*len)).sum();
    assert!(
        total > 0 && total <= 2 * extent,
        "runs cover part of the range: {runs:?}"
    );
    assert_eq!(runs[0].1 & hole_flag, 0, "data first: {runs:?}");
    assert!(
        runs.iter().any(|(_, flags)| flags & hole_flag != 0),
        "the trimmed extent is a hole: {runs:?}"
    );
    // With REQ_ONE: one run.
    let one = client
        .call(MemoryRequest::block_status(0, (2 * extent) as u32, true))
        .await
        .unwrap()
        .unwrap();
    let MemoryOutcome::BlockStatus(one) = one else {
        panic!("expected one run");
    };
    assert_eq!(one.len(), 1, "REQ_ONE answers one extent: {one:?}");
    client.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn a_trim_larger_than_one_backend_operation_is_split_and_answered_once() {
    let node = common::start_with_volume("v", 256 * MIB).await;
    let mut client = attach(&node, "v").await;
    for at in [0, 100 * MIB, 199 * MIB] {
        let write = client.call(MemoryRequest::write(at, vec![5; 4096]));
        assert_eq!(write.await.unwrap(), Ok(MemoryOutcome::Done));
    }
    // 200 MiB: seven pieces of the 32 MiB maximum, one reply.
    let cookie = client
        .send(MemoryRequest::trim(0, 200 << 20))
        .await
        .unwrap();
    let completion = client.next_completion().await.unwrap();
    assert_eq!(
        (completion.cookie, completion.result),
        (cookie, Ok(MemoryOutcome::Done))
    );
    for at in [0, 100 * MIB, 199 * MIB] {
        let read = client.call(MemoryRequest::read(at, 4096)).await.unwrap();
        assert_eq!(data(read), vec![0u8; 4096], "trimmed at {at}");
    }
    let id = node.store().open_volume("v").unwrap().id();
    let trims = node.api_state().metrics.get(id).unwrap().ops()[3];
    assert_eq!(trims.ops, 1, "counted as the one request the client sent");
    client.detach().await;
    finish(node).await;
}

#[tokio::test]
async fn a_client_that_takes_no_reply_fills_its_own_budget_and_another_is_still_served() {
    let mut config = common::config();
    // Requests of at most 1 MiB; each client may hold 4 MiB; the tenant 8 MiB; every
    // connection keeps a reserve of its own.
    config.limits.max_request_bytes = MIB as u32;
    config.limits.max_inflight_bytes_per_conn = 4 * MIB;
    config.limits.max_inflight_bytes_per_tenant = 8 * MIB;
    let node = common::start(config).await;
    node.create_volume("v", 64 * MIB, None).unwrap();
    let mut greedy = attach(&node, "v").await;
    // Four 1 MiB reads fill its own budget; their replies wait, holding it.
    for i in 0..4 {
        greedy
            .send(MemoryRequest::read(i * MIB, MIB as u32))
            .await
            .unwrap();
    }
    assert!(
        still_waits(greedy.send(MemoryRequest::read(0, MIB as u32))),
        "a fifth waits for the client's own replies"
    );
    let held = node.api_state().budget.view().inflight_bytes;
    assert!(held >= 4 * MIB, "the four replies hold their bytes: {held}");
    // Another client of the same tenant, from the same address, is served.
    let mut fresh = attach(&node, "v").await;
    let read = fresh.call(MemoryRequest::read(0, 4096)).await.unwrap();
    assert_eq!(data(read), vec![0u8; 4096]);
    fresh.detach().await;
    // Taking one reply gives its bytes back: the next request goes in at once.
    greedy.next_completion().await.unwrap();
    assert!(!still_waits(greedy.send(MemoryRequest::read(0, 4096))));
    greedy.detach().await;
    assert_eq!(
        node.api_state().budget.view().inflight_bytes,
        0,
        "every byte is given back once the clients are gone"
    );
    finish(node).await;
}

#[tokio::test]
async fn in_memory_clients_are_admitted_and_counted_like_connections() {
    let mut config = common::config();
    config.limits.max_connections_per_ip = 2;
    let node = common::start(config).await;
    node.create_volume("v", 16 * MIB, None).unwrap();
    let a = attach(&node, "v").await;
    let b = attach(&node, "v").await;
    // Both transmit, so a third from the same address is refused rather than evicting one.
    let third = node.attach_in_memory(peer(1), "v", None);
    assert!(
        matches!(third, Err(AttachError::Refused(_))),
        "the per-address cap holds: {third:?}"
    );
    // Another address is admitted.
    let c = node.attach_in_memory(peer(2), "v", None).expect("admitted");
    let view = node.api_state().connections.view();
    assert_eq!(view.connections.len(), 3, "{view:?}");
    a.detach().await;
    let again = node.attach_in_memory(peer(1), "v", None);
    assert!(again.is_ok(), "a detached client gives its place back");
    for client in [b, c, again.unwrap()] {
        client.detach().await;
    }
    finish(node).await;
}

#[tokio::test]
async fn with_the_scheduler_on_every_request_is_dispatched_and_completed_on_its_books() {
    let node = common::start_with_volume("v", 64 * MIB).await;
    let scheduler = node.scheduler().expect("a policy is on by default").clone();
    let mut client = attach(&node, "v").await;
    for i in 0..16u64 {
        client
            .send(MemoryRequest::write(i * 4096, vec![1; 4096]))
            .await
            .unwrap();
    }
    for _ in 0..16 {
        assert_eq!(
            client.next_completion().await.unwrap().result,
            Ok(MemoryOutcome::Done)
        );
    }
    client.call(MemoryRequest::flush()).await.unwrap().unwrap();
    let id = node.store().open_volume("v").unwrap().id();
    let ops = node.api_state().metrics.get(id).unwrap().ops();
    assert_eq!(ops[1].ops, 16, "sixteen writes");
    assert_eq!(ops[1].bytes, 16 * 4096);
    assert_eq!(ops[2].ops, 1, "one flush");
    assert_eq!(VolumeOp::ALL[1], VolumeOp::Write);
    let handle = scheduler
        .handle(id)
        .expect("the volume is known to the scheduler");
    let phases = handle.counters.snapshot();
    assert_eq!(
        phases.ios.iter().sum::<u64>(),
        17,
        "the scheduler completed every request it dispatched: {phases:?}"
    );
    assert_eq!(scheduler.queued_requests(&handle), 0);
    client.detach().await;
    finish(node).await;
}
