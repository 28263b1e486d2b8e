//! The configuration's layers, checks and resolution, in process.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;

use headroom_node::Limits;
use headroom_node::config::{DispatchMode, PolicyChoice, QosConfig};
use headroom_node::metrics::MetricsConfig;
use headroom_qos::model::{IoCostModel, LinearCpu};
use headroom_qos::{CostVector, NS_PER_S, PolicyKind, PolicyParams};
use headroom_store::{FaultRule, FaultScope};

use super::*;

fn parse(text: &str) -> Result<ConfigFile> {
    ConfigFile::parse(text, Path::new("test.toml"))
}

fn resolved(text: &str) -> NodeConfig {
    resolve(&parse(text).expect("parses")).expect("valid")
}

#[test]
fn checksums_are_on_unless_storage_says_otherwise() {
    assert!(resolved("").checksums);
    assert!(!resolved("[storage]\nchecksums = false\n").checksums);
}

#[test]
fn the_scrub_rate_and_interval_come_from_storage_scrub_and_are_checked() {
    let c = resolved("");
    assert_eq!(
        (c.scrub_rate_bytes_per_s, c.scrub_interval_s),
        (16 << 20, 7 * 24 * 3600)
    );
    let c = resolved("[storage.scrub]\nrate = \"32MiB\"\ninterval_s = 0\n");
    assert_eq!(
        (c.scrub_rate_bytes_per_s, c.scrub_interval_s),
        (32 << 20, 0)
    );
    assert!(err("[storage.scrub]\nrate = 0\n").contains("storage.scrub.rate"));
    assert!(err("[storage.scrub]\nrate = \"11GiB\"\n").contains("10GiB per second"));
    assert!(err("[storage.scrub]\ninterval_s = 31536001\n").contains("storage.scrub.interval_s"));
}

#[test]
fn the_rebuild_rate_comes_from_storage_rebuild() {
    assert_eq!(resolved("").rebuild_rate_bytes_per_s, 64 << 20);
    let c = resolved("[storage.rebuild]\nrate = \"128MiB\"\n");
    assert_eq!(c.rebuild_rate_bytes_per_s, 128 << 20);
    assert_eq!(c.fail_device_after_errors, 16);
    let c = resolved("[storage.rebuild]\nfail_device_after_errors = 0\n");
    assert_eq!(c.fail_device_after_errors, 0);
    assert!(err("[storage.rebuild]\nspeed = 1\n").contains("speed"));
}

fn err(text: &str) -> String {
    match parse(text) {
        Err(e) => format!("{e:#}"),
        Ok(layer) => match resolve(&layer) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted: {text}"),
        },
    }
}

#[test]
fn empty_file_gives_the_built_in_defaults() {
    let c = resolved("");
    let d = NodeConfig::new(StoreBackend::Memory { capacity_bytes: 1 });
    assert!(matches!(
        &c.backend,
        StoreBackend::Files { data_dir, device_count: 2, device_capacity_bytes, device_paths }
            if data_dir == Path::new(DEFAULT_DATA_DIR)
                && *device_capacity_bytes == 64 << 30
                && device_paths.is_empty()
    ));
    assert_eq!(c.nbd_listen, d.nbd_listen);
    assert_eq!(c.api_listen, d.api_listen);
    assert_eq!(c.io_threads, d.io_threads);
    assert_eq!(c.inline_max_bytes, None);
    assert_eq!(c.coalesce_us, None);
    assert_eq!(c.qos, QosConfig::default());
    assert_eq!(c.credit_save_period_ms, d.credit_save_period_ms);
    assert_eq!(c.emulated_device, None);
    let l = Limits::default();
    assert_eq!(c.limits.max_connections, l.max_connections);
    assert_eq!(c.limits.max_request_bytes, l.max_request_bytes);
    assert_eq!(
        c.limits.max_inflight_bytes_per_conn,
        l.max_inflight_bytes_per_conn
    );
}

#[test]
fn coalescing_is_on_by_default_for_memory_and_off_for_files() {
    let memory = resolved("[storage]\nmemory = \"1GiB\"");
    assert_eq!(
        memory.effective_coalesce_us(),
        headroom_node::config::DEFAULT_COALESCE_US
    );
    assert_eq!(resolved("").effective_coalesce_us(), 0);
    let files_on = resolved("[server]\ncoalesce_us = 7");
    assert_eq!(files_on.effective_coalesce_us(), 7);
    let memory_off = resolved("[server]\ncoalesce_us = 0\n[storage]\nmemory = \"1GiB\"");
    assert_eq!(memory_off.effective_coalesce_us(), 0);
}

#[test]
fn every_key_reaches_the_node_config() {
    let c = resolved(
        r#"
        [server]
        nbd_listen = "127.0.0.1:1"
        api_listen = "127.0.0.1:2"
        io_threads = 3
        inline_max_bytes = "16KiB"
        coalesce_us = 35
        net_threads = 3
        [storage]
        memory = "1GiB"
        [storage.emulated]
        parallelism = 4
        write_interference_permille = 500
        [storage.emulated.model]
        rbps = "200MB"
        rseqiops = 48828
        rrandiops = 20000
        wbps = 100000000
        wseqiops = 20000
        wrandiops = 10000
        [limits]
        max_connections = 7
        max_connections_per_ip = 3
        max_inflight_requests = 8
        max_inflight_bytes = "64MiB"
        max_inflight_bytes_per_tenant = "96MiB"
        max_inflight_bytes_per_node = "2GiB"
        max_request_bytes = "1MiB"
        handshake_timeout_ms = 900
        client_stall_timeout_ms = 1500
        [qos]
        policy = "drr-vop"
        workers = 4
        dispatch = "stealing"
        credit_save_period_ms = 250
        [qos.capacity]
        cpu_ns_per_s = 3_000_000_000
        ingress_bytes_per_s = "1GB"
        egress_bytes_per_s = 2_000_000_000
        device_units_per_s = 1_000_000_000
        [qos.params]
        window_ns = 5_000_000
        limiter_depth_ns = 1_000_000
        history_windows = 4
        alpha_permille = 1500
        throttle_weight_permille = 2000
        reserve_permille = 100
        drr_quantum_device_units = 5000
        seed = 42
        track_invariants = true
        reorder_lookahead = 4
        [qos.cost]
        cpu = { read = { base_ns = 1000, per_kib_ps = 50000 }, write = { base_ns = 2000, per_kib_ps = 60000 }, other = { base_ns = 500, per_kib_ps = 0 } }
        device = { linear = { rbps = 1, rseqiops = 2, rrandiops = 3, wbps = 4, wseqiops = 5, wrandiops = 6 } }
        "#,
    );
    assert!(
        matches!(c.backend, StoreBackend::Memory { capacity_bytes } if capacity_bytes == 1 << 30)
    );
    assert_eq!(
        c.nbd_listen,
        Some("127.0.0.1:1".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(c.api_listen, "127.0.0.1:2".parse::<SocketAddr>().unwrap());
    assert_eq!(c.io_threads, 3);
    assert_eq!(c.inline_max_bytes, Some(16 << 10));
    assert_eq!(c.coalesce_us, Some(35));
    assert_eq!(c.net_threads, Some(3));
    assert_eq!(c.effective_net_threads(), 3);
    let e = c.emulated_device.expect("emulated device");
    assert_eq!(e.parallelism, 4);
    assert_eq!(e.write_interference_permille, 500);
    assert_eq!(e.model.rbps, 200_000_000);
    assert_eq!(e.model.wrandiops, 10_000);
    assert_eq!(c.limits.max_connections, 7);
    assert_eq!(c.limits.max_inflight_requests_per_conn, 8);
    assert_eq!(c.limits.max_inflight_bytes_per_conn, 64 << 20);
    assert_eq!(c.limits.max_request_bytes, 1 << 20);
    assert_eq!(c.limits.handshake_timeout_ms, 900);
    assert_eq!(c.limits.max_connections_per_ip, 3);
    assert_eq!(c.limits.max_inflight_bytes_per_tenant, 96 << 20);
    assert_eq!(c.limits.max_inflight_bytes_per_node, 2 << 30);
    assert_eq!(c.limits.client_stall_timeout_ms, 1500);
    assert_eq!(c.credit_save_period_ms, 250);
    let q = &c.qos;
    assert_eq!(q.policy, PolicyChoice::Policy(PolicyKind::DrrVop));
    assert_eq!(q.workers, 4);
    assert_eq!(q.dispatch, DispatchMode::Stealing);
    assert_eq!(
        q.capacity.per_second,
        CostVector::new(3_000_000_000, 1_000_000_000, 2_000_000_000, 1_000_000_000)
    );
    assert_eq!(
        q.params,
        PolicyParams {
            window_ns: 5_000_000,
            limiter_depth_ns: 1_000_000,
            history_windows: 4,
            alpha_permille: 1500,
            throttle_weight_permille: 2000,
            reserve_permille: 100,
            drr_quantum_device_units: 5000,
            seed: 42,
            track_invariants: true,
            reorder_lookahead: 4,
            pacer_depth_ns: QosConfig::server_params().pacer_depth_ns,
        }
    );
    assert_eq!(
        q.cost_model.cpu.read,
        LinearCpu {
            base_ns: 1000,
            per_kib_ps: 50_000
        }
    );
    assert_eq!(
        q.cost_model.cpu.write,
        LinearCpu {
            base_ns: 2000,
            per_kib_ps: 60_000
        }
    );
    assert_eq!(
        q.cost_model.cpu.other,
        LinearCpu {
            base_ns: 500,
            per_kib_ps: 0
        }
    );
    assert_eq!(
        q.cost_model.device,
        DeviceModel::Linear(IoCostModel {
            rbps: 1,
            rseqiops: 2,
            rrandiops: 3,
            wbps: 4,
            wseqiops: 5,
            wrandiops: 6
        })
    );
}

#[test]
fn files_backend_keys() {
    let c = resolved(
        r#"
        [storage]
        data_dir = "/srv/headroom"
        devices = 3
        device_size = "8GiB"
        device_paths = ["/dev/a", "/dev/b"]
        "#,
    );
    match c.backend {
        StoreBackend::Files {
            data_dir,
            device_count,
            device_capacity_bytes,
            device_paths,
        } => {
            assert_eq!(data_dir, Path::new("/srv/headroom"));
            assert_eq!(device_count, 3);
            assert_eq!(device_capacity_bytes, 8 << 30);
            assert_eq!(
                device_paths,
                vec![PathBuf::from("/dev/a"), PathBuf::from("/dev/b")]
            );
        }
        other => panic!("{other:?}"),
    }
    // Without a calibration the CPU capacity follows the workers.
    let c = resolved("[qos]\nworkers = 5\n");
    assert_eq!(c.qos.capacity, QosConfig::default_capacity(5));
    // Tracked in debug builds (this test's), never in release.
    assert_eq!(c.qos.params.track_invariants, cfg!(debug_assertions));
}

#[test]
fn vop_curve_and_none_device() {
    let c = resolved(
        r#"
        [qos.cost.device.vop]
        read = [["4KiB", 80000], ["64KiB", 20000], [1048576, 2000]]
        write = [["4KiB", 60000]]
        "#,
    );
    let DeviceModel::Vop(curve) = c.qos.cost_model.device else {
        panic!("not a VOP curve")
    };
    assert_eq!(curve.max_iops, 80_000);
    assert_eq!(
        curve.read,
        vec![(4096, 80_000), (65_536, 20_000), (1 << 20, 2000)]
    );
    assert_eq!(curve.write, vec![(4096, 60_000)]);
    let c = resolved("[qos.cost]\ndevice = \"none\"\n");
    assert_eq!(c.qos.cost_model.device, DeviceModel::None);
}

#[test]
fn emulated_device_with_a_curve() {
    let c = resolved(
        r#"
        [storage]
        memory = "1GiB"
        [storage.emulated]
        parallelism = 8
        curve = { read = [["4KiB", 90000], ["256KiB", 2600]], write = [["4KiB", 34000], ["256KiB", 1050]] }
        [qos.cost]
        device = { vop = { read = [["4KiB", 90000], ["256KiB", 2600]], write = [["4KiB", 34000], ["256KiB", 1050]] } }
        [qos.capacity]
        device_units_per_s = 90_000_000
        "#,
    );
    let curve = c.emulated_curve.expect("a curve");
    assert_eq!(curve.max_iops, 90_000);
    assert_eq!(curve.read, vec![(4096, 90_000), (256 << 10, 2600)]);
    let spec = c.emulated_device.expect("a device");
    assert_eq!(spec.parallelism, 8);
    assert_eq!(spec.model.rrandiops, 90_000);
    assert_eq!(spec.model.wbps, (256 << 10) * 1050);
    assert_eq!(c.qos.cost_model.device, DeviceModel::Vop(curve));
    // Without a curve: none.
    let c = resolved(
        "[storage.emulated]\nparallelism = 1\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1\n[qos.cost]\ndevice = \"none\"\n",
    );
    assert!(c.emulated_curve.is_none());
    // Both, neither, or a bad curve: the key and the reason.
    let both = err(
        "[storage.emulated]\nparallelism = 1\ncurve = { read = [[4096, 1]], write = [[4096, 1]] }\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
    );
    assert!(
        both.contains("storage.emulated.curve") && both.contains("not both"),
        "{both}"
    );
    let neither = err("[storage.emulated]\nparallelism = 1\n");
    assert!(
        neither.contains("storage.emulated.model") && neither.contains("curve"),
        "{neither}"
    );
    let bad = err(
        "[storage.emulated]\nparallelism = 1\ncurve = { read = [[8192, 1], [4096, 2]], write = [[4096, 1]] }\n",
    );
    assert!(
        bad.contains("storage.emulated.curve.read") && bad.contains("increasing"),
        "{bad}"
    );
}

#[test]
fn write_cost_aimd_can_be_turned_off() {
    let congested = |text: &str| {
        let mut m = resolved(text).qos.cost_model;
        let before = m.estimate(headroom_qos::OpKind::Write, 4096, false);
        for _ in 0..10 {
            m.observe(
                headroom_qos::OpKind::Write,
                4096,
                false,
                &before,
                headroom_qos::Observed {
                    service_ns: 50_000_000,
                    queue_ns: 0,
                },
            );
        }
        let after = m.estimate(headroom_qos::OpKind::Write, 4096, false);
        (before.device_units, after.device_units)
    };
    let device = "[qos.cost]\ndevice = { linear = { rbps = 200000000, rseqiops = 48828, rrandiops = 20000, wbps = 150000000, wseqiops = 36621, wrandiops = 15000 } }\n";
    // On by default: 50 ms writes raise the write cost toward 3.4x.
    let (before, after) = congested(device);
    assert!(after > 3 * before, "{before} -> {after}");
    let (before, after) = congested(&format!("{device}write_cost_aimd = false\n"));
    assert_eq!(before, after);
    let (before, after) = congested(&format!("{device}write_cost_aimd = true\n"));
    assert!(after > 3 * before, "{before} -> {after}");
}

#[test]
fn out_of_range_values_name_key_value_and_what_is_allowed() {
    let cases = [
        (
            "[qos]\nworkers = 0",
            "qos.workers = 0: must be between 1 and 64",
        ),
        (
            "[qos]\nworkers = 65",
            "qos.workers = 65: must be between 1 and 64",
        ),
        (
            "[qos]\npolicy = \"fast\"",
            "qos.policy = \"fast\": expected off, wild, base, credit, burst, mclock or drr-vop",
        ),
        (
            "[qos]\ndispatch = \"random\"",
            "qos.dispatch = \"random\": expected one-to-n",
        ),
        (
            "[qos.capacity]\ncpu_ns_per_s = 0",
            "qos.capacity.cpu_ns_per_s = 0: must be greater than 0",
        ),
        (
            "[qos]\nworkers = 8\n[qos.capacity]\ndevice_units_per_s = 4",
            "qos.capacity.device_units_per_s = 4: must be at least qos.workers (8)",
        ),
        (
            "[qos.params]\nwindow_ns = 5",
            "qos.params: invalid policy parameters: window_ns 5",
        ),
        (
            "[qos.params]\nreserve_permille = 600",
            "reserve_permille 600 must be < 500",
        ),
        (
            "[server]\nio_threads = 1000",
            "server.io_threads = 1000: must be between 0 (inline) and 256",
        ),
        (
            "[server]\ncoalesce_us = 5000",
            "server.coalesce_us = 5000: must be between 0 (off) and 1000",
        ),
        (
            "[server]\nnet_threads = 257",
            "server.net_threads = 257: must be between 0 (connections on the shared runtime) and 256",
        ),
        (
            "[server]\ninline_max_bytes = \"8GiB\"",
            "server.inline_max_bytes = \"8GiB\": must be less than 4GiB",
        ),
        (
            "[storage]\nmemory = 0",
            "storage.memory = 0: must be greater than 0",
        ),
        (
            "[storage]\ndevices = 0",
            "storage.devices = 0: must be at least 1",
        ),
        (
            "[storage]\nmemory = \"1GiB\"\nmetadata_reserve = \"64MiB\"",
            "storage.metadata_reserve = \"64MiB\": a RAM store keeps no metadata on disk",
        ),
        (
            "[storage]\nmetadata_reserve = \"65GiB\"",
            "storage.metadata_reserve = \"65GiB\": must be at most 64GiB",
        ),
        ("[storage]\nmemory = \"4XB\"", "invalid size \"4XB\""),
        (
            "[limits]\nmax_connections = 0",
            "limits.max_connections = 0: must be at least 1",
        ),
        (
            "[limits]\nmax_inflight_requests = 0",
            "limits.max_inflight_requests = 0: must be at least 1",
        ),
        (
            "[limits]\nmax_request_bytes = \"64MiB\"",
            "limits.max_request_bytes = \"64MiB\": must be between 4KiB and 32MiB",
        ),
        (
            "[limits]\nmax_inflight_bytes = \"16MiB\"",
            "limits.max_inflight_bytes = \"16MiB\": must be at least 32MiB, the buffer a request \
             of limits.max_request_bytes (32MiB) occupies, or such a request would wait forever",
        ),
        (
            "[limits]\nmax_request_bytes = \"20MiB\"\nmax_inflight_bytes = \"24MiB\"",
            "limits.max_inflight_bytes = \"24MiB\": must be at least 32MiB, the buffer a request \
             of limits.max_request_bytes (20MiB) occupies, or such a request would wait forever",
        ),
        (
            "[limits]\nmax_inflight_bytes_per_node = \"16MiB\"",
            "limits.max_inflight_bytes_per_node = \"16MiB\": must be at least 32MiB, the buffer a \
             request of limits.max_request_bytes (32MiB) occupies, or such a request would wait \
             forever",
        ),
        (
            "[limits]\nmax_inflight_bytes_per_tenant = \"64MiB\"",
            "limits.max_inflight_bytes = \"128MiB\": must be at most \
             limits.max_inflight_bytes_per_tenant (64MiB)",
        ),
        (
            "[limits]\nmax_inflight_bytes_per_node = \"64MiB\"\nmax_inflight_bytes = \"32MiB\"",
            "limits.max_inflight_bytes_per_tenant = \"256MiB\": must be at most \
             limits.max_inflight_bytes_per_node (64MiB)",
        ),
        (
            "[limits]\nmax_connections = 4\nmax_connections_per_ip = 5",
            "limits.max_connections_per_ip = 5: must be between 1 and limits.max_connections (4)",
        ),
        (
            "[limits]\nipv6_prefix_len = 0",
            "limits.ipv6_prefix_len = 0: must be between 1 and 128",
        ),
        (
            "[limits]\nmax_connections_per_ip = 0",
            "limits.max_connections_per_ip = 0: must be at least 1",
        ),
        (
            "[limits]\nmax_inflight_requests = 70000",
            "limits.max_inflight_requests = 70000: must be between 1 and 65536",
        ),
        (
            "[limits]\nclient_stall_timeout_ms = 0",
            "limits.client_stall_timeout_ms = 0: must be at least 1",
        ),
        (
            "[limits]\nhandshake_timeout_ms = 3600001",
            "limits.handshake_timeout_ms = 3600001: must be between 1 and 3600000",
        ),
        (
            "[limits]\nhandshake_timeout_ms = 0",
            "limits.handshake_timeout_ms = 0: must be at least 1",
        ),
        (
            "[storage.emulated]\nparallelism = 0\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
            "storage.emulated.parallelism = 0: must be between 1 and 1024",
        ),
        (
            "[storage.emulated]\nparallelism = 1\n[storage.emulated.model]\nrbps = 0\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
            "storage.emulated.model.rbps = 0",
        ),
        (
            "[qos.cost]\ndevice = { linear = { rbps = 1, rseqiops = 0, rrandiops = 1, wbps = 1, wseqiops = 1, wrandiops = 1 } }",
            "qos.cost.device.linear.rseqiops = 0: every rate must be greater than 0",
        ),
        (
            "[qos.cost.device.vop]\nread = [[8192, 5], [4096, 6]]\nwrite = [[4096, 1]]",
            "qos.cost.device.vop.read = [4096, 6]: sizes must be greater than 0 and increasing",
        ),
        (
            "[qos.cost.device.vop]\nread = []\nwrite = [[4096, 1]]",
            "qos.cost.device.vop.read = []: needs at least one",
        ),
        ("[qos.cost]\ndevice = \"fast\"", "unknown variant `fast`"),
        (
            "[qos.cost.cpu]\nread = { base_ns = 2000000000, per_kib_ps = 0 }",
            "qos.cost.cpu.read.base_ns = 2000000000: must be at most",
        ),
    ];
    for (text, want) in cases {
        let got = err(text);
        assert!(
            got.contains(want),
            "config {text:?}\n  error: {got}\n  wanted: {want}"
        );
    }
}

#[test]
fn unknown_keys_are_named_with_the_file_and_line() {
    for (text, key, line) in [
        ("[qos]\nwrkers = 2\n", "wrkers", "line 2"),
        ("[server]\nio_threads = 2\n\n[sever]\n", "sever", "line 4"),
        (
            "[storage.emulated]\nparallelism = 1\nparalelism = 2\n",
            "paralelism",
            "line 3",
        ),
        ("[qos.params]\nwindow = 1\n", "window", "line 2"),
        (
            "[qos.cost]\ncpu = { read = { base = 1, per_kib_ps = 2 } }\n",
            "base",
            "line 2",
        ),
    ] {
        let got = err(text);
        assert!(
            got.contains("test.toml") && got.contains(key) && got.contains(line),
            "config {text:?}: {got}"
        );
    }
}

#[test]
fn higher_layers_win_key_by_key() {
    let cli = ConfigFile {
        qos: QosSection {
            policy: Some(PolicyChoice::Off),
            ..QosSection::default()
        },
        ..ConfigFile::default()
    };
    let file = parse(
        "[qos]\npolicy = \"mclock\"\nworkers = 3\n[server]\nio_threads = 1\n[qos.params]\nseed = 9\n",
    )
    .unwrap();
    let calibration = parse(
        "[qos]\nworkers = 7\n[qos.params]\nwindow_ns = 2000000\nseed = 1\n[qos.capacity]\ncpu_ns_per_s = 8000000000\n",
    )
    .unwrap();
    let c = resolve(&cli.over(file).over(calibration)).unwrap();
    assert_eq!(c.qos.policy, PolicyChoice::Off);
    assert_eq!(c.qos.workers, 3);
    assert_eq!(c.io_threads, 1);
    assert_eq!(c.qos.params.seed, 9);
    assert_eq!(c.qos.params.window_ns, 2_000_000);
    assert_eq!(c.qos.capacity.per_second.cpu_ns, 8_000_000_000);
}

#[test]
fn device_capacity_follows_the_layer_that_picks_the_device_model() {
    let calibration = parse(
        "[qos.capacity]\ndevice_units_per_s = 90000000\n[qos.cost.device.vop]\nread = [[4096, 90000]]\nwrite = [[4096, 80000]]\n",
    )
    .unwrap();
    // A file that picks a linear model without a capacity: the VOP capacity is dropped.
    let linear = parse(
        "[qos.cost]\ndevice = { linear = { rbps = 1, rseqiops = 1, rrandiops = 1, wbps = 1, wseqiops = 1, wrandiops = 1 } }\n",
    )
    .unwrap();
    let c = resolve(&linear.over(calibration.clone())).unwrap();
    assert!(matches!(c.qos.cost_model.device, DeviceModel::Linear(_)));
    assert_eq!(c.qos.capacity.per_second.device_units, u64::MAX);
    // A file that only sets other keys keeps the calibrated pair.
    let other = parse("[qos]\nworkers = 2\n").unwrap();
    let c = resolve(&other.over(calibration)).unwrap();
    assert!(matches!(c.qos.cost_model.device, DeviceModel::Vop(_)));
    assert_eq!(c.qos.capacity.per_second.device_units, 90_000_000);
}

#[test]
fn calibration_in_the_data_dir_is_loaded_under_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join(CALIBRATION_FILE),
        "[qos]\npolicy = \"mclock\"\nworkers = 3\n",
    )
    .unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        "[qos]\nworkers = 4\n[storage]\nmemory = \"1GiB\"\n",
    )
    .unwrap();
    let cli = ConfigFile {
        storage: StorageSection {
            data_dir: Some(dir.path().to_path_buf()),
            ..StorageSection::default()
        },
        ..ConfigFile::default()
    };
    let loaded = load(cli.clone(), Some(&config)).unwrap();
    assert_eq!(
        loaded.calibration_file,
        Some(dir.path().join(CALIBRATION_FILE))
    );
    assert_eq!(
        loaded.node.qos.policy,
        PolicyChoice::Policy(PolicyKind::MClock)
    );
    assert_eq!(loaded.node.qos.workers, 4);
    // Without one: the defaults.
    let empty = tempfile::tempdir().unwrap();
    let cli = ConfigFile {
        storage: StorageSection {
            data_dir: Some(empty.path().to_path_buf()),
            memory: Some(Size(1 << 30)),
            ..StorageSection::default()
        },
        ..ConfigFile::default()
    };
    let loaded = load(cli, None).unwrap();
    assert_eq!(loaded.calibration_file, None);
    assert_eq!(loaded.node.qos, QosConfig::default());
    // Errors in the calibration file name it.
    std::fs::write(dir.path().join(CALIBRATION_FILE), "[qos]\nworkers = 0\n").unwrap();
    let got = format!(
        "{:#}",
        load(
            ConfigFile::default().over(ConfigFile {
                storage: StorageSection {
                    data_dir: Some(dir.path().to_path_buf()),
                    ..StorageSection::default()
                },
                ..ConfigFile::default()
            }),
            None
        )
        .unwrap_err()
    );
    assert!(
        got.contains(CALIBRATION_FILE) && got.contains("qos.workers = 0"),
        "{got}"
    );
}

#[test]
fn device_admission_keys_are_checked_and_reach_the_node() {
    let path = Path::new("node.toml");
    for (bad, key) in [
        ("device_dirs = [\"relative/dir\"]\n", "storage.device_dirs"),
        ("block_devices = [\"sdb\"]\n", "storage.block_devices"),
        ("max_device_bytes = \"1MiB\"\n", "storage.max_device_bytes"),
        ("max_volume_bytes = \"65TiB\"\n", "storage.max_volume_bytes"),
        ("max_volume_bytes = 0\n", "storage.max_volume_bytes"),
    ] {
        let err = ConfigFile::parse(&format!("[storage]\n{bad}"), path)
            .and_then(|layer| resolve(&layer).map(|_| ()).map_err(Into::into))
            .map(|_| String::new())
            .unwrap_or_else(|e| format!("{e:#}"));
        assert!(err.contains(key), "{bad}: {err:?}");
    }
    let layer = ConfigFile::parse(
        "[storage]\ndevice_dirs = [\"/srv/d\"]\nblock_devices = [\"/dev/loop9\"]\n\
         max_device_bytes = \"1TiB\"\nmax_volume_bytes = \"2TiB\"\n",
        path,
    )
    .unwrap();
    let policy = resolve(&layer).unwrap().device_admission;
    assert_eq!(policy.device_dirs, vec![PathBuf::from("/srv/d")]);
    assert_eq!(policy.block_devices, vec![PathBuf::from("/dev/loop9")]);
    assert_eq!(
        (policy.max_device_bytes, policy.max_volume_bytes),
        (1 << 40, 2 << 40)
    );
    let defaults = resolve(&ConfigFile::default()).unwrap().device_admission;
    assert_eq!(defaults, headroom_store::AdmissionPolicy::default());
}

#[test]
fn the_overcommit_ratio_is_at_least_one_and_reaches_the_node() {
    let path = Path::new("node.toml");
    for bad in ["0.5", "-1.0", "nan", "inf"] {
        let err = format!(
            "{:#}",
            ConfigFile::parse(&format!("[storage]\novercommit_ratio = {bad}\n"), path).unwrap_err()
        );
        assert!(err.contains("storage.overcommit_ratio"), "{bad}: {err}");
    }
    let layer =
        ConfigFile::parse("[storage]\nmemory = \"1GiB\"\novercommit_ratio = 3\n", path).unwrap();
    assert_eq!(resolve(&layer).unwrap().overcommit_ratio, Some(3.0));
    let none = ConfigFile::parse("[storage]\nmemory = \"1GiB\"\n", path).unwrap();
    assert_eq!(resolve(&none).unwrap().overcommit_ratio, None);
}

#[test]
fn the_api_token_is_checked_merged_and_never_shown() {
    let path = Path::new("node.toml");
    let err = format!(
        "{:#}",
        ConfigFile::parse("[api]\ntoken = \"short\"\n", path).unwrap_err()
    );
    assert!(err.contains("api.token") && !err.contains("short"), "{err}");
    let file = ConfigFile::parse("[api]\ntoken = \"0123456789abcdef0123\"\n", path).unwrap();
    let merged = ConfigFile::default().over(file);
    assert_eq!(merged.api.token.as_deref(), Some("0123456789abcdef0123"));
    assert!(!format!("{merged:?}").contains("0123456789abcdef0123"));
}

#[test]
fn the_documented_example_parses_and_shows_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let section = doc
        .split("## Configuration file")
        .nth(1)
        .expect("a Configuration file section");
    let block = section
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a toml block");
    let config = ConfigFile::parse(block, &path).unwrap();
    let config = if headroom_node::TLS_SUPPORTED {
        config
    } else {
        // A build without TLS refuses the example's [tls] section by name; the rest of
        // the example must still hold.
        let err = resolve(&config).expect_err("[tls] without the tls feature");
        assert_eq!(err.key, "tls", "{err:?}");
        ConfigFile {
            tls: TlsSection::default(),
            ..config
        }
    };
    let c = resolve(&config).unwrap();
    // The values it shows as defaults are the defaults (a release build's: a debug build
    // tracks the invariants unless told not to, and the example says `false`).
    assert_eq!(
        c.qos.params,
        PolicyParams {
            track_invariants: false,
            ..QosConfig::server_params()
        }
    );
    assert_eq!(c.qos.workers, QosConfig::default().workers);
    assert_eq!(c.qos.capacity.per_second.cpu_ns, 2 * NS_PER_S);
    let l = Limits::default();
    assert_eq!(c.limits.max_connections, l.max_connections);
    assert_eq!(
        c.limits.max_inflight_requests_per_conn,
        l.max_inflight_requests_per_conn
    );
    assert_eq!(
        c.limits.max_inflight_bytes_per_conn,
        l.max_inflight_bytes_per_conn
    );
    assert_eq!(c.limits.max_request_bytes, l.max_request_bytes);
    assert_eq!(c.limits.handshake_timeout_ms, l.handshake_timeout_ms);
    assert_eq!(c.limits.max_connections_per_ip, l.max_connections_per_ip);
    assert_eq!(
        c.limits.max_inflight_bytes_per_tenant,
        l.max_inflight_bytes_per_tenant
    );
    assert_eq!(
        c.limits.max_inflight_bytes_per_node,
        l.max_inflight_bytes_per_node
    );
    assert_eq!(c.limits.client_stall_timeout_ms, l.client_stall_timeout_ms);
    assert_eq!(c.credit_save_period_ms, 1_000);
    assert_eq!(c.io_threads, 2);
}

#[test]
fn the_interference_example_parses_and_validates() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/interference-node.toml");
    let layer = ConfigFile::load(&path).unwrap();
    let c = resolve(&layer).unwrap();
    assert!(
        warnings(&layer, &c).is_empty(),
        "{:?}",
        warnings(&layer, &c)
    );
    assert_eq!(c.qos.policy, PolicyChoice::Policy(PolicyKind::Burst));
    assert!(
        matches!(c.backend, StoreBackend::Memory { capacity_bytes } if capacity_bytes == 4 << 30)
    );
    let spec = c.emulated_device.expect("an emulated device");
    // The scheduler knows the device exactly: same model, one device of 10⁹ device-ns/s.
    assert_eq!(c.qos.cost_model.device, DeviceModel::Linear(spec.model));
    assert_eq!(c.qos.capacity.per_second.device_units, NS_PER_S);
    // Well below what this machine does unthrottled (~40–80k 4 KiB IOPS).
    let r4 = spec.cost_ns(headroom_qos::OpKind::Read, 4096, false);
    assert_eq!(NS_PER_S / r4, 20_000);
}

#[test]
fn tls_keys_reach_the_node_config_or_ask_for_the_feature() {
    let text = "[tls]\npsk_file = \"keys.psk\"\ncert_dir = \"pki\"\nrequired = true\n";
    let result = resolve(&parse(text).unwrap());
    if headroom_node::TLS_SUPPORTED {
        let tls = result.unwrap().tls.unwrap();
        assert_eq!(tls.psk_file, Some(PathBuf::from("keys.psk")));
        assert_eq!(tls.cert_dir, Some(PathBuf::from("pki")));
        assert!(tls.required);
        assert!(!tls.legacy_cipher_suites);
        assert_eq!(tls.handshakes_per_s_per_address, 100);
        assert_eq!(tls.certificate_tenants, None);
        assert!(err("[tls]\nrequired = true\n").contains("needs tls.psk_file"));
        let mapped = resolved(
            "[tls]\ncert_dir = \"pki\"\nlegacy_cipher_suites = true\n\
             handshakes_per_s_per_address = 0\n\
             [tls.certificate_tenants]\n\"host-1.example\" = \"alice\"\n",
        )
        .tls
        .unwrap();
        assert!(mapped.legacy_cipher_suites);
        assert_eq!(mapped.handshakes_per_s_per_address, 0);
        assert_eq!(
            mapped.certificate_tenants,
            Some([("host-1.example".to_string(), "alice".to_string())].into())
        );
        for (bad, says) in [
            (
                "[tls]\nlegacy_cipher_suites = true\n",
                "tls.legacy_cipher_suites",
            ),
            (
                "[tls.certificate_tenants]\n\"h\" = \"alice\"\n",
                "tls.certificate_tenants",
            ),
            (
                "[tls]\ncert_dir = \"pki\"\n[tls.certificate_tenants]\n\"h\" = \" alice\"\n",
                "a tenant id for CN \"h\"",
            ),
            (
                "[tls]\ncert_dir = \"pki\"\n[tls.certificate_tenants]\n\"\" = \"alice\"\n",
                "a certificate common name of 1 to 1024 bytes",
            ),
        ] {
            let text = err(bad);
            assert!(text.contains(says), "{bad}: {text}");
        }
    } else {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("built without TLS; rebuild with --features tls"),
            "{err}"
        );
    }
    assert_eq!(resolved("[tls]\nrequired = false\n").tls, None);
    assert_eq!(resolved("").tls, None);
}

#[test]
fn rados_keys_select_the_backend_or_ask_for_the_feature() {
    let text = "[storage]\ndata_dir = \"/srv/h\"\nrados_conf = \"/etc/ceph/ceph.conf\"\n\
                rados_pool = \"volumes\"\ndevice_size = \"1TiB\"\n";
    let result = resolve(&parse(text).unwrap());
    if headroom_store::RADOS_SUPPORTED {
        let config = result.unwrap();
        assert!(
            matches!(&config.backend, StoreBackend::Rados { data_dir, conf, id, pool, capacity_bytes, .. }
                if data_dir == Path::new("/srv/h")
                    && conf == Path::new("/etc/ceph/ceph.conf")
                    && id == "admin"
                    && pool == "volumes"
                    && *capacity_bytes == 1 << 40),
            "{:?}",
            config.backend
        );
        for (extra, key) in [
            ("memory = \"1GiB\"\n", "storage.memory"),
            ("devices = 2\n", "storage.devices"),
            ("device_paths = [\"/dev/sdb\"]\n", "storage.device_paths"),
        ] {
            let e = err(&format!("{text}{extra}"));
            assert!(e.contains(&format!("leave out {key}")), "{e}");
        }
    } else {
        let e = result.unwrap_err().to_string();
        assert!(
            e.contains("built without the RADOS backend; rebuild with --features rados"),
            "{e}"
        );
    }
    let e = err("[storage]\nrados_pool = \"p\"\n");
    assert!(
        e.contains("storage.rados_pool") && e.contains("needs storage.rados_conf"),
        "{e}"
    );
    let e = err("[storage]\nrados_conf = \"c\"\n");
    assert!(
        e.contains("storage.rados_conf") && e.contains("needs storage.rados_pool"),
        "{e}"
    );
    assert!(err("[storage]\nrados_pool = \"a/b\"\n").contains("must be a pool name"));
    let e = err(&format!("{text}rados_lease_lost_linger_ms = 600001\n"));
    assert!(
        e.contains("storage.rados_lease_lost_linger_ms") && e.contains("at most 600000"),
        "{e}"
    );
    let e = err("[storage]\nrados_lease_lost_linger_ms = 1\n");
    assert!(e.contains("needs storage.rados_pool"), "{e}");
    let e = err("[storage]\nrados_id = \"headroom\"\n");
    assert!(
        e.contains("storage.rados_id") && e.contains("needs storage.rados_pool"),
        "{e}"
    );
    for (bad, why) in [
        ("", "must not be empty"),
        ("client.headroom", "without the `client.` prefix"),
        ("a b", "only ASCII letters"),
    ] {
        let e = err(&format!("{text}rados_id = {bad:?}\n"));
        assert!(e.contains("storage.rados_id") && e.contains(why), "{e}");
    }
    if headroom_store::RADOS_SUPPORTED {
        let config = resolve(&parse(&format!("{text}rados_id = \"headroom\"\n")).unwrap()).unwrap();
        assert!(
            matches!(&config.backend, StoreBackend::Rados { id, .. } if id == "headroom"),
            "{:?}",
            config.backend
        );
    }
}

fn faults(text: &str) -> Result<Option<FaultConfig>, String> {
    let layer = parse(text).map_err(|e| format!("{e:#}"))?;
    faults_config(&layer).map_err(|e| e.to_string())
}

#[test]
fn latency_spikes_turn_inline_execution_off_unless_it_was_chosen() {
    let spikes = "[storage]\nmemory = \"1GiB\"\n[[faults.rule]]\nvolume = \"v\"\n\
                  latency_spike_permille = 5\nlatency_spike_ms = 20\n";
    assert_eq!(resolved(spikes).inline_max_bytes, Some(0));
    let chosen = format!("{spikes}[server]\ninline_max_bytes = \"16KiB\"\n");
    assert_eq!(resolved(&chosen).inline_max_bytes, Some(16 << 10));
    // Errors only: the backend's own default stays.
    let errors = "[storage]\nmemory = \"1GiB\"\n[[faults.rule]]\nvolume = \"v\"\n\
                  eio_read_permille = 5\n";
    assert_eq!(resolved(errors).inline_max_bytes, None);
}

#[test]
fn faults_reach_the_store_config_and_bad_rules_name_the_key() {
    assert_eq!(faults("").unwrap(), None);
    assert_eq!(faults("[faults]\nseed = 3\n").unwrap(), None);
    let config = faults(
        "[faults]\nseed = 7\n\
         [[faults.rule]]\nvolume = \"v1\"\neio_read_permille = 10\noffset_bytes = \"1MiB\"\n\
         length_bytes = \"4KiB\"\nlatency_spike_permille = 5\nlatency_spike_ms = 20\n\
         [[faults.rule]]\ndevice = 1\neio_sync_permille = 1000\nenospc_after_bytes = \"64MiB\"\n\
         disappear_after_ops = 100\ndisappear_after_ms = 2000\neio_write_permille = 1\n\
         enospc_write_permille = 2\n",
    )
    .unwrap()
    .unwrap();
    assert_eq!(config.seed, 7);
    let mut first = FaultRule::new(FaultScope::Volume("v1".into()));
    first.eio_read_permille = 10;
    first.offset_bytes = 1 << 20;
    first.length_bytes = Some(4096);
    first.latency_spike_permille = 5;
    first.latency_spike_ms = 20;
    let mut second = FaultRule::new(FaultScope::Device(1));
    second.eio_sync_permille = 1000;
    second.eio_write_permille = 1;
    second.enospc_write_permille = 2;
    second.enospc_after_bytes = Some(64 << 20);
    second.disappear_after_ops = Some(100);
    second.disappear_after_ms = Some(2000);
    assert_eq!(config.rules, vec![first, second]);

    let err = |text: &str| faults(text).unwrap_err();
    assert!(
        err("[[faults.rule]]\nvolume = \"v\"\neio_read_permille = 1001\n")
            .contains("faults.rule[0].eio_read_permille = 1001: must be at most 1000")
    );
    assert!(
        err("[[faults.rule]]\nvolume = \"v\"\ndevice = 0\neio_read_permille = 1\n")
            .contains("faults.rule[0]: needs exactly one of volume")
    );
    assert!(err("[[faults.rule]]\neio_read_permille = 1\n").contains("exactly one"));
    assert!(err("[[faults.rule]]\nvolume = \"v\"\n").contains("does nothing"));
    assert!(err("[[faults.rule]]\nvolume = \"v\"\neio_reads = 1\n").contains("unknown field"));
    assert!(
        err("[[faults.rule]]\ndevice = 0\nlatency_spike_permille = 1\n")
            .contains("faults.rule[0].latency_spike_ms = 0")
    );
    // The section is taken whole from the highest layer that has one.
    let upper = parse("[[faults.rule]]\ndevice = 0\neio_read_permille = 1\n").unwrap();
    let lower =
        parse("[faults]\nseed = 9\n[[faults.rule]]\ndevice = 1\neio_read_permille = 2\n").unwrap();
    let merged = faults_config(&upper.over(lower.clone())).unwrap().unwrap();
    assert_eq!((merged.seed, merged.rules.len()), (0, 1));
    assert_eq!(merged.rules[0].scope, FaultScope::Device(0));
    let merged = faults_config(&ConfigFile::default().over(lower))
        .unwrap()
        .unwrap();
    assert_eq!(merged.seed, 9);
}

#[test]
fn the_documented_metrics_example_gives_the_defaults_and_bounds_are_checked() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let block = doc
        .split("## Metrics")
        .nth(1)
        .and_then(|section| section.split("```toml\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("a toml block under \"## Metrics\"");
    let c = resolve(&ConfigFile::parse(block, &path).unwrap()).unwrap();
    assert_eq!(c.metrics, MetricsConfig::default());
    let c = resolved("[metrics]\nvolume_series_idle_s = 60\nmax_volume_series = 5\n");
    assert_eq!(c.metrics.volume_series_idle_s, 60);
    assert_eq!(c.metrics.max_volume_series, 5);
    let e = err("[metrics]\nmax_volume_series = 1000000\n");
    assert!(e.contains("metrics.max_volume_series = 1000000"), "{e}");
    let e = err("[metrics]\nseries = 1\n");
    assert!(e.contains("series"), "{e}");
}

#[test]
fn the_documented_faults_example_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let block = doc
        .split("## Fault injection")
        .nth(1)
        .and_then(|section| section.split("```toml\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("a toml block under \"## Fault injection\"");
    let layer = ConfigFile::parse(block, &path).unwrap();
    let config = faults_config(&layer).unwrap().expect("rules");
    assert!(config.rules.len() >= 2, "{config:?}");
    resolve(&layer).unwrap();
}

/// The command line's layer as `serve` parses it (the sections' clap arguments).
fn flags(args: &[&str]) -> ConfigFile {
    let command = <ConfigFile as clap::Args>::augment_args(clap::Command::new("serve"));
    let matches = command
        .try_get_matches_from(std::iter::once("serve").chain(args.iter().copied()))
        .unwrap();
    <ConfigFile as clap::FromArgMatches>::from_arg_matches(&matches).unwrap()
}

#[test]
fn no_flag_sets_nothing() {
    // The switches (`--tls-required`, ...) are `Option<bool>`: absent must be unset, not
    // false, or the command line would override a file's `true`.
    assert_eq!(flags(&[]), ConfigFile::default());
}

#[test]
fn a_flag_and_its_file_key_fill_the_same_layer() {
    let cli = flags(&[
        "--nbd-listen",
        "127.0.0.1:1",
        "--io-threads",
        "4",
        "--inline-max-bytes",
        "8KiB",
        "--memory",
        "1GiB",
        "--device",
        "/a",
        "--device",
        "/b",
        "--rados-arbitration",
        "--rados-capacity-bytes-per-s",
        "400MiB",
        "--max-inflight-requests",
        "8",
        "--policy",
        "off",
        "--tls-required",
        "--tls-legacy-ciphers",
        "--tls-cert-tenant",
        "a=b=c",
        "--tls-cert-tenant",
        "host-1=alice",
    ]);
    let file: ConfigFile = toml::from_str(
        "[server]\nnbd_listen = \"127.0.0.1:1\"\nio_threads = 4\ninline_max_bytes = \"8KiB\"\n\
         [storage]\nmemory = \"1GiB\"\ndevice_paths = [\"/a\", \"/b\"]\n\
         rados_arbitration = true\nrados_capacity_bytes_per_s = \"400MiB\"\n\
         [limits]\nmax_inflight_requests = 8\n[qos]\npolicy = \"off\"\n\
         [tls]\nrequired = true\nlegacy_cipher_suites = true\n\
         [tls.certificate_tenants]\na = \"b=c\"\nhost-1 = \"alice\"\n",
    )
    .unwrap();
    assert_eq!(cli, file);
}

#[test]
fn the_command_line_is_the_top_layer_key_by_key() {
    let file =
        parse("[server]\nio_threads = 3\ncoalesce_us = 7\n[tls]\nrequired = true\n").unwrap();
    let merged = flags(&["--io-threads", "5"]).over(file);
    assert_eq!(merged.server.io_threads, Some(5));
    assert_eq!(merged.server.coalesce_us, Some(7), "kept from the file");
    assert_eq!(
        merged.tls.required,
        Some(true),
        "an absent switch keeps the file's"
    );
}

#[test]
fn the_unix_socket_beside_tcp_or_instead_of_it() {
    // The default is unchanged: TCP only.
    let c = resolved("");
    assert_eq!(c.nbd_listen, NodeConfig::default_nbd_listen());
    assert_eq!(c.nbd_unix, None);
    // Beside TCP, with its mode, owner and uid map.
    let c = resolved(
        "[server]\nnbd_unix = \"/run/headroom/nbd.sock\"\nnbd_unix_mode = \"0660\"\n\
         nbd_unix_owner = \"0:64055\"\n[server.nbd_unix_tenants]\n64055 = \"alice\"\n1000 = \"bob\"\n",
    );
    assert!(c.nbd_listen.is_some(), "TCP stays on");
    let unix = c.nbd_unix.expect("a Unix socket");
    assert_eq!(unix.path, Path::new("/run/headroom/nbd.sock"));
    assert_eq!(unix.mode, Some(0o660));
    assert_eq!((unix.uid, unix.gid), (Some(0), Some(64055)));
    assert_eq!(unix.tenants.get(&64055).map(String::as_str), Some("alice"));
    assert_eq!(unix.tenants.get(&1000).map(String::as_str), Some("bob"));
    // A TOML octal integer is a mode too; a group alone is an owner.
    let c =
        resolved("[server]\nnbd_unix = \"s\"\nnbd_unix_mode = 0o600\nnbd_unix_owner = \":5\"\n");
    let unix = c.nbd_unix.unwrap();
    assert_eq!(
        (unix.mode, unix.uid, unix.gid),
        (Some(0o600), None, Some(5))
    );
    // Instead of TCP.
    let c = resolved("[server]\nnbd_listen = \"off\"\nnbd_unix = \"/run/nbd.sock\"\n");
    assert_eq!(c.nbd_listen, None);
    assert!(c.nbd_unix.is_some());
}

#[test]
fn the_unix_socket_keys_are_checked_before_anything_starts() {
    for (text, key) in [
        ("[server]\nnbd_listen = \"off\"\n", "server.nbd_listen"),
        ("[server]\nnbd_listen = \"of\"\n", "neither an address"),
        (
            "[server]\nnbd_unix_mode = \"0660\"\n",
            "server.nbd_unix_mode",
        ),
        (
            "[server]\nnbd_unix_owner = \"1\"\n",
            "server.nbd_unix_owner",
        ),
        (
            "[server.nbd_unix_tenants]\n1 = \"a\"\n",
            "server.nbd_unix_tenants",
        ),
        (
            "[server]\nnbd_unix = \"s\"\nnbd_unix_mode = \"0968\"\n",
            "not an octal mode",
        ),
        (
            "[server]\nnbd_unix = \"s\"\nnbd_unix_mode = 660\n",
            "server.nbd_unix_mode",
        ),
        (
            "[server]\nnbd_unix = \"s\"\nnbd_unix_mode = \"4755\"\n",
            "0 to 0777",
        ),
        (
            "[server]\nnbd_unix = \"s\"\nnbd_unix_owner = \"qemu\"\n",
            "not UID, UID:GID or :GID",
        ),
        (
            "[server]\nnbd_unix = \"s\"\nnbd_unix_owner = \":\"\n",
            "not UID, UID:GID or :GID",
        ),
        (
            "[server]\nnbd_unix = \"s\"\n[server.nbd_unix_tenants]\nqemu = \"a\"\n",
            "numeric uid",
        ),
        (
            "[server]\nnbd_unix = \"s\"\n[server.nbd_unix_tenants]\n1 = \" a\"\n",
            "server.nbd_unix_tenants",
        ),
        ("[server]\nnbd_unix = \"\"\n", "server.nbd_unix"),
    ] {
        let message = err(text);
        assert!(message.contains(key), "{text}: {message}");
    }
    let long = format!("[server]\nnbd_unix = \"/{}\"\n", "x".repeat(120));
    assert!(err(&long).contains("sun_path"), "{}", err(&long));
}

#[test]
fn the_unix_socket_flags_set_the_same_keys() {
    let cli = flags(&[
        "--nbd-listen",
        "off",
        "--nbd-unix",
        "/run/nbd.sock",
        "--nbd-unix-mode",
        "0660",
        "--nbd-unix-owner",
        "0:64055",
        "--nbd-unix-tenant",
        "64055=alice",
        "--nbd-unix-tenant",
        "1000=bob",
    ]);
    let file: ConfigFile = toml::from_str(
        "[server]\nnbd_listen = \"off\"\nnbd_unix = \"/run/nbd.sock\"\nnbd_unix_mode = \"0660\"\n\
         nbd_unix_owner = \"0:64055\"\n[server.nbd_unix_tenants]\n1000 = \"bob\"\n64055 = \"alice\"\n",
    )
    .unwrap();
    let unix = |layer: &ConfigFile| resolve(layer).unwrap().nbd_unix;
    assert_eq!(unix(&cli), unix(&file));
    assert!(unix(&cli).is_some());
}
