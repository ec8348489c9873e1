//! No non-test function in `src/` is longer than 120 lines (counted from the line holding
//! `fn` to the line holding its closing brace), so that each one can be read whole.
//!
//! Every `.rs` file under `src/` is read, at any depth (the binary's `main.rs` too), so files
//! moving into folders change nothing. Comments, string literals (raw and byte strings
//! included) and char literals are blanked before braces are counted, so a `'{'` or a `"}"`
//! does not end a body. Items marked `#[cfg(test)]` or `#[test]` (a `mod tests { … }` block,
//! a test helper) are skipped, and so are files that a `#[cfg(test)] mod name;` declares.

use std::collections::BTreeSet;
mod scan;

use std::path::Path;

const MAX_LINES: usize = 120;

/// `text` with comments, string literals and char literals replaced by spaces; newlines are
/// kept so that byte offsets and line numbers stay those of the file.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let prev_ident = i > 0 && ident(b[i - 1]);
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |p| i + p);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                // Block comments nest in Rust.
                let (mut depth, mut j) = (0usize, i);
                while j < b.len() {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            b'r' | b'b' if !prev_ident && raw_string_hashes(&b[i..]).is_some() => {
                let (start, hashes) = raw_string_hashes(&b[i..]).expect("checked");
                let mut close = vec![b'"'];
                close.extend(std::iter::repeat_n(b'#', hashes));
                let body = i + start;
                let end = b[body..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| body + p + close.len());
                blank(&mut out, i, end);
                i = end;
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i, j + 1);
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('x', '\n', '\u{7f}', '"'), not a lifetime or label ('a).
                let len = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 3..].iter().position(|&c| c == b'\'').map(|p| p + 4)
                } else {
                    let ch_len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + ch_len) == Some(&b'\'')).then_some(ch_len + 2)
                };
                match len {
                    Some(len) => {
                        blank(&mut out, i, i + len);
                        i += len;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// For `r"…"`, `r#"…"#`, `br"…"`: the offset of the body and the number of `#`s.
fn raw_string_hashes(s: &[u8]) -> Option<(usize, usize)> {
    let mut i = usize::from(s.first() == Some(&b'b'));
    if s.get(i) != Some(&b'r') {
        return None;
    }
    i += 1;
    let hashes = s[i..].iter().take_while(|&&c| c == b'#').count();
    (s.get(i + hashes) == Some(&b'"')).then_some((i + hashes + 1, hashes))
}

/// Byte index just past the `}` matching the `{` at `open`.
fn matching_brace(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, &c) in code.iter().enumerate().skip(open) {
        match c {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Where the item after an attribute ending at `from` ends: at its first `;` outside
/// brackets, or after the block its first `{` opens.
fn item_end(code: &[u8], from: usize) -> usize {
    let mut depth = 0usize;
    let mut i = from;
    while i < code.len() {
        match code[i] {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth = depth.saturating_sub(1),
            b';' if depth == 0 => return i + 1,
            b'{' if depth == 0 => return matching_brace(code, i),
            _ => {}
        }
        i += 1;
    }
    code.len()
}

/// `code` with every item marked `#[cfg(test)]` or `#[test]` blanked, and the names of
/// out-of-line modules declared under `#[cfg(test)]` (`#[cfg(test)] mod name;`).
fn without_test_items(code: &str) -> (String, Vec<String>) {
    let mut out = code.as_bytes().to_vec();
    let mut test_modules = Vec::new();
    for marker in ["#[cfg(test)]", "#[test]"] {
        for (at, _) in code.match_indices(marker) {
            let end = item_end(code.as_bytes(), at + marker.len());
            let item = code[at + marker.len()..end].trim();
            if let Some(name) = item
                .split_whitespace()
                .skip_while(|w| *w != "mod")
                .nth(1)
                .and_then(|n| n.strip_suffix(';'))
            {
                test_modules.push(name.to_owned());
            }
            for c in &mut out[at..end] {
                if *c != b'\n' {
                    *c = b' ';
                }
            }
        }
    }
    let out = String::from_utf8(out).expect("only ASCII bytes were replaced");
    (out, test_modules)
}

/// Each `fn` with a body in `code`: its name, the 1-based line of `fn`, and its length in
/// lines up to the closing brace.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let b = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let line_of = |i: usize| b[..i].iter().filter(|&&c| c == b'\n').count() + 1;
    let mut found = Vec::new();
    for (at, _) in code.match_indices("fn") {
        if at > 0 && ident(b[at - 1]) || !b.get(at + 2).is_some_and(u8::is_ascii_whitespace) {
            continue;
        }
        let rest = code[at + 2..].trim_start();
        let name: String = rest
            .bytes()
            .take_while(|&c| ident(c))
            .map(char::from)
            .collect();
        // `fn(u8) -> u8` types and `fn $name` in macros are not items with a body here.
        if name.is_empty() {
            continue;
        }
        let sig = at + 2;
        let end = item_end(b, sig);
        if b[..end].last() != Some(&b'}') {
            continue; // a declaration without a body (a trait's required method)
        }
        found.push((name, line_of(at), line_of(end - 1) - line_of(at) + 1));
    }
    found
}

/// Every non-test function longer than `MAX_LINES`, as `path:line fn name (N lines)`.
fn long_functions(src: &Path) -> (Vec<String>, usize) {
    let (_, mut files) = scan::server_source();
    files.sort();
    let mut parsed = Vec::new();
    let mut test_files = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read source");
        let (code, test_modules) = without_test_items(&code_only(&text));
        // A module's children live in the folder named after it (`a.rs` → `a/`), or in its
        // own folder for `mod.rs`, `lib.rs` and `main.rs`.
        let stem = file.file_stem().expect("file name").to_string_lossy();
        let dir = file.parent().expect("in a folder");
        let children = if ["mod", "lib", "main"].contains(&stem.as_ref()) {
            dir.to_path_buf()
        } else {
            dir.join(stem.as_ref())
        };
        for name in test_modules {
            test_files.insert(children.join(format!("{name}.rs")));
            test_files.insert(children.join(&name).join("mod.rs"));
        }
        parsed.push((file.clone(), code));
    }
    let mut long = Vec::new();
    let mut count = 0;
    for (file, code) in parsed {
        if test_files.contains(&file) {
            continue;
        }
        let rel = file.strip_prefix(src).expect("under src");
        let rel = rel.to_string_lossy().replace('\\', "/");
        for (name, line, lines) in functions(&code) {
            count += 1;
            if lines > MAX_LINES {
                long.push(format!("src/{rel}:{line} fn {name} ({lines} lines)"));
            }
        }
    }
    (long, count)
}

#[test]
fn no_non_test_function_is_longer_than_120_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (long, count) = long_functions(&src);
    assert!(
        count > 500,
        "the scan found too few functions ({count}): is src/ where it should be?"
    );
    assert!(
        long.is_empty(),
        "functions longer than {MAX_LINES} lines (split them into steps):\n{}",
        long.join("\n")
    );
}

#[test]
fn braces_in_comments_strings_and_char_literals_are_not_counted() {
    let code = code_only(
        "fn a<'l>(x: &'l str) -> char {\n    // }\n    /* } /* } */ } */\n    let q = '\\'';\n    let s = \"}\\\"}\";\n    \
         let r = r#\"}\"#;\n    let b = br\"}\";\n    if x.is_empty() { '}' } else { '\\u{7d}' }\n}\n\
         fn b() {}\n",
    );
    let found = functions(&code);
    assert_eq!(
        found,
        [("a".to_owned(), 1, 9), ("b".to_owned(), 10, 1)],
        "{code}"
    );
}

#[test]
fn test_items_and_bodiless_declarations_are_skipped() {
    let code = code_only(
        "trait T {\n    fn required(&self);\n    fn provided(&self) {}\n}\n\
         type F = fn(u8) -> u8;\n#[cfg(test)]\nmod tests {\n    fn helper() {}\n}\n\
         #[test]\nfn check() {}\n#[cfg(test)]\nmod more;\nfn kept() {\n}\n",
    );
    let (code, test_modules) = without_test_items(&code);
    let names: Vec<String> = functions(&code).into_iter().map(|f| f.0).collect();
    assert_eq!(names, ["provided", "kept"]);
    assert_eq!(test_modules, ["more"]);
}
