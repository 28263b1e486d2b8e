//! The published burst timelines, reproduced exactly by the shipped Credit policy through the
//! preview (which is what `headroom qos preview` prints).

use headroom_qos::{Preset, PreviewRequest, preview};

const GIB: u64 = 1 << 30;

#[test]
fn gp2_100_gib_bursts_2000_s_at_3000_then_holds_300() {
    let rows = preview(&PreviewRequest {
        preset: Preset::parse("gp2").unwrap(),
        size_bytes: 100 * GIB,
        demand_iops: Some(3_000),
        demand_bytes_per_s: None,
        io_size_bytes: 16 * 1024,
        seconds: 2_060,
    })
    .unwrap();
    assert_eq!(rows.len(), 2_060);
    for r in &rows[..2_000] {
        assert_eq!(r.iops, 3_000, "second {}", r.t_s);
        assert_eq!(r.bytes_per_s, 3_000 * 16 * 1024, "second {}", r.t_s);
    }
    for r in &rows[2_000..] {
        assert_eq!(r.iops, 300, "second {}", r.t_s);
        assert_eq!(r.credit_balance, Some(0), "second {}", r.t_s);
    }
    // 5.4 M credits drained at 3,000 − 300 = 2,700 per second.
    assert_eq!(rows[0].credit_balance, Some(5_400_000 - 2_700));
    assert_eq!(rows[999].credit_balance, Some(2_700_000));
    assert_eq!(rows[1_998].credit_balance, Some(2_700));
    assert_eq!(rows[1_999].credit_balance, Some(0));
}

#[test]
fn qemu_iotune_bursts_12_5_s_then_holds_1000() {
    for spelling in [
        "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10",
        "libvirt:total_iops_sec=1000,total_iops_sec_max=5000,total_iops_sec_max_length=10",
    ] {
        let rows = preview(&PreviewRequest {
            preset: Preset::parse(spelling).unwrap(),
            size_bytes: 10 * GIB,
            demand_iops: Some(20_000),
            demand_bytes_per_s: None,
            io_size_bytes: 4096,
            seconds: 40,
        })
        .unwrap();
        let iops: Vec<u64> = rows.iter().map(|r| r.iops).collect();
        assert!(iops[..12].iter().all(|&n| n == 5_000), "{iops:?}");
        // 12.0–12.5 s at 5,000/s, 12.5–13 s at 1,000/s.
        assert_eq!(iops[12], 3_000);
        assert!(iops[13..].iter().all(|&n| n == 1_000), "{iops:?}");
        // Total over the burst: 12.5 s × 5,000 = 62,500 requests before 12.5 s.
        assert_eq!(iops[..12].iter().sum::<u64>() + 2_500, 62_500);
    }
}

#[test]
fn gp2_small_volume_uses_the_100_iops_floor_for_refill() {
    // 1 GiB: baseline (and refill) 100 IOPS, so the burst lasts 5.4 M / 2,900 s.
    let rows = preview(&PreviewRequest {
        preset: Preset::Gp2,
        size_bytes: GIB,
        demand_iops: Some(3_000),
        demand_bytes_per_s: None,
        io_size_bytes: 4096,
        seconds: 1_870,
    })
    .unwrap();
    // 5,400,000 / 2,900 = 1,862.07 s.
    assert!(rows[..1_862].iter().all(|r| r.iops == 3_000));
    assert!(rows[1_862].iops < 3_000 && rows[1_862].iops > 100);
    assert!(rows[1_863..].iter().all(|r| r.iops == 100));
}
