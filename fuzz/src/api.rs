//! What the `api_bodies` fuzz target checks: the management API's request bodies.
//!
//! Why a file of its own: the fuzz target (through the `headroom_fuzz` library) and the corpus
//! replay test `crates/node/tests/fuzz_corpus.rs` (through `#[path]`) include this same file,
//! so CI checks every committed corpus input exactly as the fuzzer did.
//!
//! Every input goes through each body the API reads, the way the handlers in
//! `crates/node/src/api.rs` read it: axum's own `Json` extractor decoding (`Json::from_bytes`,
//! what `Json<T>` runs on a request body) for `POST /v1/volumes` ([`CreateVolume`]) and
//! `PATCH /v1/volumes/{name}` ([`UpdateVolume`]), axum's `Query` for `GET /v1/volumes?…`
//! ([`ListQuery`]); then what the handlers do with a body before touching the store: name and
//! tenant validation, and resolving the QoS (`StoredQos::resolve`, merged over an existing
//! class for a PATCH, re-derived on a resize), the stored record, the view `GET` shows, and
//! the live change a PATCH makes to a volume's credit buckets.
//!
//! Checked: nothing panics; a refused body is the client's fault (a 4xx, never a 5xx); a
//! decoded body re-encodes to JSON that decodes to the same body; an accepted name or tenant
//! obeys the documented rules; a resolved QoS is valid, can run I/O (no ceiling of 0), honours
//! the fields given, reads back
//! identical from its stored JSON record (so it survives a restart), and a change that gives
//! nothing changes nothing.

use axum::Json;
use axum::extract::Query;
use axum::http::Uri;
use axum::response::IntoResponse;
use headroom_node::api::{CreateVolume, ListQuery, UpdateVolume};
use headroom_node::volume_qos::{QosView, StoredQos};
use headroom_qos::limiter::VolumeCredits;
use headroom_qos::{
    BurstKind, BurstMode, CostVector, Decision, IoRequest, NodeCapacity, Observed, OpKind,
    PolicyKind, PolicyParams, Preset, QosSpec, VolumeQos, build_policy,
};
use headroom_store::{
    MAX_TENANT_ID_LEN, MAX_VOLUME_NAME_LEN, validate_tenant_id, validate_volume_name,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

const GIB: u64 = 1 << 30;

/// Bytes per second in one MB/s, as `QosSpec` counts.
const BYTES_PER_MB: u64 = 1_000_000;

/// Target `api_bodies`: the same bytes as each request body and as a query string.
pub fn check_api_bodies(data: &[u8]) {
    if let Some(body) = decode::<CreateVolume>(data) {
        check_create(&body);
    }
    if let Some(body) = decode::<UpdateVolume>(data) {
        check_update(&body);
    }
    check_list_query(data);
}

/// Decodes `data` as axum's `Json<T>` extractor does; a refusal must be a client error.
fn decode<T: DeserializeOwned + Serialize>(data: &[u8]) -> Option<T> {
    match Json::<T>::from_bytes(data) {
        Ok(Json(body)) => {
            // Round trip: what the CLI would send for this body decodes to the same body.
            let Ok(encoded) = serde_json::to_vec(&body) else {
                panic!("a decoded body does not encode");
            };
            let Ok(Json(again)) = Json::<T>::from_bytes(&encoded) else {
                panic!(
                    "re-encoded body {:?} does not decode",
                    String::from_utf8_lossy(&encoded)
                );
            };
            assert_eq!(
                serde_json::to_value(&body).ok(),
                serde_json::to_value(&again).ok(),
                "JSON round trip changed the body"
            );
            Some(body)
        }
        Err(rejection) => {
            let status = rejection.status();
            assert!(status.is_client_error(), "a bad body got {status}");
            assert!(!rejection.body_text().is_empty());
            let _ = rejection.into_response();
            None
        }
    }
}

fn check_name(name: &str) {
    if validate_volume_name(name).is_ok() {
        assert!(!name.is_empty() && name.len() <= MAX_VOLUME_NAME_LEN);
        assert!(!name.starts_with(['.', '-']));
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        );
    }
}

fn check_tenant(tenant: &str) {
    if validate_tenant_id(tenant).is_ok() {
        assert!(!tenant.is_empty() && tenant.len() <= MAX_TENANT_ID_LEN);
        assert!(tenant.bytes().all(|b| (b' '..=b'~').contains(&b)));
        assert!(!tenant.starts_with(' ') && !tenant.ends_with(' '));
    }
}

/// `POST /v1/volumes`: name, tenant, and the QoS class resolved for the size.
fn check_create(body: &CreateVolume) {
    check_name(&body.name);
    if let Some(tenant) = &body.tenant {
        check_tenant(tenant);
    }
    if let Some(spec) = &body.qos
        && !spec.is_empty()
        && let Some(stored) = check_resolve(spec, body.size_bytes)
    {
        check_policies(&stored.qos, None);
    }
}

/// Existing classes a PATCH is applied to (besides none).
fn existing_classes() -> [QosSpec; 3] {
    [
        QosSpec {
            preset: Some("gp2".into()),
            ..QosSpec::default()
        },
        QosSpec {
            baseline_iops: Some(1_000),
            ceiling_iops: Some(5_000),
            burst: Some(BurstKind::Credits),
            ..QosSpec::default()
        },
        QosSpec {
            baseline_mbps: Some(100),
            ceiling_mbps: Some(200),
            burst: Some(BurstKind::OnDemand),
            weight: Some(5),
            ..QosSpec::default()
        },
    ]
}

/// `PATCH /v1/volumes/{name}`, on a 1 GiB volume without a class and with each of
/// [`existing_classes`]: the same decisions as the handler.
fn check_update(body: &UpdateVolume) {
    let current_size = GIB;
    let size_bytes = body.size_bytes.unwrap_or(current_size);
    if let Some(change) = &body.qos {
        // Applied to a volume without a class.
        check_resolve(change, size_bytes);
    }
    for base in existing_classes() {
        let Ok(old) = StoredQos::resolve(base.clone(), current_size) else {
            panic!("existing class {base:?} does not resolve");
        };
        let new = match &body.qos {
            Some(change) => {
                let merged = change.merged_over(&old.spec);
                if change.is_empty() {
                    assert_eq!(merged, old.spec, "an empty change changed the class");
                }
                check_resolve(&merged, size_bytes)
            }
            None if size_bytes != current_size => check_resolve(&old.spec, size_bytes),
            None => None,
        };
        if let Some(new) = new {
            // The live change of the volume's credit buckets (what the scheduler's policies
            // do on `update_qos`).
            let mut credits = VolumeCredits::new(0, &old.qos);
            credits.reconfigure(1_000_000_000, &new.qos);
            assert_eq!(
                credits.is_active(),
                matches!(new.qos.burst, BurstMode::Credits(_)),
                "credit buckets after a change"
            );
            check_policies(&old.qos, Some(&new.qos));
        }
    }
}

/// Resolves `spec` for a volume of `size_bytes` as the handlers do, and checks the result.
fn check_resolve(spec: &QosSpec, size_bytes: u64) -> Option<StoredQos> {
    assert_eq!(
        &spec.merged_over(spec),
        spec,
        "a class merged over itself changed"
    );
    assert_eq!(
        &QosSpec::default().merged_over(spec),
        spec,
        "an empty change changed the class"
    );
    if let Some(preset) = &spec.preset
        && let Ok(parsed) = Preset::parse(preset)
    {
        // The preset's canonical spelling names the same class.
        let canonical = parsed.to_string();
        let Ok(again) = Preset::parse(&canonical) else {
            panic!("preset {preset:?} prints as {canonical:?}, which does not parse");
        };
        assert_eq!(again, parsed, "preset {preset:?} prints as {canonical:?}");
    }
    let stored = match StoredQos::resolve(spec.clone(), size_bytes) {
        Ok(stored) => stored,
        Err(err) => {
            assert!(!err.to_string().is_empty());
            return None;
        }
    };
    assert_ne!(size_bytes, 0, "a QoS resolved for an empty volume");
    let q = &stored.qos;
    assert!(q.validate().is_ok(), "resolved to an invalid QoS {q:?}");
    assert!(q.baseline.le(&q.ceiling), "baseline above ceiling");
    // A ceiling of 0 in either dimension is a volume that never runs an I/O.
    assert!(
        q.ceiling.iops > 0 && q.ceiling.bytes_per_s > 0,
        "{spec:?} resolved to a volume that can never run an I/O: {q:?}"
    );
    if let Some(w) = spec.weight {
        assert_eq!(q.weight, w, "weight not honoured");
    }
    let given = [
        (
            spec.baseline_iops,
            spec.ceiling_iops,
            q.baseline.iops,
            q.ceiling.iops,
            1,
        ),
        (
            spec.baseline_mbps,
            spec.ceiling_mbps,
            q.baseline.bytes_per_s,
            q.ceiling.bytes_per_s,
            BYTES_PER_MB,
        ),
    ];
    for (baseline, ceiling, got_baseline, got_ceiling, unit) in given {
        if let Some(b) = baseline {
            assert_eq!(got_baseline, b * unit, "baseline not honoured in {spec:?}");
        }
        if let Some(c) = ceiling {
            assert!(got_ceiling <= c * unit, "ceiling exceeded in {spec:?}");
        }
    }
    match spec.burst {
        Some(BurstKind::None) => {
            assert_eq!(q.burst, BurstMode::None);
            assert_eq!(
                q.baseline, q.ceiling,
                "no burst but a ceiling above the baseline"
            );
        }
        Some(BurstKind::OnDemand) => assert_eq!(q.burst, BurstMode::OnDemand),
        Some(BurstKind::Credits) => assert!(matches!(q.burst, BurstMode::Credits(_))),
        None => {}
    }
    // The record kept in the store reads back identical (else a restart would serve the
    // volume unlimited).
    let record = stored.to_json();
    assert_eq!(
        StoredQos::from_json(&record).as_ref(),
        Some(&stored),
        "stored QoS record {record} does not read back"
    );
    // What `GET /v1/volumes/{name}` shows.
    let view = QosView::new(stored.spec.clone(), q);
    assert!(serde_json::to_vec(&view).is_ok());
    // The QoS each worker gets when a volume's class is split across two workers.
    assert!(
        q.scaled(1, 2).validate().is_ok(),
        "half of {q:?} is invalid"
    );
    Some(stored)
}

/// What the scheduler does with a volume's QoS, in every policy: registers the volume, runs
/// one 4 KiB read through it, and (for a PATCH) changes the QoS live; the policy's invariants
/// hold after each step.
fn check_policies(qos: &VolumeQos, change: Option<&VolumeQos>) {
    const ID: u32 = 1;
    let read = IoRequest {
        id: 1,
        volume: ID,
        op: OpKind::Read,
        offset_bytes: 0,
        len_bytes: 4096,
        cost: CostVector::new(10_000, 0, 4096, 1),
        arrival_ns: 0,
    };
    for kind in PolicyKind::ALL {
        let mut policy = build_policy(kind, NodeCapacity::UNLIMITED, &PolicyParams::default());
        policy.add_volume(0, ID, qos);
        policy.enqueue(0, read.clone());
        let mut now = 0;
        for _ in 0..2 {
            match policy.next(now) {
                Decision::Dispatch(req, _) => {
                    now = now.saturating_add(1_000);
                    policy.complete(now, &req, Observed::default());
                    break;
                }
                Decision::WaitUntil(at) => {
                    // `u64::MAX`: never (BaseCBS caps a volume at its baseline, which may be 0).
                    assert!(at >= now, "{kind:?} waits until the past");
                    now = at;
                }
                Decision::Idle => panic!("{kind:?} idle with a request queued"),
            }
        }
        if let Err(violation) = policy.check_invariants() {
            panic!("{kind:?} with {qos:?}: {violation:?}");
        }
        if let Some(change) = change {
            policy.update_qos(now.saturating_add(1_000_000), ID, change);
            if let Err(violation) = policy.check_invariants() {
                panic!("{kind:?} after a change to {change:?}: {violation:?}");
            }
        }
        policy.remove_volume(now.saturating_add(2_000_000), ID);
    }
}

/// `GET /v1/volumes?…` through axum's `Query` extractor.
fn check_list_query(data: &[u8]) {
    let Ok(query) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(uri) = format!("/v1/volumes?{query}").parse::<Uri>() else {
        return;
    };
    match Query::<ListQuery>::try_from_uri(&uri) {
        Ok(Query(list)) => {
            if let Some(tenant) = &list.tenant {
                check_tenant(tenant);
            }
        }
        Err(rejection) => {
            let status = rejection.status();
            assert!(status.is_client_error(), "a bad query got {status}");
        }
    }
}

// ---------------------------------------------------------------- seeds

/// Valid bodies for the `api_bodies` target: what the CLI sends.
pub fn api_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let seeds: [(&'static str, &str); 11] = [
        ("create", r#"{"name":"vol1","size_bytes":1073741824}"#),
        (
            "create_tenant_read_only",
            r#"{"name":"a.b_c-1","size_bytes":4096,"tenant":"alice","read_only":true}"#,
        ),
        (
            "create_gp2",
            r#"{"name":"v","size_bytes":107374182400,"qos":{"preset":"gp2"}}"#,
        ),
        (
            "create_qemu",
            r#"{"name":"q","size_bytes":1073741824,"qos":{"preset":"qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10"}}"#,
        ),
        (
            "create_refined",
            r#"{"name":"r","size_bytes":1073741824,"qos":{"preset":"gp3:iops=4000,throughput=250","baseline_iops":3000,"ceiling_mbps":300,"burst":"credits","weight":7}}"#,
        ),
        ("resize", r#"{"size_bytes":2147483648}"#),
        (
            "qos_change",
            r#"{"qos":{"baseline_iops":500,"ceiling_iops":2000,"burst":"on-demand"}}"#,
        ),
        (
            "qos_preset_change",
            r#"{"qos":{"preset":"io2:iops=16000"},"size_bytes":8589934592}"#,
        ),
        (
            "create_at_the_limits",
            r#"{"name":"L","size_bytes":1,"qos":{"baseline_iops":100000000,"ceiling_iops":100000000,"baseline_mbps":1000000,"ceiling_mbps":1000000,"burst":"none","weight":10000}}"#,
        ),
        (
            "qos_change_credits",
            r#"{"qos":{"baseline_iops":1,"ceiling_iops":99999999,"baseline_mbps":1,"ceiling_mbps":999999,"burst":"credits","weight":9999},"size_bytes":18446744073709551615}"#,
        ),
        ("list_query", "tenant=alice%20b"),
    ];
    seeds
        .into_iter()
        .map(|(name, body)| (name, body.as_bytes().to_vec()))
        .collect()
}
