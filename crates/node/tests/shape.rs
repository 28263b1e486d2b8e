//! The node's source keeps a shape a reader can hold: no file over 800 lines before its test
//! module, and no function on the request path over 120 lines.
//!
//! Why: the request path is read far more often than it is written (every latency question
//! and every review of a change to it starts there), and a 1,200-line module or a 250-line
//! function hides which concept a line belongs to. Files are split by concept and long
//! functions into named steps; this test keeps it so, and says where it broke.
//!
//! How it measures (on rustfmt-formatted text): a file's length is its lines before the first
//! line that starts with `#[cfg(test)]`. A function starts at a line that begins, after its
//! indentation, with an item `fn` signature (`fn `, `pub fn `, `pub(crate) fn `, `async fn `,
//! `const fn `, ...) and ends at the first later line that is its indentation followed by
//! `}`; its length counts both lines. Items under `#[cfg(test)]` and files named `tests.rs`
//! are skipped. The request path is the modules in [`REQUEST_PATH`] and any folder named in
//! [`REQUEST_PATH_FOLDERS`], wherever it is. The self-check at the bottom shows that a 121-line
//! function and an 801-line file are caught.

use std::path::{Path, PathBuf};

/// Most lines of a file before its test module.
const MAX_FILE_LINES: usize = 800;

/// Most lines of a production function on the request path.
const MAX_FN_LINES: usize = 120;

/// Top-level modules of `crates/node/src` that every request passes through.
const REQUEST_PATH: &[&str] = &[
    "session",
    "scheduler",
    "exec",
    "budget",
    "admission",
    "origin",
    "buffers",
    "slots",
    "coalesce",
    "emulated",
    "server",
    "vhost_user",
];

/// Folders on the request path wherever they are (`session/pipeline/`, a `transport/`).
const REQUEST_PATH_FOLDERS: &[&str] = &["pipeline", "transport"];

/// Request-path functions allowed over [`MAX_FN_LINES`] for now, as (file under
/// `crates/node/src`, function name). An entry that no longer matches a long function fails
/// the test: remove it.
const ALLOWED_LONG_FUNCTIONS: &[(&str, &str)] = &[];

fn source_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `.rs` files under `dir`, recursively, in name order.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut paths: Vec<PathBuf> = entries
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `file` relative to the source root, with `/` between components.
fn relative(root: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(root).expect("under the source root");
    relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// Whether the file at `relative` (to the source root) is on the request path.
fn on_request_path(relative: &str) -> bool {
    let parts: Vec<&str> = relative.split('/').collect();
    let top = parts[0].strip_suffix(".rs").unwrap_or(parts[0]);
    REQUEST_PATH.contains(&top)
        || parts[..parts.len() - 1]
            .iter()
            .any(|folder| REQUEST_PATH_FOLDERS.contains(folder))
}

/// Lines of `text` before its first line that starts with `#[cfg(test)]`.
fn lines_before_tests(text: &str) -> usize {
    text.lines()
        .take_while(|line| !line.starts_with("#[cfg(test)]"))
        .count()
}

fn indentation(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

/// The index of the line that closes the item starting at `lines[start]`: the first later
/// line that is the item's indentation followed by `}` (`None`: the item ends on its line,
/// or is never closed).
fn closing_line(lines: &[&str], start: usize) -> Option<usize> {
    let indent = indentation(lines[start]);
    let closing = format!("{indent}}}");
    lines[start + 1..]
        .iter()
        .position(|line| *line == closing)
        .map(|at| start + 1 + at)
}

/// `lines` with the items under `#[cfg(test)]` blanked (line numbers kept).
fn without_test_items<'a>(lines: &[&'a str]) -> Vec<&'a str> {
    let mut out = lines.to_vec();
    let mut i = 0;
    while i < out.len() {
        if out[i].trim_start() != "#[cfg(test)]" {
            i += 1;
            continue;
        }
        // The item the attribute applies to: the next line that is no attribute or comment.
        let mut item = i + 1;
        while item < out.len() && {
            let t = out[item].trim_start();
            t.starts_with("#[") || t.starts_with("//")
        } {
            item += 1;
        }
        let end = match out.get(item) {
            Some(line) if line.trim_end().ends_with(';') || line.trim_end().ends_with('}') => item,
            Some(_) => closing_line(&out, item).unwrap_or(out.len() - 1),
            None => out.len() - 1,
        };
        for line in &mut out[i..=end.min(lines.len() - 1)] {
            *line = "";
        }
        i = end + 1;
    }
    out
}

/// The name of the function whose signature starts `line` (after its indentation), if it does.
fn function_name(line: &str) -> Option<&str> {
    let mut rest = line.trim_start();
    if let Some(after) = rest.strip_prefix("pub") {
        rest = match after.strip_prefix('(') {
            Some(scope) => scope.split_once(')')?.1,
            None => after,
        };
        rest = rest.strip_prefix(' ')?;
    }
    loop {
        let before = rest;
        for qualifier in ["const ", "async ", "unsafe ", "default "] {
            rest = rest.strip_prefix(qualifier).unwrap_or(rest);
        }
        if let Some(after) = rest.strip_prefix("extern ") {
            // `extern "C" fn`: skip the ABI string.
            rest = match after.strip_prefix('"') {
                Some(abi) => abi.split_once("\" ")?.1,
                None => after,
            };
        }
        if rest == before {
            break;
        }
    }
    let name = rest.strip_prefix("fn ")?;
    let end = name
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(name.len());
    (end > 0).then_some(&name[..end])
}

/// A function longer than the limit.
#[derive(Debug, PartialEq)]
struct LongFunction {
    /// 1-based line of its signature.
    line: usize,
    name: String,
    lines: usize,
}

/// The production functions of `text` longer than `max_lines` (test items skipped).
fn long_functions(text: &str, max_lines: usize) -> Vec<LongFunction> {
    let all: Vec<&str> = text.lines().collect();
    let lines = without_test_items(&all);
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = function_name(line) else {
            continue;
        };
        // A declaration without a body, or a body on the signature's line.
        let t = line.trim_end();
        if t.ends_with(';') || t.ends_with('}') {
            continue;
        }
        let Some(end) = closing_line(&lines, start) else {
            continue;
        };
        let length = end - start + 1;
        if length > max_lines {
            found.push(LongFunction {
                line: start + 1,
                name: name.to_string(),
                lines: length,
            });
        }
    }
    found
}

/// Every violation in the node's source: files over the limit, and request-path functions
/// over it that are not allowed; plus allow-list entries that match nothing.
fn violations() -> (Vec<String>, usize) {
    let root = source_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut found = Vec::new();
    let mut allowed_seen = vec![false; ALLOWED_LONG_FUNCTIONS.len()];
    for file in &files {
        let name = relative(&root, file);
        let text = std::fs::read_to_string(file).expect("a source file");
        let length = lines_before_tests(&text);
        if length > MAX_FILE_LINES {
            found.push(format!(
                "src/{name}: {length} lines before its tests (at most {MAX_FILE_LINES}): split it by concept"
            ));
        }
        if name.ends_with("/tests.rs") || name == "tests.rs" || !on_request_path(&name) {
            continue;
        }
        for long in long_functions(&text, MAX_FN_LINES) {
            let allowed = ALLOWED_LONG_FUNCTIONS
                .iter()
                .position(|&(f, n)| f == name && n == long.name);
            match allowed {
                Some(index) => allowed_seen[index] = true,
                None => found.push(format!(
                    "src/{name}:{}: fn {} is {} lines (at most {MAX_FN_LINES}): split it into named steps",
                    long.line, long.name, long.lines
                )),
            }
        }
    }
    for (seen, (file, name)) in allowed_seen.iter().zip(ALLOWED_LONG_FUNCTIONS) {
        if !seen {
            found.push(format!(
                "src/{file}: fn {name} is allowed to be long but is not (any more): remove it from ALLOWED_LONG_FUNCTIONS"
            ));
        }
    }
    (found, files.len())
}

#[test]
fn no_file_is_too_long_and_no_request_path_function_either() {
    let (found, files) = violations();
    assert!(files >= 30, "the source tree was not read: {files} files");
    assert!(
        found.is_empty(),
        "the node's source is out of shape:\n{}",
        found.join("\n")
    );
}

/// `count` lines of filler at `indent`.
fn filler(indent: &str, count: usize) -> String {
    (0..count)
        .map(|i| format!("{indent}let _x{i} = {i};\n"))
        .collect()
}

#[test]
fn the_scanner_catches_a_121_line_function_and_an_801_line_file() {
    // A 121-line function (signature, 119 lines of body, closing brace) is caught; 120 is not.
    let long = format!("pub(crate) async fn long() {{\n{}}}\n", filler("    ", 119));
    assert_eq!(
        long_functions(&long, MAX_FN_LINES),
        [LongFunction {
            line: 1,
            name: "long".into(),
            lines: 121
        }]
    );
    let fits = format!("fn fits() {{\n{}}}\n", filler("    ", 118));
    assert!(long_functions(&fits, MAX_FN_LINES).is_empty());

    // A method with a signature over several lines, inside an impl, measured from its first
    // line to its own closing brace; a declaration without a body and a one-line body are
    // not functions to measure.
    let method = format!(
        "impl S {{\n    /// Doc.\n    pub fn method(\n        &self,\n        a: u32,\n    ) -> u32 {{\n{}    }}\n\n    fn short(&self) -> u32 {{ 1 }}\n}}\ntrait T {{\n    fn declared(&self);\n}}\n",
        filler("        ", 117)
    );
    assert_eq!(
        long_functions(&method, MAX_FN_LINES),
        [LongFunction {
            line: 3,
            name: "method".into(),
            lines: 122
        }]
    );

    // Test items are not production code: a long test function or test module is skipped.
    let tests = format!(
        "fn f() {{}}\n\n#[cfg(test)]\nfn helper() {{\n{}}}\n\n#[cfg(test)]\nmod tests {{\n    #[test]\n    fn long_test() {{\n{}    }}\n}}\n",
        filler("    ", 200),
        filler("        ", 200)
    );
    assert!(long_functions(&tests, MAX_FN_LINES).is_empty());

    // An 801-line file is caught, its test module not counted; 800 lines fit.
    let file = format!(
        "{}#[cfg(test)]\nmod tests {{\n{}}}\n",
        filler("", 801),
        filler("    ", 500)
    );
    assert_eq!(lines_before_tests(&file), 801);
    assert!(lines_before_tests(&file) > MAX_FILE_LINES);
    assert_eq!(lines_before_tests(&filler("", 800)), MAX_FILE_LINES);

    // Every kind of signature is recognised, and nothing else.
    for (line, name) in [
        ("fn a() {", Some("a")),
        ("    pub fn b<T>(t: T) {", Some("b")),
        ("pub(crate) fn c() {", Some("c")),
        ("pub(super) async fn d() {", Some("d")),
        ("pub(in crate::x) fn e() {", Some("e")),
        ("const fn f() -> u32 {", Some("f")),
        ("pub const unsafe fn g() {", Some("g")),
        ("extern \"C\" fn h() {", Some("h")),
        ("let f = |x| x;", None),
        ("// fn comment() {", None),
        ("pub struct S {", None),
        ("    fnord();", None),
    ] {
        assert_eq!(function_name(line), name, "{line}");
    }

    // The request path: its modules, and pipeline or transport folders anywhere.
    assert!(on_request_path("session/transmit.rs"));
    assert!(on_request_path("server/mod.rs"));
    assert!(on_request_path("exec.rs"));
    assert!(on_request_path("api/pipeline/stage.rs"));
    assert!(on_request_path("transport/tcp.rs"));
    assert!(!on_request_path("api/metrics.rs"));
    assert!(!on_request_path("timeline.rs"));
}
