//! The metadata on a really full file system: a small tmpfs mounted for the test (needs
//! root; skipped otherwise, and failing under HEADROOM_REQUIRE_TOOLS=1). The metadata
//! reserve (`DATA_DIR/meta-reserve`) is released when a commit hits ENOSPC, the commit goes
//! through on a reopened database, `commit_health` says the reserve is in use until space
//! comes back, and a store restarts on a disk that is still full.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_store::{RESERVE_FILE, Store, StoreConfig, StoreError};

const MIB: u64 = 1 << 20;

/// A tmpfs of a given size mounted on a temporary directory, unmounted on drop.
struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(size_bytes: u64) -> Option<SmallFs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_bytes}")])
            .arg("tmpfs")
            .arg(dir.path())
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
                panic!("mounting a tmpfs is required (HEADROOM_REQUIRE_TOOLS is set) but failed");
            }
            eprintln!("SKIPPED: cannot mount a tmpfs (needs root) for a really full disk");
            return None;
        }
        Some(SmallFs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Takes every free byte with a filler file; returns its path.
    fn fill(&self) -> PathBuf {
        let filler = self.path().join("filler");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&filler)
            .unwrap();
        let chunk = vec![0xA5u8; 64 << 10];
        use std::io::Write;
        let mut w = &f;
        while w.write_all(&chunk).is_ok() {}
        // The last partial chunk: byte by byte is too slow, 4 KiB pages are the unit.
        while w.write_all(&chunk[..4096]).is_ok() {}
        filler
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_disk_releases_the_reserve_and_a_restart_on_it_works() {
    let Some(fs) = SmallFs::mount(48 * MIB) else {
        return;
    };
    let cfg = StoreConfig {
        device_count: 1,
        device_capacity_bytes: 64 * MIB,
        metadata_reserve_bytes: 8 * MIB,
        ..StoreConfig::new(fs.path().join("data"))
    };
    let data = common::pattern(7, 4 * MIB as usize);
    {
        let store = Store::open(&cfg).unwrap();
        assert!(
            store.commit_health().is_ready(),
            "{:?}",
            store.commit_health()
        );
        let reserve = fs.path().join("data").join(RESERVE_FILE);
        assert!(std::fs::metadata(&reserve).unwrap().len() >= 8 * MIB);
        store.create_volume("v", 16 * MIB).unwrap();
        let v = store.open_volume("v").unwrap();
        v.write_at(0, &data, false).unwrap();
        // The data is written (pages taken); its allocations are not committed yet.
        let filler = fs.fill();
        // The FLUSH commits them on a full disk: only the reserve makes room.
        v.flush().unwrap();
        let h = store.commit_health();
        assert!(
            h.reasons.len() == 1 && h.reasons[0].starts_with("metadata reserve in use"),
            "{h:?}"
        );
        assert_eq!(std::fs::metadata(&reserve).unwrap().len(), 0);
        // While the reserve is in use no new data extent is allocated (the room is the
        // metadata's); writes into allocated extents go on.
        assert!(matches!(
            v.write_at(8 * MIB, &[1u8; 4096], false),
            Err(StoreError::NoSpace)
        ));
        v.write_at(4096, &data[4096..8192], false).unwrap();
        v.flush().unwrap();
        // Space comes back: the health probe takes the reserve again.
        std::fs::remove_file(&filler).unwrap();
        assert!(
            store.commit_health().is_ready(),
            "{:?}",
            store.commit_health()
        );
        assert!(std::fs::metadata(&reserve).unwrap().len() >= 8 * MIB);
        // And new extents are allocated again (then given back: the data model is `data`).
        v.write_at(8 * MIB, &[1u8; 4096], false).unwrap();
        v.trim(8 * MIB, 2 * MIB, false).unwrap();
        v.flush().unwrap();
    }
    // The disk fills up while the node is down; it starts anyway, inside the reserve, and
    // serves what was flushed.
    let _filler = fs.fill();
    let store = Store::open(&cfg).unwrap();
    assert!(!store.commit_health().is_ready());
    let v = store.open_volume("v").unwrap();
    let mut back = vec![0u8; data.len()];
    v.read_at(0, &mut back).unwrap();
    assert!(
        back == data,
        "the flushed data reads back after the restart"
    );
}
