//! The node on a manual clock (`Clock::manual`, `Node::start_with_clock`): the policies see
//! time move only when the test moves it.
//!
//! Why: a rate limit tested against the wall clock is a timing assertion, and on a loaded
//! 2-core machine those flake. With the node's time frozen, what the scheduler holds back
//! stays held back for as long as the test looks, and how much it lets through per unit of
//! time is exact: every bound below is the ceiling's arithmetic, not a tolerance.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use headroom_node::clock::Clock;
use headroom_node::memory_transport::{MemoryOutcome, MemoryRequest};
use headroom_node::server::Node;
use headroom_qos::QosSpec;

const MS: u64 = 1_000_000;

#[tokio::test]
async fn with_time_frozen_a_ceiling_holds_requests_back_and_each_tick_releases_its_share() {
    let (clock, time) = Clock::manual(1_000 * MS);
    let node = Node::start_with_clock(common::config(), clock)
        .await
        .expect("the node starts");
    // 100 IOPS at most: one request per 10 ms of the node's time.
    let spec = QosSpec {
        baseline_iops: Some(100),
        ceiling_iops: Some(100),
        ..QosSpec::default()
    };
    node.create_volume("capped", 64 << 20, Some(spec)).unwrap();
    let scheduler = node.scheduler().expect("a policy is on").clone();
    let id = node.store().open_volume("capped").unwrap().id();
    let handle = scheduler.handle(id).unwrap();
    let peer = SocketAddr::from(([127, 0, 0, 1], 40_000));
    let mut client = node.attach_in_memory(peer, "capped", None).unwrap();
    const SENT: usize = 40;
    for i in 0..SENT as u64 {
        client
            .send(MemoryRequest::read(i * 4096, 4096))
            .await
            .unwrap();
    }
    // Time does not move: what was held back is still held back, however long we look.
    let held = scheduler.queued_requests(&handle);
    assert!(
        held >= SENT - 4,
        "at most a few requests pass without time ({held} of {SENT} held)"
    );
    let mut done = 0;
    for _ in 0..SENT - held {
        let completion = client.next_completion().await.unwrap();
        assert_eq!(completion.result, Ok(MemoryOutcome::Data(vec![0; 4096])));
        done += 1;
    }
    assert_eq!(
        scheduler.queued_requests(&handle),
        held,
        "completions alone release nothing while time stands still"
    );
    // Each 10 ms of the node's time lets about one more through, never more than the
    // ceiling's share of the time elapsed (and what each worker may save up, one request's
    // worth). `wake_due` runs what fell due on this thread, so the books are read after the
    // policies decided.
    let first = SENT - held;
    let mut ticks = 0u64;
    while scheduler.queued_requests(&handle) > 0 {
        time.advance(10 * MS);
        scheduler.wake_due();
        ticks += 1;
        let dispatched = (SENT - scheduler.queued_requests(&handle)) as u64;
        let allowed = first as u64 + ticks + 2;
        assert!(
            dispatched <= allowed,
            "after {ticks} ticks of 10 ms, {dispatched} dispatched: more than {allowed}"
        );
        assert!(ticks <= 1_000, "the ceiling never let the rest through");
    }
    while done < SENT {
        client.next_completion().await.unwrap().result.unwrap();
        done += 1;
    }
    assert!(
        ticks >= (SENT - first) as u64 - 2,
        "the held requests needed the node's time: {ticks} ticks for {}",
        SENT - first
    );
    client.detach().await;
    scheduler
        .check_invariants()
        .expect("the policy kept its invariants");
    node.shutdown().await.unwrap();
}
