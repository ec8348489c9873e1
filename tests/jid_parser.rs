//! One JID parser (RFC 7622) at every edge.
//!
//! `presenced::protocol::jid` strips the root dot of a domainpart (RFC 7622 §3.2) before the `jid`
//! crate prepares the parts; the crate's own constructors do not. A server that parsed
//! some addresses one way and some the other would hold `bob@b.example.` and
//! `bob@b.example` as two JIDs (a block of one would not block the other). So no file
//! under `src/` other than `src/protocol/jid.rs` calls the crate's parsers: `Jid::new`,
//! `BareJid::new`, `FullJid::new`, their `from_str`, or `parse::<…Jid>()`.

mod scan;

use scan::server_source;

/// Whether a line of code (its `//` comment removed) calls one of the crate's parsers.
fn parses_a_jid(code: &str) -> bool {
    let calls = [
        "Jid::new(",
        "Jid::from_str(",
        "Jid as FromStr",
        "Jid as std::str::FromStr",
    ];
    if calls.iter().any(|c| code.contains(c)) {
        return true;
    }
    // `s.parse::<Jid>()`, `s.parse::<crate::jid::BareJid>()` and the like.
    code.match_indices("parse::<").any(|(i, _)| {
        let rest = &code[i + "parse::<".len()..];
        rest.split('>').next().is_some_and(|t| t.ends_with("Jid"))
    })
}

#[test]
fn only_the_protocol_jid_module_calls_the_jid_crates_parsers() {
    let (src, files) = server_source();
    assert!(files.len() > 50, "src/ not found: {}", src.display());
    let mut offenders = Vec::new();
    for file in files {
        if file == src.join("protocol").join("jid.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if parses_a_jid(code) {
                let rel = file.strip_prefix(&src).unwrap_or(&file);
                offenders.push(format!("src/{}:{}: {}", rel.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "parse JIDs with presenced::protocol::jid::{{parse, parse_bare, parse_full, bare}}:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_check_recognises_each_form() {
    for code in [
        "let j = Jid::new(s)?;",
        "crate::jid::BareJid::new(&t)",
        "FullJid::new(&format!(\"{u}@{d}/{r}\"))",
        "BareJid::from_str(s)",
        "s.parse::<crate::jid::FullJid>()",
        "s.parse::<Jid>().ok()",
    ] {
        assert!(parses_a_jid(code), "{code}");
    }
    for code in [
        "crate::jid::parse_bare(s)?",
        "Jid::from(bare)",
        "s.parse::<u16>()",
        "Subscription::parse(s)",
    ] {
        assert!(!parses_a_jid(code), "{code}");
    }
}
