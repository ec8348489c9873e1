//! The modules' imports point one way (ARCHITECTURE.md, "Layers").
//!
//! Reads every file under `src/` (the server library; `main.rs` and the benchmark generator
//! are outside it), maps each to its top-level module (`src/router.rs` → `router`,
//! `src/presence/gate.rs` → `presence`) and collects every `crate::<module>` path outside
//! comments, grouped imports (`use crate::{a, b}`) included. Any edge that lies on a cycle
//! of top-level modules fails the test: no two modules import each other, directly or
//! around a loop.

mod scan;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use scan::{code_only, server_source};

/// Top-level module of a file under `src/`, or `None` for files outside the library.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned());
    let first = parts.next()?;
    if first == "bin" || first == "main.rs" || first == "lib.rs" {
        return None;
    }
    Some(first.trim_end_matches(".rs").to_owned())
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Top-level modules named by `crate::` paths in `code`.
fn referenced_modules(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        // `$crate::` in macros and `presenced_crate::` style names are not this crate's paths.
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest_trim = rest.trim_start();
        if let Some(group) = rest_trim.strip_prefix('{') {
            // use crate::{a, b::c, d::{e, f}}: the first segment of each top-level item.
            let mut depth = 0usize;
            let mut at_item_start = true;
            let mut i = 0;
            let bytes = group.as_bytes();
            while i < bytes.len() {
                match bytes[i] {
                    b'{' => depth += 1,
                    b'}' if depth == 0 => break,
                    b'}' => depth -= 1,
                    b',' if depth == 0 => at_item_start = true,
                    c if at_item_start && (c.is_ascii_alphabetic() || c == b'_') => {
                        found.insert(ident_at(&group[i..]).to_owned());
                        at_item_start = false;
                    }
                    _ => {}
                }
                i += 1;
            }
        } else {
            let name = ident_at(rest_trim);
            if !name.is_empty() {
                found.insert(name.to_owned());
            }
        }
    }
    found
}

/// module → modules it names.
fn import_graph() -> BTreeMap<String, BTreeSet<String>> {
    let (src, files) = server_source();
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(&src, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = module_of(&src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read source");
        let deps = graph.entry(from.clone()).or_default();
        for to in referenced_modules(&code_only(&text)) {
            // Macros exported at the crate root (`crate::some_macro!`) are not modules.
            if to != from && modules.contains(&to) {
                deps.insert(to);
            }
        }
    }
    graph
}

/// Whether `to` reaches `from` (so the edge `from → to` closes a cycle).
fn reaches(graph: &BTreeMap<String, BTreeSet<String>>, start: &str, target: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut stack = vec![start.to_owned()];
    while let Some(m) = stack.pop() {
        if m == target {
            return true;
        }
        if seen.insert(m.clone()) {
            stack.extend(graph.get(&m).into_iter().flatten().cloned());
        }
    }
    false
}

fn cyclic_edges(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    let mut edges = BTreeSet::new();
    for (from, deps) in graph {
        for to in deps {
            if reaches(graph, to, from) {
                edges.insert((from.clone(), to.clone()));
            }
        }
    }
    edges
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let graph = import_graph();
    assert!(
        graph.len() > 5,
        "the scan found too few modules ({}): is src/ where it should be?",
        graph.len()
    );
    let cyclic: Vec<String> = cyclic_edges(&graph)
        .into_iter()
        .map(|(a, b)| format!("{a} -> {b}"))
        .collect();
    assert!(
        cyclic.is_empty(),
        "imports that close a cycle between top-level modules (arrows must point one way, \
         see ARCHITECTURE.md): {cyclic:?}"
    );
}

#[test]
fn the_scan_sees_plain_grouped_and_nested_crate_paths_but_not_comments_or_strings() {
    let code = code_only(
        "use crate::a::B;\nuse crate::{c, d::{e, f}, g};\nlet x = crate::h::i();\n\
         // crate::commented\n/// [`crate::doc`]\nlet s = \"crate::quoted\";\nlet q = '\"';\n\
         let y = crate::after_char_literal::z;\nmacro_rules! m { () => { $crate::dollar } }",
    );
    let found = referenced_modules(&code);
    let want: BTreeSet<String> = ["a", "c", "d", "g", "h", "after_char_literal"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, want);
}

#[test]
fn a_two_module_loop_and_a_three_module_loop_are_both_found() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut edge = |a: &str, b: &str| {
        g.entry(a.into()).or_default().insert(b.into());
    };
    edge("a", "b");
    edge("b", "a");
    edge("c", "d");
    edge("d", "e");
    edge("e", "c");
    edge("e", "f");
    let cyclic = cyclic_edges(&g);
    let names: Vec<String> = cyclic.iter().map(|(a, b)| format!("{a}{b}")).collect();
    assert_eq!(names, ["ab", "ba", "cd", "de", "ec"]);
}

/// Whether `code` names the identifier `Session` itself (not `SessionHandle`,
/// `LiveSession`, `sessions::Session…`).
fn names_session(code: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices("Session").any(|(i, _)| {
        let before = code[..i].chars().last();
        let after = code[i + "Session".len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// No module names a `Session` type: a handler given a session bundled with the whole node
/// state could reach every part of the node. A handler takes the service it belongs to,
/// the services it uses and the `node::session::Client` it acts for; the c2s task holds
/// the `Client` and lends it, with the node's services, to the router.
#[test]
fn no_module_names_a_session_with_the_node_state() {
    let (src, files) = server_source();
    let mut naming = BTreeSet::new();
    for file in &files {
        if module_of(&src, file).is_none() {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        if names_session(&code_only(&text)) {
            let rel = file.strip_prefix(&src).expect("under src");
            naming.insert(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    assert!(
        naming.is_empty(),
        "these files name a Session; a service handler takes its services and the session's \
         node::session::Client instead (ARCHITECTURE.md, \"Layers\"): {naming:?}"
    );
}

#[test]
fn the_session_scan_sees_the_type_but_not_longer_names() {
    assert!(names_session("fn f(s: &mut Session) {}"));
    assert!(names_session(
        "use crate::node::session::{Client, Session};"
    ));
    assert!(!names_session("fn f(h: &SessionHandle, l: LiveSession) {}"));
    assert!(!names_session(&code_only(
        "// a Session in a comment\nlet s = \"Session\";"
    )));
}
