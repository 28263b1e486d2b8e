//! The node's modules form layers, and every `crate::` reference points down.
//!
//! Why: the request path must not depend on what is built on it. When the scheduler imported
//! the node's configuration, which imported the HTTP API, a change of the API could break the
//! scheduler's build, and a second transport could not reuse the pipeline without the whole
//! node. So each top-level module of `crates/node/src` is placed in one layer of [`LAYERS`]
//! (top first); a module may name modules of lower layers and of its own layer, and the
//! references between modules must not form a cycle. A new module must be placed here
//! (the test fails for a module it does not know), which is where its place is decided.
//!
//! What counts as a reference: every `crate::<module>` outside comments that are not doc
//! comments (doc links are references too), in the module's files, test modules excepted
//! (`#[cfg(test)] mod tests` and files named `tests.rs`). The self-check at the bottom shows
//! that an upward edge and a cycle are caught.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, top first, and the modules in each.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "node: start-up and its configuration",
        &["server", "config"],
    ),
    (
        "control: the HTTP API, the dashboard, metrics export, history",
        &["api", "timeline"],
    ),
    (
        "background: rebuild, scrub, their pacing, arbitration",
        &["repair", "scrub", "paced", "arbitration"],
    ),
    (
        "transports: NBD (negotiation, TLS, the reader and the reply writer), in memory, vhost-user-blk",
        &["session", "memory_transport", "vhost_user"],
    ),
    (
        "pipeline: permits and budget, splitting, scheduling, execution, completion",
        &["pipeline"],
    ),
    (
        "admission and accounting: connections and their origins, budgets, TLS, limits, per-volume records",
        &[
            "admission",
            "budget",
            "tls",
            "handshake_limit",
            "origin",
            "limits",
            "metrics",
            "volume_qos",
            "readiness",
        ],
    ),
    (
        "scheduling and execution",
        &["scheduler", "exec", "emulated", "net_threads", "setting"],
    ),
    (
        "leaves: no reference to another module of the node",
        &[
            "sync",
            "clock",
            "address_group",
            "buffers",
            "slots",
            "coalesce",
            "tls_config",
        ],
    ),
];

type Edges = BTreeMap<String, BTreeSet<String>>;

fn source_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `crates/node/src` belongs to (`None` for `lib.rs`).
fn top_module(root: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(root).expect("under the source root");
    let first = relative
        .components()
        .next()?
        .as_os_str()
        .to_str()?
        .to_string();
    let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
    (name != "lib").then_some(name)
}

/// `text` without its test module and without comments that are not doc comments.
fn production_code(text: &str) -> String {
    let before_tests = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    before_tests
        .lines()
        .filter(|line| {
            let t = line.trim_start();
            !t.starts_with("//") || t.starts_with("///") || t.starts_with("//!")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules `code` names as `crate::<module>`.
fn referenced_modules(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let preceded_by_ident = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        // `headroom_store::...` and the like end in `crate::` only by accident of spelling.
        if !preceded_by_ident && !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// Every top-level module of the node and the modules it references.
fn node_edges() -> Edges {
    let root = source_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let Some(module) = top_module(&root, &file) else {
            continue;
        };
        let entry = edges.entry(module.clone()).or_default();
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("a source file");
        for target in referenced_modules(&production_code(&text)) {
            if target != module {
                entry.insert(target);
            }
        }
    }
    edges
}

/// What is wrong with `edges` against `layers`: modules without a layer, references to a
/// module of a higher layer, and cycles (one message each).
fn violations(edges: &Edges, layers: &[(&str, &[&str])]) -> Vec<String> {
    let mut layer_of = BTreeMap::new();
    for (index, (_, modules)) in layers.iter().enumerate() {
        for module in *modules {
            assert!(
                layer_of.insert(module.to_string(), index).is_none(),
                "{module} is placed twice"
            );
        }
    }
    let mut found = Vec::new();
    for (module, targets) in edges {
        let Some(&from) = layer_of.get(module) else {
            found.push(format!(
                "module `{module}` has no layer: place it in LAYERS"
            ));
            continue;
        };
        for target in targets {
            match layer_of.get(target) {
                // A path that is no module of the node (`crate::` in a macro's text, say).
                None if !edges.contains_key(target) => {}
                None => found.push(format!(
                    "module `{target}` has no layer: place it in LAYERS"
                )),
                Some(&to) if to < from => found.push(format!(
                    "`{module}` ({}) references `{target}` ({}), a higher layer",
                    layers[from].0, layers[to].0
                )),
                Some(_) => {}
            }
        }
    }
    if let Some(cycle) = a_cycle(edges) {
        found.push(format!("a cycle of references: {}", cycle.join(" -> ")));
    }
    found
}

/// One cycle of `edges`, if there is one (depth-first search, in name order).
fn a_cycle(edges: &Edges) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        edges: &Edges,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).expect("on the path");
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in edges.keys() {
        if let Some(cycle) = visit(node, edges, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn every_reference_between_the_nodes_modules_points_down_and_none_forms_a_cycle() {
    let edges = node_edges();
    assert!(
        edges.len() >= 25 && edges.contains_key("session") && edges.contains_key("scheduler"),
        "the source tree was not read: {:?}",
        edges.keys().collect::<Vec<_>>()
    );
    let references: usize = edges.values().map(BTreeSet::len).sum();
    println!(
        "{} modules, {references} references between them",
        edges.len()
    );
    let found = violations(&edges, LAYERS);
    assert!(found.is_empty(), "layering broken:\n{}", found.join("\n"));
    for (_, modules) in LAYERS {
        for module in *modules {
            assert!(
                edges.contains_key(*module),
                "LAYERS names `{module}`, which is no module of the node any more"
            );
        }
    }
}

#[test]
fn the_check_catches_an_upward_reference_a_cycle_and_an_unplaced_module() {
    let mut edges = node_edges();
    assert!(violations(&edges, LAYERS).is_empty());

    // The scheduler naming the configuration again (as it did): upward, and a cycle through
    // the API, which references the scheduler.
    edges
        .get_mut("scheduler")
        .expect("scheduler")
        .insert("config".into());
    let found = violations(&edges, LAYERS);
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("`scheduler` (scheduling and execution) references `config`")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|v| v.starts_with("a cycle of references")),
        "{found:?}"
    );

    // Two modules of one layer that name each other: no upward edge, still a cycle.
    let mut edges = node_edges();
    edges
        .get_mut("scrub")
        .expect("scrub")
        .insert("repair".into());
    edges
        .get_mut("repair")
        .expect("repair")
        .insert("scrub".into());
    let found = violations(&edges, LAYERS);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("repair -> scrub -> repair")
            || found[0].contains("scrub -> repair -> scrub"),
        "{found:?}"
    );

    // A module nobody placed.
    let mut edges = node_edges();
    edges.insert("transport".into(), BTreeSet::from(["sync".to_string()]));
    let found = violations(&edges, LAYERS);
    assert_eq!(
        found,
        ["module `transport` has no layer: place it in LAYERS"]
    );
}

#[test]
fn references_are_read_from_code_and_doc_links_not_from_plain_comments_or_tests() {
    let text = "use crate::sync::lock;\n/// See [`crate::budget::Budget`].\n// crate::api is only mentioned\nfn f() { headroom_crate::x(); }\n#[cfg(test)]\nmod tests {\n    use crate::server;\n}\n";
    let names = referenced_modules(&production_code(text));
    assert_eq!(
        names,
        BTreeSet::from(["budget".to_string(), "sync".to_string()])
    );
}
