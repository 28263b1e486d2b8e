//! Bit rot end to end: a real server on device files, volumes written by nbdcopy, random
//! bits flipped in random blocks of the device files behind the server's back (through
//! another file descriptor, the pages then evicted with `posix_fadvise(DONTNEED)`), and then:
//! the background scrub (`headroom scrub start`) finds every damaged block and repairs those
//! of the 2-replica volume from the good copy; nbdcopy reads the 2-replica volume back
//! byte for byte after fresh damage (the reads repair the copy they read, the next scrub the
//! other, and a third scrub finds nothing there); a client reading the 1-replica volume block by block gets EIO for exactly the
//! damaged blocks and the written bytes everywhere else. Seeded (`HEADROOM_BIT_ROT_SEED`),
//! the seed printed.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::Client;
use common::{Server, have_tool, random_file, run_ok, text};
use headroom_nbd::consts::NBD_EIO;
use headroom_store::{Store, StoreConfig};
use serde_json::Value;

const VOLUME_BYTES: u64 = 8 << 20;
const BLOCK: u64 = 4096;

/// A file-backed server with three devices whose scrub runs only when asked.
fn start(dir: &Path) -> Server {
    let config = dir.join("headroom.toml");
    std::fs::write(
        &config,
        "[storage.scrub]\ninterval_s = 0\nrate = \"1GiB\"\n",
    )
    .unwrap();
    Server::start_with(
        &dir.join("data"),
        &[
            "--devices",
            "3",
            "--device-size",
            "64MiB",
            "--config",
            config.to_str().unwrap(),
        ],
    )
}

/// Where each copy of every block of `volume` lives: (device file, byte offset), per
/// replica, per 4 KiB block (the store opened on the stopped server's data directory).
fn block_places(data_dir: &Path, volume: &str) -> Vec<Vec<(PathBuf, u64)>> {
    let store = Store::open(&StoreConfig::new(data_dir)).unwrap();
    let v = store.open_volume(volume).unwrap();
    let devices = store.pool_info().devices;
    let extent_bytes = headroom_store::EXTENT_SIZE_BYTES;
    (0..v.replicas())
        .map(|replica| {
            (0..VOLUME_BYTES / BLOCK)
                .map(|block| {
                    let extent = block * BLOCK / extent_bytes;
                    let at = v
                        .replica_location(replica, extent)
                        .expect("every extent written");
                    let path = PathBuf::from(&devices[at.device as usize].path);
                    let path = if path.is_absolute() {
                        path
                    } else {
                        data_dir.join(path)
                    };
                    (path, at.offset_bytes + (block * BLOCK) % extent_bytes)
                })
                .collect()
        })
        .collect()
}

/// Flips 1 to 8 random bits of the block at `place`, then evicts the file's pages.
fn flip(place: &(PathBuf, u64), rng: &mut u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&place.0)
        .unwrap();
    let mut block = vec![0u8; BLOCK as usize];
    file.read_exact_at(&mut block, place.1).unwrap();
    for _ in 0..=next(rng) % 8 {
        let bit = next(rng) % (BLOCK * 8);
        block[(bit / 8) as usize] ^= 1 << (bit % 8);
    }
    file.write_all_at(&block, place.1).unwrap();
    file.sync_data().unwrap();
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
}

/// splitmix64.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `count` distinct random blocks of a volume, none in `taken`.
fn pick(rng: &mut u64, count: usize, taken: &BTreeSet<u64>) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    while out.len() < count {
        let block = next(rng) % (VOLUME_BYTES / BLOCK);
        if !taken.contains(&block) {
            out.insert(block);
        }
    }
    out
}

fn scrub_pass(server: &Server, passes_before: u64) -> Value {
    let out = server.cli(&["scrub", "start", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let out = server.cli(&["scrub", "show", "--json"]);
        assert!(out.status.success(), "{}", text(&out));
        let view: Value = serde_json::from_slice(&out.stdout).unwrap();
        if view["passes_done"].as_u64().unwrap() > passes_before {
            return view;
        }
        assert!(Instant::now() < deadline, "no scrub pass finished: {view}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn n(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}"))
}

#[test]
fn flipped_bits_are_found_by_scrub_repaired_from_a_copy_or_answered_with_eio() {
    if !have_tool("nbdcopy") {
        assert!(
            std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_none(),
            "nbdcopy is required (HEADROOM_REQUIRE_TOOLS is set)"
        );
        eprintln!("SKIPPED: nbdcopy (libnbd-bin) is not installed");
        return;
    }
    let seed = std::env::var("HEADROOM_BIT_ROT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("bit rot seed {seed} (replay: HEADROOM_BIT_ROT_SEED={seed})");
    let mut rng = seed;
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let source = dir.path().join("source.raw");
    random_file(&source, VOLUME_BYTES as usize, seed);
    let written = std::fs::read(&source).unwrap();

    // Write both volumes with a real client, then learn where their blocks live.
    let server = start(dir.path());
    server.create_volume("one", "8MiB");
    server.create_volume_with("two", "8MiB", &["--replicas", "2"]);
    for volume in ["one", "two"] {
        run_ok(
            Command::new("nbdcopy")
                .arg(&source)
                .arg(server.uri(volume))
                .arg("--flush"),
        );
    }
    server.stop();
    let one = block_places(&data_dir, "one");
    let two = block_places(&data_dir, "two");
    let server = start(dir.path());

    // 1. Damage behind the running server's back; a scrub finds 100 % of it.
    let lost = pick(&mut rng, 12, &BTreeSet::new());
    for &block in &lost {
        flip(&one[0][block as usize], &mut rng);
    }
    let scrubbed = pick(&mut rng, 12, &BTreeSet::new());
    for &block in &scrubbed {
        let replica = (next(&mut rng) % 2) as usize;
        flip(&two[replica][block as usize], &mut rng);
    }
    let view = scrub_pass(&server, 0);
    let found = &view["pass"]["found"];
    assert_eq!(
        n(found, "blocks_verified"),
        3 * VOLUME_BYTES / BLOCK,
        "every block of every copy: {view}"
    );
    assert_eq!(n(found, "checksum_mismatches"), 24, "{view}");
    assert_eq!(n(found, "checksum_repaired"), 12, "{view}");
    assert_eq!(n(found, "unrepairable"), 12, "{view}");

    // 2. Fresh damage in the 2-replica volume: a real client reads back exactly what it
    // wrote, and the reads repaired what they met (the next scrub finds only the 1-replica
    // volume's lost blocks).
    let reread = pick(&mut rng, 12, &BTreeSet::new());
    for &block in &reread {
        let replica = (next(&mut rng) % 2) as usize;
        flip(&two[replica][block as usize], &mut rng);
    }
    let back = dir.path().join("back.raw");
    run_ok(Command::new("nbdcopy").arg(server.uri("two")).arg(&back));
    let read = std::fs::read(&back).unwrap();
    let wrong = read.iter().zip(&written).filter(|(a, b)| a != b).count();
    assert_eq!(wrong, 0, "{wrong} wrong bytes reached nbdcopy");
    // A read meets the copy it reads: what the other copy holds is the scrub's to repair.
    let view = scrub_pass(&server, 1);
    let found = &view["pass"]["found"];
    let left_in_two = n(found, "checksum_mismatches") - 12;
    assert!(
        left_in_two <= 12 && n(found, "checksum_repaired") == left_in_two,
        "the reads repaired some, the scrub the rest: {view}"
    );
    assert_eq!(n(found, "unrepairable"), 12, "{view}");
    let view = scrub_pass(&server, 2);
    let found = &view["pass"]["found"];
    assert_eq!(
        (n(found, "checksum_mismatches"), n(found, "unrepairable")),
        (12, 12),
        "every block of the 2-replica volume is repaired; the 1-replica volume's lost blocks stay lost: {view}"
    );

    // 3. The 1-replica volume: EIO for exactly the damaged blocks, the data elsewhere.
    let mut client = Client::open(server.nbd, "one");
    let mut eio = BTreeSet::new();
    for block in 0..VOLUME_BYTES / BLOCK {
        match client.read(block, block * BLOCK, BLOCK as u32) {
            Ok(data) => {
                let at = (block * BLOCK) as usize;
                assert!(
                    data == written[at..at + BLOCK as usize],
                    "block {block} read wrong bytes"
                );
            }
            Err(code) => {
                assert_eq!(code, NBD_EIO, "block {block}");
                eio.insert(block);
            }
        }
    }
    assert_eq!(eio, lost, "EIO for exactly the damaged blocks");
    client.disconnect();

    // The metrics say the same.
    let metrics = common::metrics_text(&server.api);
    assert!(
        metrics.contains("headroom_scrub_unrepairable_blocks_total 36")
            && metrics.contains("headroom_scrub_passes_total 3"),
        "{metrics}"
    );
    server.stop();
}
