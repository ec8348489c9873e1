//! One exit for stanzas (ARCHITECTURE.md, "The path of one stanza"): only the outbox
//! (`node/outbox.rs`) queues a stanza on a session's mailbox or sends one to another node of
//! the cluster, so what applies to every stanza is applied in one place and no sender can
//! skip it.
//!
//! Reads every file under `src/` with comments and strings blanked and looks for calls of
//! the session handle's stanza-queueing methods (`send`, `send_xml`, `send_paced`,
//! `send_sm`) and of the cluster's stanza-forwarding ones (`forward`, `forward_reaching`,
//! `send`, `decide_there`). Files are told by name, wherever they stand: `outbox.rs`, and
//! `sessions.rs`, which defines the handle. The session's writer, which drains the mailbox
//! to the socket, calls none of them: it is the mailbox's consumer.
//!
//! `send` is also a channel sender's method. A call is a channel's when it is awaited
//! (the handle's and the cluster's `send` are not async), when its receiver is named
//! `…tx`, or when its statement discards the channel's `Result` (`let _ = …`); the
//! handle's `send` answers a `bool` that no caller needs to discard that way.

mod scan;

use std::path::Path;

use scan::{code_only, server_source};

/// Methods whose names only the session handle and the cluster use.
const STANZA_METHODS: &[&str] = &[
    "send_xml",
    "send_paced",
    "send_sm",
    "forward",
    "forward_reaching",
    "decide_there",
];

/// Files that may call them: the outbox, and the registry that defines the handle.
fn may_send(file: &Path) -> bool {
    file.file_name()
        .is_some_and(|n| n == "outbox.rs" || n == "sessions.rs")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The index just past the `)` that closes the `(` at `open`.
fn close_of(code: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (i, c) in code[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return open + i + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// The name a method call at `dot` (the index of its `.`) is made on: `cluster` in
/// `shared.cluster.send(`, `self.cluster().send(` and a chain split over lines.
fn receiver(code: &str, dot: usize) -> &str {
    let mut end = code[..dot].trim_end().len();
    if code[..end].ends_with(')') {
        // A call's result: the name of what was called.
        let mut depth = 0usize;
        for (i, c) in code[..end].char_indices().rev() {
            match c {
                ')' => depth += 1,
                '(' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    let start = code[..end]
        .char_indices()
        .rev()
        .take_while(|&(_, c)| is_ident(c))
        .last()
        .map_or(end, |(i, _)| i);
    &code[start..end]
}

/// Whether the `send(` call at `dot` is a channel's (see the module docs).
fn is_channel_send(code: &str, dot: usize) -> bool {
    let open = dot + ".send".len();
    let awaited = code[close_of(code, open)..]
        .trim_start()
        .starts_with(".await");
    let statement = code[..dot]
        .rfind([';', '{', '}'])
        .map_or(&code[..dot], |i| &code[i + 1..dot]);
    awaited || receiver(code, dot).ends_with("tx") || statement.trim_start().starts_with("let _ =")
}

/// The lines (1-based) of `code` that queue a stanza on a session or send one to another
/// node, with the method called.
fn stanza_sends(code: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let line_of = |i: usize| code[..i].matches('\n').count() + 1;
    for (dot, _) in code.match_indices('.') {
        let name: String = code[dot + 1..]
            .chars()
            .take_while(|&c| is_ident(c))
            .collect();
        if !code[dot + 1 + name.len()..].starts_with('(') {
            continue;
        }
        let stanza = STANZA_METHODS.contains(&name.as_str())
            || (name == "send" && !is_channel_send(code, dot));
        if stanza {
            found.push((line_of(dot), format!("{}.{name}(", receiver(code, dot))));
        }
    }
    found
}

#[test]
fn only_the_outbox_queues_stanzas_on_sessions_or_sends_them_to_other_nodes() {
    let (src, files) = server_source();
    let mut outside = Vec::new();
    let mut in_outbox = 0;
    for file in &files {
        let code = code_only(&std::fs::read_to_string(file).expect("read source"));
        let sends = stanza_sends(&code);
        if file.file_name().is_some_and(|n| n == "outbox.rs") {
            in_outbox += sends.len();
        } else if !may_send(file) {
            let rel = file
                .strip_prefix(&src)
                .unwrap_or(file)
                .display()
                .to_string();
            outside.extend(
                sends
                    .into_iter()
                    .map(|(l, call)| format!("{rel}:{l}: {call}")),
            );
        }
    }
    assert!(
        in_outbox >= STANZA_METHODS.len(),
        "the scan found only {in_outbox} sends in outbox.rs: is it where it should be?"
    );
    assert!(
        outside.is_empty(),
        "stanzas sent to a session or another node outside the outbox (call \
         crate::node::outbox instead): {outside:#?}"
    );
}

#[test]
fn the_send_scan_tells_handle_and_cluster_sends_from_channel_sends() {
    let code = code_only(
        "s.send(el);\nshared\n    .cluster\n    .send(node, to, xml);\n\
         self.cluster().forward(to, xml, kind);\nh.send_xml(bytes);\n\
         let _ = tx.send(got);\nout.send(Out::Raw(x)).await;\nlet _ = self.new_links.send(l);\n\
         done_tx.send(());\n// s.send(commented);\nlet m = \"s.send(quoted)\";\nfn send(x: u8) {}",
    );
    let found = stanza_sends(&code);
    assert_eq!(
        found,
        [
            (1, "s.send(".to_owned()),
            (4, "cluster.send(".to_owned()),
            (5, "cluster.forward(".to_owned()),
            (6, "h.send_xml(".to_owned()),
        ]
    );
}
