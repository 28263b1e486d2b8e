//! `headroom check --data-dir DIR [--repair] [--json]`: verifies a stopped node's metadata
//! against its devices and, with `--repair`, restores a damaged `meta.redb` from
//! `meta-copy.redb` (or rewrites a damaged copy from the primary). The logic is the store's
//! (`headroom_store::check`); this only prints.
//!
//! Exit codes: 0 clean (after the repairs, with `--repair`), 1 problems found (left), 2 the
//! check could not run (usage, no metadata there, the server is running: redb's file lock
//! refuses a second process).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use headroom_store::check::{CheckReport, FileState, check_data_dir};

use crate::output::{emit, print_json};

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The node's data directory (the server must be stopped).
    #[arg(long)]
    data_dir: PathBuf,
    /// Restore a damaged, missing or older meta.redb from its copy, or rewrite a damaged,
    /// missing or older copy from meta.redb, then check again.
    #[arg(long)]
    repair: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Exit code: problems found.
const EXIT_PROBLEMS: u8 = 1;
/// Exit code: the check could not run.
const EXIT_CANNOT_RUN: u8 = 2;

pub fn run(args: &CheckArgs) -> ExitCode {
    let report = match check_data_dir(&args.data_dir, args.repair) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_CANNOT_RUN);
        }
    };
    if args.json {
        if let Err(e) = print_json(&report) {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_CANNOT_RUN);
        }
    } else {
        emit(&text(&report));
    }
    if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_PROBLEMS)
    }
}

fn text(r: &CheckReport) -> String {
    let mut out = String::new();
    for f in &r.files {
        let state = match &f.state {
            FileState::Intact { commit } => format!("intact, commit {commit}"),
            FileState::Missing => "missing".to_string(),
            FileState::Damaged { reason } => format!("DAMAGED: {reason}"),
        };
        out.push_str(&format!("{}: {state}\n", f.path.display()));
    }
    out.push_str(&format!(
        "{} devices, {} volumes, {} extent rows\n",
        r.devices, r.volumes, r.extent_rows
    ));
    for repair in &r.repairs {
        out.push_str(&format!("repaired: {repair}\n"));
    }
    if r.is_clean() {
        out.push_str("clean\n");
    } else {
        for p in &r.problems {
            out.push_str(&format!("problem: {p}\n"));
        }
        if r.repairs.is_empty() {
            out.push_str(&format!(
                "run `headroom check --data-dir {} --repair` to repair what can be\n",
                r.data_dir.display()
            ));
        }
    }
    out
}
