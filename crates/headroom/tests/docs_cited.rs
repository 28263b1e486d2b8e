//! The documentation stands on its own: every repository path that the docs, the code's
//! comments and the scripts cite exists in the repository, nothing points outside it (the
//! design notes and research summaries a reader needs are in `docs/`), and
//! `docs/ARCHITECTURE.md`'s crate table agrees with the workspace's Cargo.toml files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The repository root (this crate is `crates/headroom`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Directories that hold build outputs, fuzzing corpora or VCS data, not sources.
const SKIPPED_DIRS: &[&str] = &["target", ".git", "corpus", "artifacts", "headroom-data"];

/// Text files a reader follows citations from.
fn is_text_source(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    matches!(
        ext,
        "rs" | "md" | "toml" | "sh" | "py" | "js" | "html" | "css" | "json" | "service"
    ) || (path.parent().is_some_and(|p| p.ends_with("scripts")) && ext.is_empty())
        || name == "run"
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_ref()) && !name.starts_with("target") {
                walk(&path, out);
            }
        } else if is_text_source(&path) {
            out.push(path);
        }
    }
}

fn sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    walk(&root(), &mut files);
    assert!(
        files.len() > 50,
        "found only {} source files under {}",
        files.len(),
        root().display()
    );
    files
}

/// The top-level directories whose paths the docs cite.
const CITED_TOPS: &[&str] = &[
    "docs/",
    "crates/",
    "scripts/",
    "scenarios/",
    "examples/",
    "fuzz/",
    "deploy/",
];

/// Repository paths cited in `text`: a known top-level directory followed by path characters.
fn cited_paths(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for top in CITED_TOPS {
        let mut rest = text;
        while let Some(at) = rest.find(top) {
            let preceded_by_path = rest[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '/' | '.'));
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '/' | '.')))
                .unwrap_or(tail.len());
            let path = tail[..end].trim_end_matches(['.', ',']);
            if !preceded_by_path && path.len() > top.len() {
                found.push(path.to_string());
            }
            rest = &tail[end.max(1)..];
        }
    }
    found
}

/// Cited paths that are build outputs or stand for any file (`scenarios/X.toml`).
fn is_placeholder(path: &str) -> bool {
    path.contains("/target")
        || path.starts_with("fuzz/artifacts")
        || path.split('/').any(|part| {
            part == "X.toml" || part.chars().all(|c| c.is_ascii_uppercase() || c == '.')
        })
}

#[test]
fn every_cited_repository_path_exists() {
    let root = root();
    let mut missing = BTreeMap::<String, BTreeSet<String>>::new();
    let mut checked = 0usize;
    for file in sources() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for path in cited_paths(&text) {
            if is_placeholder(&path) {
                continue;
            }
            checked += 1;
            if !root.join(&path).exists() {
                missing.entry(path).or_default().insert(shown.clone());
            }
        }
    }
    println!("{checked} citations of repository paths checked");
    assert!(
        checked > 100,
        "only {checked} citations found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "cited paths that are not in the repository (path: cited from):\n{missing:#?}"
    );
}

#[test]
fn nothing_points_outside_the_repository() {
    // Names of documents that lived outside the repository once; the docs now carry what a
    // reader needs from them (docs/design.md, docs/background.md).
    // (Spelt in pieces so that this file does not itself contain the names it looks for.)
    let outside = [
        concat!("..", "/shared"),
        concat!("DESIGN", ".md"),
        concat!("papers", ".md"),
        concat!("peers", ".md"),
        concat!("seeds", "/"),
    ];
    let mut offenders = Vec::new();
    for file in sources() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for (number, line) in text.lines().enumerate() {
            for needle in outside {
                if line.contains(needle) {
                    offenders.push(format!("{}:{}: {needle}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "references to documents outside the repository:\n{}",
        offenders.join("\n")
    );
}

/// `headroom-*` path dependencies in a crate's `[dependencies]` (not dev-dependencies).
fn workspace_dependencies(manifest: &str) -> BTreeSet<String> {
    let value: toml::Value = toml::from_str(manifest).expect("Cargo.toml parses");
    value
        .get("dependencies")
        .and_then(toml::Value::as_table)
        .map(|deps| {
            deps.keys()
                .filter_map(|name| name.strip_prefix("headroom-"))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_architecture_crate_table_agrees_with_the_cargo_files() {
    let root = root();
    let workspace: toml::Value =
        toml::from_str(&std::fs::read_to_string(root.join("Cargo.toml")).unwrap()).unwrap();
    let members: BTreeSet<String> = workspace["workspace"]["members"]
        .as_array()
        .expect("workspace members")
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let architecture = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    // Rows: | `headroom-NAME` (`crates/<name>`) | job | deps |
    let mut documented = BTreeMap::new();
    for line in architecture.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 {
            continue;
        }
        let Some(dir) = cells[1]
            .split('`')
            .find(|part| part.starts_with("crates/"))
            .map(str::to_string)
        else {
            continue;
        };
        let deps = cells[cells.len() - 2];
        documented.insert(dir, deps.to_string());
    }
    assert_eq!(
        documented.keys().cloned().collect::<BTreeSet<_>>(),
        members,
        "docs/ARCHITECTURE.md's crate table lists other crates than the workspace"
    );
    let short_names: BTreeSet<String> = members
        .iter()
        .map(|m| m.trim_start_matches("crates/").to_string())
        .collect();
    for (dir, deps_cell) in &documented {
        let manifest = std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
        let actual = workspace_dependencies(&manifest);
        let claimed: BTreeSet<String> = match deps_cell.as_str() {
            "—" | "-" | "" => BTreeSet::new(),
            "all" => short_names
                .iter()
                .filter(|name| format!("crates/{name}") != *dir)
                .cloned()
                .collect(),
            cell => cell
                .split(',')
                .map(|d| d.trim().trim_matches('`').to_string())
                .collect(),
        };
        assert_eq!(
            claimed, actual,
            "docs/ARCHITECTURE.md says {dir} depends on {deps_cell:?}; its Cargo.toml says {actual:?}"
        );
    }
}
