//! Connection caps and the payload byte budget on a node started in this process
//! (`tests/common`) with small limits: who is evicted or refused at each cap (read from the
//! node's own connection table), that a client pipelining large reads it never reads does not
//! stop another connection of its tenant (the per-connection reserve), and that everything a
//! session held is given back when it ends, however it ends. Other client addresses are other
//! loopback addresses (127.0.0.2, ...), so the per-address cap is tested without a network.

#![allow(clippy::unwrap_used)] // helpers too: a failed decode is a failed test

mod common;

use std::net::Ipv4Addr;

use common::{GUARD, Haggle, Req};
use headroom_nbd::consts::{NBD_CMD_READ, NBD_CMD_WRITE};
use headroom_node::server::RunningNode;

const HOME: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

fn view(node: &RunningNode) -> headroom_node::admission::ConnectionsView {
    node.api_state().connections.view()
}

async fn start_capped(max_connections: usize, per_ip: usize) -> RunningNode {
    let mut config = common::config();
    config.limits.max_connections = max_connections;
    config.limits.max_connections_per_ip = per_ip;
    let node = common::start(config).await;
    node.create_volume("v", 8 << 20, None).expect("volume");
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_per_address_cap_the_oldest_negotiating_connection_of_that_address_is_evicted() {
    let node = start_capped(8, 2).await;
    // Both greeted: both admitted, both negotiating.
    let oldest = Haggle::open(&node).await;
    let younger = Haggle::open(&node).await;
    let newest = Haggle::open(&node).await;
    assert!(
        oldest.closes().await,
        "the oldest negotiating connection was kept"
    );
    let v = view(&node);
    assert_eq!(v.evicted_total, 1);
    assert_eq!(v.refused_total, 0);
    // The younger one and the new one are served.
    let (mut younger, _) = younger.go("v").await;
    let (mut newest, _) = newest.go("v").await;
    assert_eq!(younger.write(0, &[1u8; 512]).await, 0);
    assert_eq!(newest.read(0, 512).await, (0, vec![1u8; 512]));
    younger.disconnect().await;
    newest.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_per_address_cap_with_both_transmitting_that_address_is_refused_another_is_served() {
    let node = start_capped(8, 2).await;
    let mut first = common::connect(&node, "v").await.expect("first");
    let second = common::connect(&node, "v").await.expect("second");
    // Closed right after accept: not even a greeting.
    let mut refused = common::connect_from(&node, HOME).await;
    assert!(
        common::closes(&mut refused).await,
        "a third connection from the address"
    );
    assert_eq!(view(&node).refused_total, 1);
    // Another address is under its own cap.
    let (mut other, _) = Haggle::open_from(&node, OTHER).await.go("v").await;
    assert_eq!(other.write(0, &[2u8; 512]).await, 0);
    assert_eq!(first.read(0, 512).await, (0, vec![2u8; 512]));
    let v = view(&node);
    assert_eq!((v.open, v.transmitting, v.evicted_total), (3, 3, 0));
    other.disconnect().await;
    second.disconnect().await;
    first.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_node_cap_the_address_with_the_most_negotiating_connections_loses_its_oldest() {
    let node = start_capped(3, 3).await;
    let flood_oldest = Haggle::open_from(&node, HOME).await;
    let flood_younger = Haggle::open_from(&node, HOME).await;
    let other = Haggle::open_from(&node, OTHER).await;
    // A fourth from the other address: the node is full, the flooding address pays.
    let newcomer = Haggle::open_from(&node, OTHER).await;
    assert!(
        flood_oldest.closes().await,
        "the flood's oldest connection was kept"
    );
    let v = view(&node);
    assert_eq!((v.open, v.evicted_total, v.refused_total), (3, 1, 0));
    for haggle in [flood_younger, other, newcomer] {
        let (client, _) = haggle.go("v").await;
        client.disconnect().await;
    }
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_node_cap_with_every_connection_transmitting_any_address_is_refused() {
    let node = start_capped(2, 2).await;
    let mut a = common::connect(&node, "v").await.expect("a");
    let (b, _) = Haggle::open_from(&node, OTHER).await.go("v").await;
    let mut refused = common::connect_from(&node, Ipv4Addr::new(127, 0, 0, 3)).await;
    assert!(
        common::closes(&mut refused).await,
        "served past the node's cap"
    );
    let v = view(&node);
    assert_eq!((v.open, v.transmitting, v.refused_total), (2, 2, 1));
    assert_eq!(
        a.read(0, 512).await.0,
        0,
        "an admitted session was disturbed"
    );
    // A slot given back is taken by the next client once the session has ended.
    b.disconnect().await;
    assert!(common::eventually(|| view(&node).open == 1).await);
    let c = common::connect(&node, "v").await.expect("the freed slot");
    c.disconnect().await;
    a.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_table_shows_phase_volume_and_counts() {
    let node = start_capped(8, 8).await;
    let negotiating = Haggle::open(&node).await;
    let transmitting = common::connect(&node, "v").await.expect("served");
    let v = view(&node);
    assert_eq!((v.open, v.negotiating, v.transmitting), (2, 1, 1));
    assert_eq!((v.max_connections, v.max_connections_per_ip), (8, 8));
    let volumes: Vec<Option<&str>> = v.connections.iter().map(|c| c.volume.as_deref()).collect();
    assert_eq!(volumes, [None, Some("v")], "in order of acceptance");
    assert_eq!(v.connections[1].phase, "transmitting");
    assert_eq!(v.accepted_total, 2);
    drop(negotiating);
    transmitting.disconnect().await;
    assert!(
        common::eventually(|| view(&node).open == 0).await,
        "{:?}",
        view(&node)
    );
    node.shutdown().await.expect("a clean stop");
}

/// Limits where two greedy connections fill their tenant's share of the shared pool: 1 MiB
/// requests, 4 MiB per connection and per tenant, 16 MiB in all over 4 connections (a reserve
/// of 1 MiB each).
fn tight_budget() -> headroom_node::config::NodeConfig {
    let mut config = common::config();
    let limits = &mut config.limits;
    limits.max_connections = 4;
    limits.max_connections_per_ip = 4;
    limits.max_request_bytes = 1 << 20;
    limits.max_inflight_bytes_per_conn = 4 << 20;
    limits.max_inflight_bytes_per_tenant = 4 << 20;
    limits.max_inflight_bytes_per_node = 16 << 20;
    config
}

/// Sends `count` reads of 1 MiB, reading none of the replies.
async fn pipeline_unread(client: &mut common::Client, count: u64) {
    for i in 0..count {
        client
            .send_request(Req::new(NBD_CMD_READ, (i % 8) << 20, 1 << 20), &[])
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_connections_that_never_read_do_not_stop_their_tenants_other_connection() {
    let node = common::start(tight_budget()).await;
    node.create_volume("v", 8 << 20, None).expect("volume");
    assert_eq!(
        node.api_state()
            .budget
            .view()
            .reserved_inflight_bytes_per_conn,
        1 << 20,
        "the limits do not give the reserve this test assumes"
    );
    let mut greedy_a = common::connect(&node, "v").await.expect("a");
    let mut greedy_b = common::connect(&node, "v").await.expect("b");
    // Far more than the socket buffers and both connections' budgets hold.
    pipeline_unread(&mut greedy_a, 64).await;
    pipeline_unread(&mut greedy_b, 64).await;
    // The anonymous tenant's share is full and a charge waits for it.
    let full = common::eventually(|| {
        let budget = node.api_state().budget.view();
        budget.tenants.iter().any(|t| {
            t.tenant.is_none()
                && t.inflight_bytes - t.reserved_inflight_bytes == 4 << 20
                && t.waiting_charges >= 1
        })
    })
    .await;
    assert!(
        full,
        "the greedy clients did not fill the tenant: {:?}",
        node.api_state().budget.view()
    );

    // Same tenant (no tenant), small requests: served from its own reserve.
    let mut polite = common::connect(&node, "v").await.expect("polite");
    let served = tokio::time::timeout(GUARD, async {
        assert_eq!(polite.write(0, &[3u8; 4096]).await, 0);
        polite.read(0, 4096).await
    })
    .await;
    assert_eq!(
        served.expect("the polite connection was starved by the greedy ones"),
        (0, vec![3u8; 4096])
    );
    polite.disconnect().await;

    // Hanging up with replies unread gives everything back.
    drop(greedy_a);
    drop(greedy_b);
    let empty = common::eventually(|| {
        let budget = node.api_state().budget.view();
        budget.inflight_bytes == 0 && budget.tenants.is_empty() && view(&node).open == 0
    })
    .await;
    assert!(
        empty,
        "bytes still held: {:?}",
        node.api_state().budget.view()
    );
    node.shutdown().await.expect("a clean stop");
}

/// Sends the header of a WRITE of `length` bytes and only the first 4 KiB of its payload: the
/// server has charged the whole buffer and waits for the rest, holding it until the session
/// ends (or the reply stall timeout, 60 s, far past the test). Unlike reads whose replies go
/// unread, which keep draining into the socket buffers for a while, this holds a fixed charge
/// from the moment the budget shows it.
async fn write_never_finished(client: &mut common::Client, length: u32) {
    client
        .send_request(Req::new(NBD_CMD_WRITE, 0, length), &[7u8; 4096])
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_reserve_waits_for_the_greedy_ones_and_is_served_when_they_go() {
    let mut config = tight_budget();
    config.limits.max_request_bytes = 2 << 20;
    let node = common::start(config).await;
    node.create_volume("v", 8 << 20, None).expect("volume");
    let budget = || node.api_state().budget.view();
    assert_eq!(
        budget().reserved_inflight_bytes_per_conn,
        1 << 20,
        "the limits do not give the reserve this test assumes"
    );
    // Two 2 MiB charges (larger than a reserve: shared pool) fill the tenant's 4 MiB, held.
    let mut greedy_a = common::connect(&node, "v").await.expect("a");
    let mut greedy_b = common::connect(&node, "v").await.expect("b");
    write_never_finished(&mut greedy_a, 2 << 20).await;
    write_never_finished(&mut greedy_b, 2 << 20).await;
    let shared_of_tenant = || {
        budget()
            .tenants
            .iter()
            .map(|t| t.inflight_bytes - t.reserved_inflight_bytes)
            .sum::<u64>()
    };
    assert!(common::eventually(|| shared_of_tenant() == 4 << 20).await);
    // A 1 MiB read fits the reserve and is served; a 2 MiB read needs the shared pool.
    let mut third = common::connect(&node, "v").await.expect("third");
    let small = third
        .send_request(Req::new(NBD_CMD_READ, 0, 1 << 20), &[])
        .await;
    let large = third
        .send_request(Req::new(NBD_CMD_READ, 0, 2 << 20), &[])
        .await;
    let (cookie, error) = tokio::time::timeout(GUARD, third.read_simple_header())
        .await
        .expect("the reserve did not serve the 1 MiB read");
    assert_eq!((cookie, error), (small, 0));
    third.read_payload(1 << 20).await;
    // The large one waits (the only charge that can: the greedy sessions are reading payload).
    let waiting = || {
        budget()
            .tenants
            .iter()
            .map(|t| t.waiting_charges)
            .sum::<usize>()
    };
    assert!(common::eventually(|| waiting() == 1).await);
    assert_eq!(
        shared_of_tenant(),
        4 << 20,
        "a greedy charge was given back"
    );
    // ... and is granted once they are gone.
    drop(greedy_a);
    drop(greedy_b);
    let (cookie, error) = tokio::time::timeout(GUARD, third.read_simple_header())
        .await
        .expect("the waiting read was never granted");
    assert_eq!((cookie, error), (large, 0));
    third.read_payload(2 << 20).await;
    third.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_clean_disconnect_the_budget_and_the_table_are_back_to_zero() {
    let node = common::start(tight_budget()).await;
    node.create_volume("v", 8 << 20, None).expect("volume");
    let mut client = common::connect(&node, "v").await.expect("served");
    // Pipelined 1 MiB reads, all read back: bytes were held and given back.
    for i in 0..16u64 {
        client
            .send_request(Req::new(NBD_CMD_READ, (i % 8) << 20, 1 << 20), &[])
            .await;
    }
    for _ in 0..16 {
        let (_, error) = client.read_simple_header().await;
        assert_eq!(error, 0);
        client.read_payload(1 << 20).await;
    }
    let during = node.api_state().budget.view();
    assert!(
        during.peak_inflight_bytes >= 1 << 20,
        "nothing was ever charged: {during:?}"
    );
    assert_eq!(during.tenants.len(), 1, "the session's tenant account");
    client.disconnect().await;
    let back = common::eventually(|| {
        let budget = node.api_state().budget.view();
        budget.inflight_bytes == 0
            && budget.reserved_inflight_bytes == 0
            && budget.tenants.is_empty()
            && view(&node).open == 0
    })
    .await;
    assert!(back, "{:?}", node.api_state().budget.view());
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_connection_request_limit_paces_a_pipeline_without_losing_a_request() {
    let mut config = common::config();
    config.limits.max_inflight_requests_per_conn = 2;
    let node = common::start(config).await;
    node.create_volume("v", 1 << 20, None).expect("volume");
    let mut client = common::connect(&node, "v").await.expect("served");
    let mut cookies = std::collections::HashSet::new();
    for i in 0..32u64 {
        let cookie = client
            .send_request(Req::new(NBD_CMD_READ, i * 4096, 4096), &[])
            .await;
        cookies.insert(cookie);
    }
    for _ in 0..32 {
        let (cookie, error) = client.read_simple_header().await;
        assert_eq!(error, 0);
        assert!(
            cookies.remove(&cookie),
            "cookie {cookie} unknown or answered twice"
        );
        client.read_payload(4096).await;
    }
    let peak = view(&node).connections[0].peak_inflight_requests;
    assert!(
        (1..=2).contains(&peak),
        "peak of {peak} requests in flight with a limit of 2"
    );
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}
