//! A damaged `meta.redb`: bytes flipped at many seeded positions (the header and its commit
//! slots, the middle, the end) and the file cut short (to 0, to half, to a page boundary).
//! `Store::open` never panics: it either opens with every volume and byte intact (damage in
//! unused pages) or fails with the clear error that names the file and `headroom check
//! --repair`; then `check_data_dir(.., repair)` restores the file from `meta-copy.redb` and
//! the next open serves every volume byte-identical. A damaged copy is rewritten by the open.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use headroom_store::check::{FileState, check_data_dir};
use headroom_store::{EXTENT_SIZE_BYTES, Store, StoreConfig};

const MIB: u64 = 1 << 20;

fn config(dir: &Path) -> StoreConfig {
    StoreConfig {
        device_count: 2,
        device_capacity_bytes: 32 * MIB,
        metadata_reserve_bytes: 0,
        ..StoreConfig::new(dir)
    }
}

/// The volumes written and what each holds (name, bytes).
fn fixture(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let store = Store::open(&config(dir)).unwrap();
    let mut out = Vec::new();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        store.create_volume(name, 8 * MIB).unwrap();
        let v = store.open_volume(name).unwrap();
        // Extents 0 and 2 written, 1 and 3 holes.
        let mut bytes = vec![0u8; 8 * MIB as usize];
        for e in [0u64, 2] {
            let p = common::pattern(i as u64 * 10 + e, EXTENT_SIZE_BYTES as usize);
            v.write_at(e * EXTENT_SIZE_BYTES, &p, false).unwrap();
            bytes[(e * EXTENT_SIZE_BYTES) as usize..((e + 1) * EXTENT_SIZE_BYTES) as usize]
                .copy_from_slice(&p);
        }
        v.flush().unwrap();
        out.push((name.to_string(), bytes));
    }
    out
}

fn assert_intact(store: &Store, volumes: &[(String, Vec<u8>)], what: &str) {
    let names: Vec<String> = store.list_volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names.len(), volumes.len(), "{what}: {names:?}");
    for (name, bytes) in volumes {
        let v = store.open_volume(name).unwrap();
        let mut back = vec![0xEEu8; bytes.len()];
        v.read_at(0, &mut back).unwrap();
        assert!(&back == bytes, "{what}: volume {name} differs");
    }
}

/// Opens after the damage `what`; on the clear error, repairs and opens again. Returns
/// whether it needed the repair.
fn open_or_repair(dir: &Path, volumes: &[(String, Vec<u8>)], what: &str) -> bool {
    let opened = std::panic::catch_unwind(|| Store::open(&config(dir)));
    let Ok(opened) = opened else {
        panic!("{what}: Store::open panicked");
    };
    match opened {
        Ok(store) => {
            assert_intact(&store, volumes, what);
            false
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("meta.redb is damaged")
                    && msg.contains("headroom check --data-dir")
                    && msg.contains("--repair"),
                "{what}: unclear error: {msg}"
            );
            let report = check_data_dir(dir, true).unwrap();
            assert!(report.is_clean(), "{what}: {report:?}");
            assert!(
                report.repairs.len() == 1 && report.repairs[0].starts_with("restored"),
                "{what}: {report:?}"
            );
            let store = Store::open(&config(dir)).unwrap();
            assert_intact(&store, volumes, what);
            true
        }
    }
}

/// Runs `damage` on a fresh copy of the pristine metadata files in `dir`.
fn with_damage(
    dir: &Path,
    pristine: &[(std::path::PathBuf, Vec<u8>)],
    volumes: &[(String, Vec<u8>)],
    what: &str,
    damage: impl FnOnce(&Path),
) -> bool {
    for (path, bytes) in pristine {
        std::fs::write(path, bytes).unwrap();
    }
    damage(&dir.join("meta.redb"));
    open_or_repair(dir, volumes, what)
}

#[test]
fn flipped_bytes_and_truncation_never_panic_and_repair_restores_every_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let volumes = fixture(dir);
    let report = check_data_dir(dir, false).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.volumes, report.extent_rows), (3, 6));
    let pristine: Vec<_> = ["meta.redb", "meta-copy.redb"]
        .iter()
        .map(|f| (dir.join(f), std::fs::read(dir.join(f)).unwrap()))
        .collect();
    let len = pristine[0].1.len() as u64;
    assert!(len >= 8192, "{len}");

    // Positions: every 16 bytes of the header's first 512 (magic, god byte, both commit
    // slots), every 4093 bytes over the whole file (one in each 4 KiB page, at a moving
    // offset), and 16 seeded random ones.
    let mut positions: Vec<u64> = (0..512).step_by(16).collect();
    positions.extend((512..len).step_by(4093));
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..16 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        positions.push(x % len);
    }
    positions.push(len - 1);
    let mut repaired = 0;
    for &pos in &positions {
        let what = format!("byte {pos} of {len} flipped");
        if with_damage(dir, &pristine, &volumes, &what, |p| {
            let mut b = std::fs::read(p).unwrap();
            b[pos as usize] ^= 0xFF;
            std::fs::write(p, b).unwrap();
        }) {
            repaired += 1;
        }
    }
    // Some damage is in pages in use: those opens must have failed and been repaired.
    eprintln!(
        "{repaired} of {} flips in {len} bytes were refused and repaired",
        positions.len()
    );
    assert!(repaired > 0, "no flip was detected");

    for cut in [0, len / 2, 4096, len - 4096, len - 1] {
        let what = format!("cut to {cut} of {len} bytes");
        let needed = with_damage(dir, &pristine, &volumes, &what, |p| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(cut)
                .unwrap();
        });
        if cut == 0 {
            assert!(needed, "an empty meta.redb beside its copy must be refused");
        }
    }
    // Missing altogether.
    assert!(with_damage(
        dir,
        &pristine,
        &volumes,
        "meta.redb removed",
        |p| {
            std::fs::remove_file(p).unwrap();
        }
    ));
}

#[test]
fn a_damaged_or_stale_copy_is_rewritten_from_the_primary() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let volumes = fixture(dir);
    let copy = dir.join("meta-copy.redb");
    let old_copy = std::fs::read(&copy).unwrap();
    // One more commit on the primary only: the copy is one commit behind, as after a crash
    // between the two writes.
    {
        let store = Store::open(&StoreConfig {
            metadata_copy: false,
            ..config(dir)
        })
        .unwrap();
        store.create_volume("d", 4 * MIB).unwrap();
    }
    std::fs::write(&copy, &old_copy).unwrap();
    let report = check_data_dir(dir, false).unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains("its copy at commit")),
        "{report:?}"
    );
    {
        let store = Store::open(&config(dir)).unwrap();
        assert_eq!(store.list_volumes().len(), 4);
    }
    assert!(check_data_dir(dir, false).unwrap().is_clean());
    // Garbage in the copy: the open rewrites it.
    let mut b = std::fs::read(&copy).unwrap();
    for x in b.iter_mut().take(8192) {
        *x ^= 0x5A;
    }
    std::fs::write(&copy, b).unwrap();
    let report = check_data_dir(dir, false).unwrap();
    assert!(
        matches!(report.files[1].state, FileState::Damaged { .. }),
        "{report:?}"
    );
    {
        let store = Store::open(&config(dir)).unwrap();
        assert_intact(
            &store,
            &volumes
                .iter()
                .cloned()
                .chain([("d".to_string(), vec![0u8; 4 * MIB as usize])])
                .collect::<Vec<_>>(),
            "after the copy was rewritten",
        );
    }
    assert!(check_data_dir(dir, false).unwrap().is_clean());
    // check --repair rewrites a damaged copy too.
    std::fs::write(&copy, b"not a database at all").unwrap();
    let report = check_data_dir(dir, true).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert!(report.repairs[0].starts_with("rewrote"), "{report:?}");
}

#[test]
fn a_copy_that_cannot_be_opened_does_not_stop_the_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let volumes = fixture(dir);
    let copy = dir.join("meta-copy.redb");
    // Not a file at all: opening it and writing over it fail (as on a broken disk).
    std::fs::remove_file(&copy).unwrap();
    std::fs::create_dir(&copy).unwrap();
    std::fs::write(copy.join("x"), b"keeps the directory non-empty").unwrap();
    let store = Store::open(&config(dir)).unwrap();
    assert_intact(&store, &volumes, "with the copy unopenable");
    let h = store.commit_health();
    assert!(
        h.reasons.len() == 1 && h.reasons[0].starts_with("metadata copy out of date"),
        "{h:?}"
    );
    // The copy's place is usable again: the next commit rewrites it.
    std::fs::remove_dir_all(&copy).unwrap();
    store.create_volume("d", 4 * MIB).unwrap();
    assert!(
        store.commit_health().is_ready(),
        "{:?}",
        store.commit_health()
    );
    drop(store);
    assert!(check_data_dir(dir, false).unwrap().is_clean());
}
