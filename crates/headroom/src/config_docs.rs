//! Keeps docs/configuration.md in step with serve_config.rs (the truth): every TOML example
//! in the reference (and in docs/operations.md, and deploy/headroom.toml) parses as a
//! configuration layer, and every field of every configuration table is both documented in
//! a key table (`` | `key` | ``) and shown in an example. A key added to serve_config.rs
//! without its documentation fails here, naming it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use crate::serve_config::ConfigFile;

const REFERENCE: &str = include_str!("../../../docs/configuration.md");
const OPERATIONS: &str = include_str!("../../../docs/operations.md");
const DEPLOY_SAMPLE: &str = include_str!("../../../deploy/headroom.toml");
/// The configuration's sections, one file each: where the tables are declared.
const SOURCES: &[&str] = &[
    include_str!("serve_config/mod.rs"),
    include_str!("serve_config/server.rs"),
    include_str!("serve_config/storage.rs"),
    include_str!("serve_config/emulated.rs"),
    include_str!("serve_config/limits.rs"),
    include_str!("serve_config/qos.rs"),
    include_str!("serve_config/cost.rs"),
    include_str!("serve_config/tls.rs"),
    include_str!("serve_config/faults.rs"),
    include_str!("serve_config/api.rs"),
    include_str!("serve_config/metrics.rs"),
];

/// Where each configuration table of serve_config.rs sits in the file.
const TABLE_PATHS: &[(&str, &str)] = &[
    ("ConfigFile", ""),
    ("ServerSection", "server"),
    ("StorageSection", "storage"),
    ("EmulatedSection", "storage.emulated"),
    ("RebuildSection", "storage.rebuild"),
    ("ScrubSection", "storage.scrub"),
    ("IoCostSection", "storage.emulated.model"),
    ("LimitsSection", "limits"),
    ("QosSection", "qos"),
    ("CapacitySection", "qos.capacity"),
    ("ParamsSection", "qos.params"),
    ("CostSection", "qos.cost"),
    ("CpuSection", "qos.cost.cpu"),
    ("LinearCpuSection", "qos.cost.cpu.read"),
    ("VopSection", "qos.cost.device.vop"),
    ("TlsSection", "tls"),
    ("FaultsSection", "faults"),
    ("FaultRuleSection", "faults.rule"),
    ("ApiSection", "api"),
    ("MetricsSection", "metrics"),
];

/// Sections the operations work added (`[api]`: authentication, `[metrics]`: series
/// cardinality), documented ahead of the merge. While serve_config.rs has no such field, their
/// examples are checked with that table left out and their keys are not required; once it
/// has, they are checked like every other section.
const PENDING: &[(&str, &str)] = &[("ApiSection", "api"), ("MetricsSection", "metrics")];

/// True when `section` (a top-level table) is a pending one serve_config.rs does not have yet.
fn pending_absent(tables: &BTreeMap<String, Vec<String>>, section: &str) -> bool {
    PENDING.iter().any(|(_, path)| *path == section)
        && !tables["ConfigFile"].iter().any(|field| field == section)
}

/// Parses a documented block as a configuration layer, leaving out pending sections.
fn parse_layer(
    tables: &BTreeMap<String, Vec<String>>,
    block: &str,
) -> Result<ConfigFile, toml::de::Error> {
    let mut table: toml::Table = toml::from_str(block)?;
    table.retain(|section, _| !pending_absent(tables, section));
    toml::Value::Table(table).try_into()
}

/// The ```toml blocks of a Markdown text.
fn toml_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```toml") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// Every key path a TOML value sets (`qos.params.seed`); arrays of tables count once.
fn key_paths(prefix: &str, value: &toml::Value, out: &mut BTreeSet<String>) {
    match value {
        toml::Value::Table(table) => {
            for (key, value) in table {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                out.insert(path.clone());
                key_paths(&path, value, out);
            }
        }
        toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
            for item in items {
                key_paths(prefix, item, out);
            }
        }
        _ => {}
    }
}

/// The configuration tables of serve_config.rs (`deny_unknown_fields` structs) and their
/// keys, with serde renames applied.
fn source_tables() -> BTreeMap<String, Vec<String>> {
    let mut tables = BTreeMap::new();
    let mut deny = false;
    let mut current: Option<(String, Vec<String>)> = None;
    let mut rename: Option<String> = None;
    for line in SOURCES.iter().flat_map(|source| source.lines()) {
        let line = line.trim();
        if let Some((name, fields)) = &mut current {
            if line == "}" {
                tables.insert(std::mem::take(name), std::mem::take(fields));
                current = None;
            } else if let Some(rest) = line.strip_prefix("#[serde(rename = \"") {
                rename = rest.split('"').next().map(str::to_string);
            } else if let Some(rest) = line.strip_prefix("pub ") {
                let field = rest.split(':').next().unwrap_or_default().to_string();
                fields.push(rename.take().unwrap_or(field));
            }
            continue;
        }
        if line.starts_with("#[serde(") && line.contains("deny_unknown_fields") {
            deny = true;
        } else if let Some(rest) = line.strip_prefix("pub struct ") {
            if deny {
                let name = rest.split([' ', '{']).next().unwrap_or_default();
                current = Some((name.to_string(), Vec::new()));
            }
            deny = false;
        } else if line.starts_with("pub enum ") || line.starts_with("impl") {
            deny = false;
        }
    }
    tables
}

#[test]
fn every_documented_example_parses() {
    let tables = source_tables();
    let blocks = toml_blocks(REFERENCE);
    assert!(blocks.len() >= 10, "found {} toml blocks", blocks.len());
    for (i, block) in blocks.iter().enumerate() {
        if let Err(err) = parse_layer(&tables, block) {
            panic!("docs/configuration.md, toml block {i}: {err}\n{block}");
        }
    }
    let operations = toml_blocks(OPERATIONS);
    assert!(!operations.is_empty());
    for block in operations {
        if let Err(err) = parse_layer(&tables, &block) {
            panic!("docs/operations.md toml block: {err}\n{block}");
        }
    }
    let sample: ConfigFile = toml::from_str(DEPLOY_SAMPLE).expect("deploy/headroom.toml parses");
    assert_eq!(
        sample.storage.data_dir.as_deref(),
        Some("/var/lib/headroom/data".as_ref())
    );
}

#[test]
fn every_key_of_the_configuration_is_documented_and_shown() {
    let tables = source_tables();
    let mapped: BTreeMap<&str, &str> = TABLE_PATHS.iter().copied().collect();
    for name in tables.keys() {
        assert!(
            mapped.contains_key(name.as_str()),
            "serve_config.rs has a new configuration table {name}: add it to TABLE_PATHS \
             here and document its keys in docs/configuration.md"
        );
    }
    let mut shown = BTreeSet::new();
    for block in toml_blocks(REFERENCE) {
        let value: toml::Value = toml::from_str(&block).unwrap();
        key_paths("", &value, &mut shown);
    }
    let mut missing = Vec::new();
    for (name, path) in TABLE_PATHS {
        if pending_absent(&tables, path) {
            continue;
        }
        let fields = tables.get(*name).unwrap_or_else(|| {
            panic!("{name} is no longer in serve_config.rs: update TABLE_PATHS")
        });
        assert!(!fields.is_empty(), "{name}: no fields found");
        for field in fields {
            let key = if path.is_empty() {
                field.clone()
            } else {
                format!("{path}.{field}")
            };
            if !path.is_empty() && !REFERENCE.contains(&format!("| `{field}` |")) {
                missing.push(format!("{key}: no row in a key table"));
            }
            if !shown.contains(&key) {
                missing.push(format!("{key}: in no example"));
            }
        }
    }
    // `qos.cost.device` is an enum: each of its forms has an example.
    for form in ["qos.cost.device.linear", "qos.cost.device.vop"] {
        if !shown.contains(form) {
            missing.push(format!("{form}: in no example"));
        }
    }
    if !REFERENCE.contains("device = \"none\"") {
        missing.push("qos.cost.device = \"none\": in no example".to_string());
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md is behind serve_config.rs:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_source_scan_finds_the_tables() {
    let tables = source_tables();
    assert_eq!(
        tables["FaultsSection"],
        ["seed", "rule"],
        "the serde rename of `rules` is applied"
    );
    assert!(tables["ServerSection"].contains(&"nbd_listen".to_string()));
    assert!(!tables.contains_key("Invalid"), "not a configuration table");
}

#[test]
fn a_pending_section_is_checked_once_it_exists() {
    let mut tables = source_tables();
    let has_api = tables["ConfigFile"].iter().any(|f| f == "api");
    assert_eq!(pending_absent(&tables, "api"), !has_api);
    assert!(!pending_absent(&tables, "qos"), "not pending");
    // Once ConfigFile has the field, an unknown key in the section is an error again.
    tables
        .get_mut("ConfigFile")
        .unwrap()
        .push("api".to_string());
    assert!(!pending_absent(&tables, "api"));
    if !has_api {
        assert!(parse_layer(&tables, "[api]\ntoken = \"0123456789abcdef\"\n").is_err());
    }
}

/// The section a flag's help heading stands for (`ConfigFile`'s `next_help_heading`s).
const HEADING_SECTIONS: &[(&str, &str)] = &[
    ("Server", "server"),
    ("Storage", "storage"),
    ("Limits", "limits"),
    ("Scheduling", "qos"),
    ("TLS", "tls"),
];

/// Each flag of the configuration layer as clap builds it from the sections, by the dotted
/// key it sets: the section from its help heading, the field from its id.
fn flags_by_key() -> BTreeMap<String, String> {
    let command = <ConfigFile as clap::Args>::augment_args(clap::Command::new("serve"));
    let mut flags = BTreeMap::new();
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else {
            continue;
        };
        let heading = arg.get_help_heading().unwrap_or_else(|| {
            panic!("--{long} has no help heading: flatten its section under one")
        });
        let section = HEADING_SECTIONS
            .iter()
            .find_map(|(h, s)| (*h == heading).then_some(*s))
            .unwrap_or_else(|| panic!("--{long}: heading {heading:?} not in HEADING_SECTIONS"));
        flags.insert(format!("{section}.{}", arg.get_id()), format!("--{long}"));
    }
    flags
}

/// The flags docs/configuration.md's **Flag** column names, by dotted key (the table's path
/// from the heading above it, `## `[tls]``, and the row's key).
fn documented_flags() -> BTreeMap<String, Vec<String>> {
    let mut table = String::new();
    let mut flags = BTreeMap::new();
    for line in REFERENCE.lines() {
        if line.starts_with("## ") || line.starts_with("### ") {
            table = line
                .split("`[")
                .nth(1)
                .and_then(|rest| rest.split("]`").next())
                .unwrap_or_default()
                .trim_matches(['[', ']'])
                .to_string();
            continue;
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        if !line.starts_with("| `") || cells.len() < 5 {
            continue;
        }
        let key = cells[0].trim_start_matches("| ").trim_matches('`');
        let named: Vec<String> = cells[3]
            .split('`')
            .filter_map(|word| word.split_whitespace().next())
            .filter(|word| word.starts_with("--"))
            .map(str::to_string)
            .collect();
        if !named.is_empty() {
            flags.insert(format!("{table}.{key}"), named);
        }
    }
    flags
}

#[test]
fn every_flag_is_documented_on_the_key_it_sets() {
    let clap_flags = flags_by_key();
    assert!(
        clap_flags.len() >= 30,
        "found {} flags: {clap_flags:?}",
        clap_flags.len()
    );
    let documented = documented_flags();
    let mut wrong = Vec::new();
    for (key, flag) in &clap_flags {
        match documented.get(key) {
            Some(named) if named.contains(flag) => {}
            Some(named) => wrong.push(format!("{key}: clap has {flag}, the docs say {named:?}")),
            None => wrong.push(format!(
                "{key}: clap has {flag}, the docs' Flag column none"
            )),
        }
    }
    for (key, named) in &documented {
        for flag in named {
            if clap_flags.get(key) != Some(flag) {
                wrong.push(format!(
                    "{key}: the docs say {flag}, which sets no such key"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/configuration.md's Flag column and the flags serve parses differ:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_flag_check_reads_the_flag_column() {
    // The check above would pass vacuously if either side were empty or mis-keyed.
    let documented = documented_flags();
    assert_eq!(
        documented.get("tls.certificate_tenants"),
        Some(&vec!["--tls-cert-tenant".to_string()])
    );
    assert_eq!(
        documented.get("storage.device_paths"),
        Some(&vec!["--device".to_string()])
    );
    assert_eq!(
        flags_by_key().get("server.io_threads").map(String::as_str),
        Some("--io-threads")
    );
}
