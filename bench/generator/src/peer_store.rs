//! Provisioning the peers by writing their storage instead of registering over XMPP.
//!
//! Registering N users in-band and exchanging their subscriptions over XMPP takes Prosody
//! tens of minutes at N = 1,000 on a loaded machine (hours at 10,000). Both peers can be
//! given the same users and rosters as files instead:
//!
//! * Prosody's default file storage (`storage = "internal"`, `util.datamanager`):
//!   `DIR/<host>/accounts/<user>.dat` and `DIR/<host>/roster/<user>.dat`, each a Lua chunk
//!   `return { ... };`, names %-encoded as datamanager does. Accounts are what
//!   `authentication = "internal_hashed"` keeps: SCRAM-SHA-1 `stored_key` and `server_key`
//!   (hex), `salt` (a UUID string, as Prosody generates) and `iteration_count`.
//! * ejabberd reads the same directory with `ejabberdctl import_prosody DIR` into Mnesia
//!   (its SCRAM record takes the keys and salt as they are, hash SHA-1).
//!
//! The graph is [`ContactGraph`]'s, every item `both` (mutual subscriptions, as the XMPP
//! provisioning ends: RFC 6121 §3), and the client's SaltedPassword cache is filled from the
//! salts written, as a provisioning login would fill it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rand::Rng;

use crate::graph::ContactGraph;
use crate::scram::{SaltCache, ScramHash};

/// What to write: users `<user_prefix><i>` @ `domain` with password `<password_prefix><i>`.
pub struct Accounts<'a> {
    pub domain: &'a str,
    pub user_prefix: &'a str,
    pub password_prefix: &'a str,
    /// SCRAM iteration count stored with each account (each server's own default:
    /// Prosody 10,000, ejabberd 4,096).
    pub iterations: u32,
}

/// Prosody's `util.datamanager` name encoding: every character that is not a letter or a
/// digit becomes `%xx` (lower-case hex of each byte).
pub fn path_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02x}");
        }
    }
    out
}

/// A Lua string literal holding exactly `s` (bytes other than printable ASCII, `"` and `\`
/// as decimal escapes, which every Lua version and ejabberd's Lua reader understand).
pub fn lua_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for b in s.bytes() {
        match b {
            b'"' | b'\\' => {
                out.push('\\');
                out.push(b as char);
            }
            0x20..=0x7e => out.push(b as char),
            _ => {
                let _ = write!(out, "\\{b:03}");
            }
        }
    }
    out.push('"');
    out
}

/// Lower-case hex, as Prosody stores the SCRAM keys (`util.hex`).
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|x| format!("{x:02x}")).collect()
}

/// A Prosody-style UUID (version 4, as `util.uuid.generate`): the salt it stores.
fn uuid_salt() -> String {
    let b: [u8; 16] = rand::thread_rng().gen();
    let h = hex(&b);
    // Version 4 and the RFC 4122 variant, as util.uuid sets them.
    let variant = ["8", "9", "a", "b"][usize::from(b[8] & 3)];
    format!(
        "{}-{}-4{}-{variant}{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

/// The accounts file of one user: SCRAM-SHA-1 credentials for `password`.
fn account_file(user: &str, password: &str, iterations: u32, cache: &SaltCache) -> String {
    let salt = uuid_salt();
    let salted = cache.salted(user, password, ScramHash::Sha1, salt.as_bytes(), iterations);
    let (stored_key, server_key) = ScramHash::Sha1.server_keys(&salted);
    format!(
        "return {{\n\t[\"iteration_count\"] = {iterations};\n\t[\"salt\"] = {};\n\t\
         [\"server_key\"] = {};\n\t[\"stored_key\"] = {};\n}};\n",
        lua_string(&salt),
        lua_string(&hex(&server_key)),
        lua_string(&hex(&stored_key)),
    )
}

/// The roster file of one user: every contact `both`, no pending requests.
fn roster_file(contacts: &[String]) -> String {
    let mut out = String::from(
        "return {\n\t[false] = {\n\t\t[\"pending\"] = {};\n\t\t[\"version\"] = 1;\n\t};\n",
    );
    for jid in contacts {
        let _ = write!(
            out,
            "\t[{}] = {{\n\t\t[\"groups\"] = {{}};\n\t\t[\"subscription\"] = \"both\";\n\t}};\n",
            lua_string(jid)
        );
    }
    out.push_str("};\n");
    out
}

/// Writes accounts and rosters of every user of `graph` under `dir` (replacing files of the
/// same users) and fills `cache`; returns the host directory written. The PBKDF2 of each
/// account is spread over the machine's cores.
pub fn write_prosody_store(
    dir: &Path,
    accounts: &Accounts<'_>,
    graph: &ContactGraph,
    cache: &SaltCache,
) -> Result<PathBuf, String> {
    let host_dir = dir.join(path_encode(accounts.domain));
    let (acc_dir, roster_dir) = (host_dir.join("accounts"), host_dir.join("roster"));
    for d in [&acc_dir, &roster_dir] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let n = graph.len();
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get() as u32);
    let write_one = |i: u32| -> Result<(), String> {
        let user = format!("{}{i}", accounts.user_prefix);
        let password = format!("{}{i}", accounts.password_prefix);
        let contacts: Vec<String> = graph
            .contacts(i)
            .into_iter()
            .map(|c| format!("{}{c}@{}", accounts.user_prefix, accounts.domain))
            .collect();
        let name = format!("{}.dat", path_encode(&user));
        for (path, text) in [
            (
                acc_dir.join(&name),
                account_file(&user, &password, accounts.iterations, cache),
            ),
            (roster_dir.join(&name), roster_file(&contacts)),
        ] {
            std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let write_one = &write_one;
                s.spawn(move || (t..n).step_by(threads as usize).try_for_each(write_one))
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| "a writer thread panicked".to_string())?
        })
    })?;
    Ok(host_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_encoded_as_prosody_datamanager_does() {
        assert_eq!(path_encode("bench.example"), "bench%2eexample");
        assert_eq!(path_encode("bench12"), "bench12");
        assert_eq!(path_encode("a_b-c@d"), "a%5fb%2dc%40d");
    }

    #[test]
    fn lua_strings_escape_quotes_backslashes_and_control_bytes() {
        assert_eq!(lua_string("plain-1"), "\"plain-1\"");
        assert_eq!(lua_string("a\"b\\c\nd"), "\"a\\\"b\\\\c\\010d\"");
        assert_eq!(lua_string("é"), "\"\\195\\169\"");
    }

    #[test]
    fn salts_are_version_4_uuids() {
        let s = uuid_salt();
        let parts: Vec<&str> = s.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'), "{s}");
        assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"), "{s}");
    }

    /// Every user gets an account whose keys match its password and salt, and a roster of
    /// exactly its graph contacts, all `both`; the cache then serves the login's
    /// SaltedPassword without a PBKDF2.
    #[test]
    fn every_user_gets_credentials_for_its_password_and_its_contacts_as_both() {
        let dir = std::env::temp_dir().join(format!("peer-store-{}", std::process::id()));
        let graph = ContactGraph::new(6, 3, None).expect("graph");
        let cache = SaltCache::default();
        let accounts = Accounts {
            domain: "bench.example",
            user_prefix: "bench",
            password_prefix: "bench-pass-",
            iterations: 64,
        };
        let host = write_prosody_store(&dir, &accounts, &graph, &cache).expect("written");
        assert_eq!(host, dir.join("bench%2eexample"));
        assert_eq!(cache.len(), 6);
        for i in 0..6 {
            let acc = std::fs::read_to_string(host.join(format!("accounts/bench{i}.dat")))
                .expect("account file");
            let field = |k: &str| {
                let key = format!("[\"{k}\"] = ");
                let at = acc.find(&key).expect(k) + key.len();
                acc[at..acc[at..].find(';').expect(";") + at]
                    .trim_matches('"')
                    .to_owned()
            };
            assert_eq!(field("iteration_count"), "64");
            let salted = fresh_salted(&format!("bench-pass-{i}"), &field("salt"), 64);
            let (stored, server) = ScramHash::Sha1.server_keys(&salted);
            assert_eq!(field("stored_key"), hex(&stored));
            assert_eq!(field("server_key"), hex(&server));
            let roster = std::fs::read_to_string(host.join(format!("roster/bench{i}.dat")))
                .expect("roster file");
            assert!(roster.starts_with("return {\n\t[false] = {"), "{roster}");
            assert_eq!(roster.matches("\"both\"").count(), 3, "{roster}");
            for c in graph.contacts(i) {
                assert!(
                    roster.contains(&format!("[\"bench{c}@bench.example\"]")),
                    "{roster}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// SaltedPassword from a fresh cache (the test's own derivation, not the one filled).
    fn fresh_salted(password: &str, salt: &str, iterations: u32) -> Vec<u8> {
        SaltCache::default().salted("x", password, ScramHash::Sha1, salt.as_bytes(), iterations)
    }
}
