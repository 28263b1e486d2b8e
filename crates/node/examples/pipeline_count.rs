//! One case of the pipeline bench (`benches/pipeline.rs`) for a fixed number of requests, for
//! instruction counts under callgrind.
//!
//! Why: time on a shared machine moves with the neighbours' load; the instructions a run
//! executes do not. The node's start-up is thousands of times one request, so
//! `scripts/count-pipeline-instructions` runs this under `valgrind --tool=callgrind` (all
//! threads) for two request counts and divides the difference of the totals by the difference
//! of the counts: start-up, the prefill, the warm-up and the exit cancel out.
//!
//! ```text
//! cargo run --release -p headroom-node --example pipeline_count -- memory_read_4k_burst_qd1 10000
//! cargo run --release -p headroom-node --example pipeline_count -- list
//! ```

use headroom_node::server::bench_support::{Case, CaseDriver};

/// Requests run before the counted ones, so pools and queues are at size.
const WARM_UP_REQUESTS: u64 = 2_000;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || {
        let names: Vec<String> = Case::all().iter().map(Case::name).collect();
        format!(
            "usage: pipeline_count CASE REQUESTS (CASE: {})",
            names.join(", ")
        )
    };
    if args.first().map(String::as_str) == Some("list") {
        for case in Case::all() {
            println!("{}", case.name());
        }
        return Ok(());
    }
    let [name, requests] = args.as_slice() else {
        return Err(usage());
    };
    let case = Case::parse(name).ok_or_else(usage)?;
    let requests: u64 = requests.parse().map_err(|_| usage())?;
    let mut driver = CaseDriver::new(case);
    driver.run(WARM_UP_REQUESTS);
    driver.run(requests);
    println!("{name}: {requests} requests");
    Ok(())
}
