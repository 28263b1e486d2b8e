//! Writes the seed inputs (built with the encoders, see `headroom_fuzz::{nbd,api}`) into
//! `corpus/<target>/seed-<name>`: `cargo run --example seeds` in `fuzz/`.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let targets = [
        ("handshake", headroom_fuzz::nbd::handshake_seeds()),
        ("option", headroom_fuzz::nbd::option_seeds()),
        ("request", headroom_fuzz::nbd::request_seeds()),
        ("api_bodies", headroom_fuzz::api::api_seeds()),
        ("router", headroom_fuzz::router::router_seeds()),
    ];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, seeds) in targets {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
    }
    // Inputs that found bugs (kept by name outside cmin, see scripts/fuzz-long).
    let dir = root.join("router");
    for (name, bytes) in headroom_fuzz::router::router_regressions() {
        std::fs::write(dir.join(format!("regression-{name}")), bytes)?;
    }
    let dir = root.join("session");
    std::fs::create_dir_all(&dir)?;
    let seeds = headroom_fuzz::session::session_seeds();
    for (name, bytes) in &seeds {
        std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
    }
    println!("session: {} seeds in {}", seeds.len(), dir.display());
    Ok(())
}
