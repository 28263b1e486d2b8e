//! Pacing per capacity dimension: a request waiting for one dimension does not hold back
//! requests that need only another.
//!
//! The node is NIC-bound (egress and ingress each 1 GB/s, CPU plentiful) and its tenants send
//! half reads and half writes of 128 KiB in random order: a read needs egress, a write
//! ingress. A paced policy that serves the front volume's head request or waits idles one
//! direction whenever that head needs the other (head-of-line blocking across dimensions),
//! and a zero-deep node pacer cannot bank what the idle direction lost.

mod common;

use common::{Driver, MS, S};
use headroom_qos::{
    BurstMode, CostVector, IoRate, NodeCapacity, OpKind, PolicyKind, PolicyParams, VolumeId,
    VolumeQos,
};

const GB: u64 = 1_000_000_000;
const LEN: u32 = 128 * 1024;

fn nic_bound() -> NodeCapacity {
    NodeCapacity::new(CostVector::new(4 * GB, GB, GB, u64::MAX))
}

/// Sold 1/8 of each direction, may burst to the whole node.
fn burster() -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(u64::MAX, GB / 8),
        ceiling: IoRate::UNLIMITED,
        burst: BurstMode::OnDemand,
        weight: 1,
        io_unit_bytes: 0,
    }
}

/// The `k`-th request of `vol`: a read or a write of 128 KiB, 50/50 in a fixed random order.
fn mixed(vol: VolumeId, k: u64) -> (OpKind, u32, CostVector) {
    let mut x = (u64::from(vol) << 32 | k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 32;
    let op = if x & 1 == 0 {
        OpKind::Read
    } else {
        OpKind::Write
    };
    (op, LEN, common::cost(20_000, op, LEN))
}

/// Share of each direction's capacity used over the second after a 100 ms warm-up, in
/// thousandths: (egress, ingress).
fn directions_used(kind: PolicyKind, params: &PolicyParams, volumes: u32) -> (u64, u64) {
    let mut d = Driver::with_params(kind, nic_bound(), params);
    d.service_ns = 200_000;
    let vols: Vec<VolumeId> = (1..=volumes).collect();
    for &v in &vols {
        d.add(v, &burster());
    }
    let (from, to) = (100 * MS, 100 * MS + S);
    d.run_closed_loop(to, &vols, 32, mixed);
    let permille = |bytes: u64| bytes * 1_000 / GB;
    (
        permille(d.bytes(OpKind::Read, from, to)),
        permille(d.bytes(OpKind::Write, from, to)),
    )
}

#[test]
fn mixed_reads_and_writes_fill_both_directions_of_a_nic_bound_node() {
    let defaults = PolicyParams::default();
    let no_reserve = PolicyParams {
        reserve_permille: 0,
        ..defaults
    };
    let mut short = Vec::new();
    for (kind, params) in [
        (PolicyKind::Wild, defaults),
        (PolicyKind::Burst, defaults),
        (PolicyKind::Burst, no_reserve),
        (PolicyKind::Credit, defaults),
        (PolicyKind::Base, defaults),
    ] {
        for volumes in [1, 4] {
            let (egress, ingress) = directions_used(kind, &params, volumes);
            let reserve = u64::from(params.reserve_permille);
            eprintln!(
                "{kind:?} (reserve {reserve}‰) x{volumes}: egress {egress}‰ ingress {ingress}‰"
            );
            let floor = match kind {
                // Base holds every volume at its baseline: 1/8 of the NIC's bytes per volume,
                // so 1/16 of each direction.
                PolicyKind::Base => u64::from(volumes) * 125 / 2 * 95 / 100,
                // Burst keeps its reserve from bursting volumes (their baseline requests
                // included): 95 % of the rest.
                PolicyKind::Burst => (1_000 - reserve) * 95 / 100,
                _ => 950,
            };
            if egress < floor || ingress < floor {
                short.push(format!(
                    "{kind:?} (reserve {reserve}‰) with {volumes} volume(s): egress {egress}‰, ingress {ingress}‰ of capacity (want ≥ {floor}‰ each)"
                ));
            }
            assert!(
                egress <= 1_001 && ingress <= 1_001,
                "{kind:?}: over capacity: egress {egress}‰, ingress {ingress}‰"
            );
        }
    }
    assert!(short.is_empty(), "{}", short.join("\n"));
}

/// Egress 1 MB/s, everything else unlimited: a 128 KiB read holds egress for 131 ms.
fn egress_bound() -> NodeCapacity {
    NodeCapacity::new(CostVector::new(u64::MAX, u64::MAX, 1_000_000, u64::MAX))
}

/// The order in which one volume's read, read, write (queued in that order at 0) start, with
/// `reorder_lookahead` as given.
fn start_times(reorder_lookahead: u32) -> Vec<(OpKind, u64)> {
    let params = PolicyParams {
        reorder_lookahead,
        ..PolicyParams::default()
    };
    let mut d = Driver::with_params(PolicyKind::Wild, egress_bound(), &params);
    d.add(1, &burster());
    for op in [OpKind::Read, OpKind::Read, OpKind::Write] {
        d.enqueue(1, 1, op, LEN, common::cost(1_000, op, LEN));
    }
    d.run_until(S);
    d.log.iter().map(|x| (x.req.op, x.at_ns)).collect()
}

#[test]
fn a_write_behind_a_read_waiting_for_egress_runs_at_once() {
    // The second read waits for the first read's egress debt (131 ms); the write behind it
    // needs only ingress, so it runs first, at once.
    let debt_ns = u64::from(LEN) * S / 1_000_000;
    assert_eq!(
        start_times(16),
        vec![
            (OpKind::Read, 0),
            (OpKind::Write, 0),
            (OpKind::Read, debt_ns)
        ]
    );
    // With no lookahead the volume's requests keep their arrival order.
    assert_eq!(
        start_times(0),
        vec![
            (OpKind::Read, 0),
            (OpKind::Read, debt_ns),
            (OpKind::Write, debt_ns)
        ]
    );
}

#[test]
fn other_volumes_pass_a_volume_waiting_for_egress_and_it_keeps_its_turn() {
    // Volume 1 reads, volume 2 writes; egress is in debt after volume 1's first read. With
    // no lookahead inside a volume, volume 2's writes still run while volume 1 waits, and
    // volume 1 runs first once egress is repaid (it kept its place at the front).
    let params = PolicyParams {
        reorder_lookahead: 0,
        ..PolicyParams::default()
    };
    let mut d = Driver::with_params(PolicyKind::Wild, egress_bound(), &params);
    d.add(1, &burster());
    d.add(2, &burster());
    d.enqueue(
        1,
        2,
        OpKind::Read,
        LEN,
        common::cost(1_000, OpKind::Read, LEN),
    );
    d.enqueue(
        2,
        3,
        OpKind::Write,
        LEN,
        common::cost(1_000, OpKind::Write, LEN),
    );
    d.run_until(S);
    let debt_ns = u64::from(LEN) * S / 1_000_000;
    let order: Vec<(u32, u64)> = d.log.iter().map(|x| (x.req.volume, x.at_ns)).collect();
    assert_eq!(order, vec![(1, 0), (2, 0), (2, 0), (2, 0), (1, debt_ns)]);
}
