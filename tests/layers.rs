//! The layers of `src/` and their order (ARCHITECTURE.md, "Layers").
//!
//! Reads every file under `src/` (the server library; `main.rs` and the benchmark generator
//! are outside it) and collects every `crate::` path outside comments and strings, grouped
//! imports (`use crate::{a, b::{c, d}}`) included.
//!
//! - Each top-level entry of `src/` is a layer with a rank in [`LAYERS`]; a file may name
//!   only its own layer and the layers below it, so the arrows between layers point one way
//!   and a new top-level module must be given a place.
//! - Inside a layer, its modules (`transport::c2s`, `services::presence`, …) may not import
//!   each other around a loop.
//! - No module names a `Session` bundling a client with the node state, and no service
//!   but those listed in [`SERVICES_ON_THE_NODE_STATE`] names the node state (`Shared`)
//!   at all.

mod scan;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use scan::{code_only, server_source};

/// The layers, top first. A file may import its own layer and those after it.
const LAYERS: &[&str] = &[
    "app",
    "transport",
    "routing",
    "services",
    "node",
    "liveness",
    "cluster",
    "store",
    "policy",
    "config",
    "metrics",
    "clock",
    "protocol",
];

fn rank(layer: &str) -> Option<usize> {
    LAYERS.iter().position(|l| *l == layer)
}

/// Module path of a file under `src/` (`src/transport/c2s/session.rs` →
/// `transport::c2s::session`, `src/node/mod.rs` → `node`, `src/config.rs` → `config`);
/// `None` for files outside the library.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let first = parts.first()?;
    if first == "bin" || first == "main.rs" || first == "lib.rs" {
        return None;
    }
    if parts.last().is_some_and(|l| l == "mod.rs") {
        parts.pop();
    }
    let last = parts.pop()?;
    parts.push(last.trim_end_matches(".rs").to_owned());
    Some(parts.join("::"))
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The paths after `crate::` in `code`, groups expanded (`crate::{a, b::{c, d}}` → `a`,
/// `b::c`, `b::d`).
fn referenced_paths(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        // `$crate::` in macros and `presenced_crate::` style names are not this crate's paths.
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        path_items(rest, &[], &mut found);
    }
    found
}

/// Adds the items of the path (or group) at the start of `s`, below `prefix`.
fn path_items(s: &str, prefix: &[String], found: &mut BTreeSet<String>) {
    let s = s.trim_start();
    if let Some(group) = s.strip_prefix('{') {
        // Split the group's top-level items at depth 0 commas.
        let mut depth = 0usize;
        let mut item_start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    path_items(&group[item_start..i], prefix, found);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    path_items(&group[item_start..i], prefix, found);
                    item_start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let name = ident_at(s);
    if name.is_empty() || name == "self" {
        if !prefix.is_empty() {
            found.insert(prefix.join("::"));
        }
        return;
    }
    let mut path = prefix.to_vec();
    path.push(name.to_owned());
    if let Some(next) = s[name.len()..].strip_prefix("::") {
        return path_items(next, &path, found);
    }
    found.insert(path.join("::"));
}

/// The module a path names: its longest prefix that is a module of `modules` (a file), or
/// its first segment.
fn module_named(path: &str, modules: &BTreeSet<String>) -> String {
    let mut prefix = path;
    loop {
        if modules.contains(prefix) {
            return prefix.to_owned();
        }
        match prefix.rfind("::") {
            Some(i) => prefix = &prefix[..i],
            None => return prefix.to_owned(),
        }
    }
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
        for path in referenced_paths(&code_only(&text)) {
            let to = module_named(&path, &modules);
            // Macros exported at the crate root (`crate::some_macro!`) are not modules.
            if to != from && modules.contains(&to) {
                deps.insert(to);
            }
        }
    }
    graph
}

fn layer(module: &str) -> &str {
    module.split("::").next().unwrap_or_default()
}

#[test]
fn every_top_level_entry_of_src_is_a_layer_with_a_rank() {
    let graph = import_graph();
    let unranked: BTreeSet<&str> = graph
        .keys()
        .map(|m| layer(m))
        .filter(|l| rank(l).is_none())
        .collect();
    assert!(
        unranked.is_empty(),
        "top-level modules with no place in LAYERS (put them in a layer's folder, or rank \
         them): {unranked:?}"
    );
    assert!(
        graph.len() > 20,
        "the scan found too few modules: is src/ where it should be?"
    );
}

#[test]
fn each_layer_imports_only_itself_and_the_layers_below_it() {
    let mut upward = Vec::new();
    for (from, deps) in import_graph() {
        for to in deps {
            if let (Some(a), Some(b)) = (rank(layer(&from)), rank(layer(&to))) {
                if b < a {
                    upward.push(format!("{from} -> {to}"));
                }
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that point up the layers (top first: {LAYERS:?}; ARCHITECTURE.md, \
         \"Layers\"): {upward:?}"
    );
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
fn no_import_cycle_between_the_modules_of_a_layer() {
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
        "imports that close a cycle between modules (arrows must point one way, see \
         ARCHITECTURE.md): {cyclic:?}"
    );
}

#[test]
fn the_scan_sees_plain_grouped_and_nested_crate_paths_but_not_comments_or_strings() {
    let code = code_only(
        "use crate::a::B;\nuse crate::{c, d::{e, f}, g};\nlet x = crate::h::i();\n\
         // crate::commented\n/// [`crate::doc`]\nlet s = \"crate::quoted\";\nlet q = '\"';\n\
         let y = crate::after_char_literal::z;\nmacro_rules! m { () => { $crate::dollar } }",
    );
    let found = referenced_paths(&code);
    let want: BTreeSet<String> = [
        "a::B",
        "c",
        "d::e",
        "d::f",
        "g",
        "h::i",
        "after_char_literal::z",
    ]
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

/// Whether `code` names the identifier `name` itself, not a longer one that contains it.
fn names_ident(code: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(name).any(|(i, _)| {
        let before = code[..i].chars().last();
        let after = code[i + name.len()..].chars().next();
        !before.is_some_and(ident) && !after.is_some_and(ident)
    })
}

/// Whether `code` names the identifier `Session` itself (not `SessionHandle`,
/// `LiveSession`, `sessions::Session…`).
fn names_session(code: &str) -> bool {
    names_ident(code, "Session")
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

/// Files under `src/services/` that may name the node state, `node::Shared`: none (the
/// composition root builds every service from the node's parts).
const SERVICES_ON_THE_NODE_STATE: &[&str] = &[];

/// A service holds what it uses and no more, so its signatures say what it depends on:
/// no other file under `src/services/` names `Shared`, the whole node state
/// (ARCHITECTURE.md, "Layers"). The composition root builds each service from the node's
/// parts.
#[test]
fn services_do_not_name_the_node_state() {
    let (src, files) = server_source();
    let mut naming = BTreeSet::new();
    let mut services = 0;
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        if !rel.starts_with("services/") {
            continue;
        }
        services += 1;
        let text = std::fs::read_to_string(file).expect("read source");
        if names_ident(&code_only(&text), "Shared")
            && !SERVICES_ON_THE_NODE_STATE.contains(&rel.as_str())
        {
            naming.insert(rel);
        }
    }
    assert!(
        services > SERVICES_ON_THE_NODE_STATE.len(),
        "the scan found no services"
    );
    assert!(
        naming.is_empty(),
        "these services name node::Shared; give the service the parts of the node it uses \
         (the composition root builds it from them) instead: {naming:?}"
    );
}

#[test]
fn the_ident_scan_sees_the_node_state_but_not_longer_names() {
    assert!(names_ident("fn f(s: &Shared) {}", "Shared"));
    assert!(names_ident(
        "use crate::node::{Shared, RosterLocks};",
        "Shared"
    ));
    assert!(!names_ident(
        "fn f(s: &SharedBytes, t: &NotShared) {}",
        "Shared"
    ));
    assert!(!names_ident(
        &code_only("// the Shared state\nlet s = \"Shared\";"),
        "Shared"
    ));
}
