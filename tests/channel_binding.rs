//! SCRAM channel binding against the real server over real TLS: `-PLUS` with RFC 9266
//! `tls-exporter` and its XEP-0440 advertisement on TLS 1.3, the RFC 5802 §6 gs2 rules
//! (a wrong binding and a `y` after `-PLUS` was offered fail not-authorized), XEP-0474's
//! `h=` checked as a client would, nothing of it on TLS 1.2 or over a WebSocket, and
//! slixmpp (which cannot read a TLS 1.3 exporter) still logging in without it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use common::*;
use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use presenced::protocol::xml::{parse_element, Element};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use sha1::Sha1;
use sha2::{Digest, Sha256};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Message;

const NS_SASL: &str = "urn:ietf:params:xml:ns:xmpp-sasl";
const NS_SASL2: &str = "urn:xmpp:sasl:2";
const NS_CB: &str = "urn:xmpp:sasl-cb:0";
const FRAMING: &str = "urn:ietf:params:xml:ns:xmpp-framing";

/// The client's own TLS exporter (RFC 9266 §2), and the negotiated version.
fn exporter(conn: &rustls::ClientConnection) -> (Option<rustls::ProtocolVersion>, Vec<u8>) {
    let data = conn
        .export_keying_material([0u8; 32], b"EXPORTER-Channel-Binding", Some(&[]))
        .expect("exporter");
    (conn.protocol_version(), data.to_vec())
}

/// STARTTLS over TLS 1.3 (rustls' default); the client and its exporter value.
async fn secured(ts: &TestServer) -> (Client, Vec<u8>) {
    let mut c = Client::tcp(ts).await;
    c.open(&ts.domain).await.expect("stream");
    let (c, (version, cb)) = c.starttls_inspect(ts, tls_client(&ts.cert), exporter).await;
    assert_eq!(version, Some(rustls::ProtocolVersion::TLSv1_3));
    (c, cb)
}

fn sasl1_mechanisms(features: &Element) -> Vec<String> {
    features
        .get_child("mechanisms", NS_SASL)
        .map(|m| m.elements().map(|m| m.text_content()).collect())
        .unwrap_or_default()
}

fn sasl2_mechanisms(features: &Element) -> Vec<String> {
    features
        .get_child("authentication", NS_SASL2)
        .map(|a| {
            a.elements()
                .filter(|m| m.name == "mechanism")
                .map(|m| m.text_content())
                .collect()
        })
        .unwrap_or_default()
}

fn cb_types(features: &Element) -> Option<Vec<String>> {
    features.get_child("sasl-channel-binding", NS_CB).map(|f| {
        f.elements()
            .filter_map(|c| c.get_attr("type").map(str::to_owned))
            .collect()
    })
}

#[derive(Clone, Copy, Debug)]
enum Hash {
    Sha1,
    Sha256,
}

impl Hash {
    fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            Hash::Sha1 => Sha1::digest(data).to_vec(),
            Hash::Sha256 => Sha256::digest(data).to_vec(),
        }
    }

    fn hmac(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        match self {
            Hash::Sha1 => {
                let mut m = Hmac::<Sha1>::new_from_slice(key).unwrap();
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
            Hash::Sha256 => {
                let mut m = Hmac::<Sha256>::new_from_slice(key).unwrap();
                m.update(data);
                m.finalize().into_bytes().to_vec()
            }
        }
    }

    fn salted(self, password: &str, salt: &[u8], iterations: u32) -> Vec<u8> {
        match self {
            Hash::Sha1 => {
                let mut out = [0u8; 20];
                pbkdf2::pbkdf2_hmac::<Sha1>(password.as_bytes(), salt, iterations, &mut out);
                out.to_vec()
            }
            Hash::Sha256 => {
                let mut out = [0u8; 32];
                pbkdf2::pbkdf2_hmac::<Sha256>(password.as_bytes(), salt, iterations, &mut out);
                out.to_vec()
            }
        }
    }
}

/// XEP-0474 (0.5.0) verification as a client does it, from the features it was shown.
fn expected_h(hash: Hash, features: &Element) -> String {
    let mut mechs = sasl1_mechanisms(features);
    mechs.sort();
    let mut s = mechs.join("\u{1e}");
    if let Some(mut types) = cb_types(features) {
        types.sort();
        s.push('\u{1f}');
        s.push_str(&types.join("\u{1e}"));
    }
    B64.encode(hash.digest(s.as_bytes()))
}

/// How a SCRAM exchange is framed and what the client puts in it.
struct Attempt<'a> {
    sasl2: bool,
    mechanism: &'a str,
    hash: Hash,
    gs2: &'a str,
    cb_data: &'a [u8],
}

/// A whole SCRAM exchange; the outcome element. Checks `h=` against the features and, on
/// success, the server signature.
async fn scram(c: &mut Client, user: &str, password: &str, a: Attempt<'_>) -> Element {
    let features = c.features.clone().expect("features");
    let ns = if a.sasl2 { NS_SASL2 } else { NS_SASL };
    let bare = format!("n={user},r=cbnonce{}", unique());
    let first = B64.encode(format!("{}{bare}", a.gs2));
    if a.sasl2 {
        c.send_raw(&format!(
            "<authenticate xmlns='{NS_SASL2}' mechanism='{}'>\
             <initial-response>{first}</initial-response></authenticate>",
            a.mechanism
        ))
        .await;
    } else {
        c.send_raw(&format!(
            "<auth xmlns='{NS_SASL}' mechanism='{}'>{first}</auth>",
            a.mechanism
        ))
        .await;
    }
    let challenge = c.next_stanza(WAIT).await.expect("challenge");
    if challenge.name == "failure" {
        return challenge;
    }
    assert!(challenge.is("challenge", ns), "{challenge}");
    let sf = String::from_utf8(B64.decode(challenge.text_content().trim()).unwrap()).unwrap();
    let attr = |k: &str| {
        sf.split(',')
            .find_map(|p| p.strip_prefix(&format!("{k}=")))
            .map(str::to_owned)
    };
    assert_eq!(attr("h"), Some(expected_h(a.hash, &features)), "{sf}");
    let salt = B64.decode(attr("s").unwrap()).unwrap();
    let salted = a
        .hash
        .salted(password, &salt, attr("i").unwrap().parse().unwrap());
    let client_key = a.hash.hmac(&salted, b"Client Key");
    let stored_key = a.hash.digest(&client_key);
    let mut cbind = a.gs2.as_bytes().to_vec();
    cbind.extend_from_slice(a.cb_data);
    let without_proof = format!("c={},r={}", B64.encode(cbind), attr("r").unwrap());
    let auth_message = format!("{bare},{sf},{without_proof}");
    let signature = a.hash.hmac(&stored_key, auth_message.as_bytes());
    let proof: Vec<u8> = client_key
        .iter()
        .zip(&signature)
        .map(|(k, s)| k ^ s)
        .collect();
    let response = B64.encode(format!("{without_proof},p={}", B64.encode(proof)));
    c.send_raw(&format!("<response xmlns='{ns}'>{response}</response>"))
        .await;
    let outcome = c.next_stanza(WAIT).await.expect("outcome");
    if outcome.name == "success" {
        let data = if a.sasl2 {
            outcome
                .get_child("additional-data", NS_SASL2)
                .unwrap()
                .text_content()
        } else {
            outcome.text_content()
        };
        let server_key = a.hash.hmac(&salted, b"Server Key");
        let want = a.hash.hmac(&server_key, auth_message.as_bytes());
        assert_eq!(
            B64.decode(data.trim()).unwrap(),
            format!("v={}", B64.encode(want)).into_bytes()
        );
    }
    outcome
}

/// TLS 1.3 by STARTTLS and by direct TLS: both `-PLUS` in SASL1 and SASL2, and XEP-0440
/// naming `tls-exporter`.
#[tokio::test]
async fn plus_and_xep_0440_are_offered_over_tls_1_3() {
    let ts = TestServer::start(|_| {}).await;
    let (c, _) = secured(&ts).await;
    let direct = Client::direct_tls(&ts).await;
    for features in [c.features.unwrap(), direct.features.unwrap()] {
        let sasl1 = sasl1_mechanisms(&features);
        assert_eq!(&sasl1[..2], ["SCRAM-SHA-256-PLUS", "SCRAM-SHA-1-PLUS"]);
        assert_eq!(sasl1, sasl2_mechanisms(&features));
        assert_eq!(cb_types(&features), Some(vec!["tls-exporter".to_owned()]));
    }
    ts.stop().await;
}

/// SCRAM-SHA-256-PLUS and SCRAM-SHA-1-PLUS with the connection's exporter succeed, over
/// SASL1 (then bind after the restart) and SASL2.
#[tokio::test]
async fn plus_login_with_the_right_binding_succeeds() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "wonder land").await;
    for (mechanism, hash, sasl2) in [
        ("SCRAM-SHA-256-PLUS", Hash::Sha256, false),
        ("SCRAM-SHA-1-PLUS", Hash::Sha1, false),
        ("SCRAM-SHA-256-PLUS", Hash::Sha256, true),
        ("SCRAM-SHA-1-PLUS", Hash::Sha1, true),
    ] {
        let (mut c, cb) = secured(&ts).await;
        let attempt = Attempt {
            sasl2,
            mechanism,
            hash,
            gs2: "p=tls-exporter,,",
            cb_data: &cb,
        };
        let outcome = scram(&mut c, "alice", "wonder land", attempt).await;
        assert_eq!(
            outcome.name, "success",
            "{mechanism} sasl2={sasl2}: {outcome}"
        );
        if !sasl2 {
            c.restart_stream();
            c.open(&ts.domain).await.expect("stream after SASL");
        }
        let jid = c.bind("cb").await.expect("bind");
        assert_eq!(jid, format!("{}/cb", ts.jid("alice")));
        c.close().await;
    }
    ts.stop().await;
}

/// Binding data that is not this connection's (another connection's exporter, or none) is
/// RFC 5802's channel-bindings-dont-match: not-authorized.
#[tokio::test]
async fn a_wrong_binding_fails_not_authorized() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "pw").await;
    let (_other, other_cb) = secured(&ts).await;
    for sasl2 in [false, true] {
        for cb in [other_cb.as_slice(), &[]] {
            let (mut c, _) = secured(&ts).await;
            let attempt = Attempt {
                sasl2,
                mechanism: "SCRAM-SHA-256-PLUS",
                hash: Hash::Sha256,
                gs2: "p=tls-exporter,,",
                cb_data: cb,
            };
            let outcome = scram(&mut c, "alice", "pw", attempt).await;
            assert_eq!(outcome.name, "failure", "{outcome}");
            assert_eq!(condition(&outcome), "not-authorized", "{outcome}");
        }
    }
    ts.stop().await;
}

/// RFC 5802 §6: `y` (client binds, thinks the server cannot) after `-PLUS` was offered is a
/// downgrade and fails not-authorized; `n` with the same mechanism logs in.
#[tokio::test]
async fn y_after_plus_was_offered_fails_and_n_succeeds() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "pw").await;
    for sasl2 in [false, true] {
        let (mut c, _) = secured(&ts).await;
        let attempt = Attempt {
            sasl2,
            mechanism: "SCRAM-SHA-256",
            hash: Hash::Sha256,
            gs2: "y,,",
            cb_data: &[],
        };
        let outcome = scram(&mut c, "alice", "pw", attempt).await;
        assert_eq!(outcome.name, "failure", "{outcome}");
        assert_eq!(condition(&outcome), "not-authorized", "{outcome}");
    }
    let (mut c, _) = secured(&ts).await;
    let attempt = Attempt {
        sasl2: true,
        mechanism: "SCRAM-SHA-1",
        hash: Hash::Sha1,
        gs2: "n,,",
        cb_data: &[],
    };
    let outcome = scram(&mut c, "alice", "pw", attempt).await;
    assert_eq!(outcome.name, "success", "{outcome}");
    ts.stop().await;
}

/// TLS 1.2: no `-PLUS`, no XEP-0440 (RFC 9266 §3), so `y` is accepted and h= has no
/// channel-binding part; a `-PLUS` mechanism is invalid-mechanism.
#[tokio::test]
async fn tls_1_2_offers_no_plus() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "pw").await;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&ts.cert).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let tls12 = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS12])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let mut c = Client::tcp(&ts).await;
    c.open(&ts.domain).await.expect("stream");
    let (mut c, (version, _)) = c.starttls_inspect(&ts, tls12, exporter).await;
    assert_eq!(version, Some(rustls::ProtocolVersion::TLSv1_2));
    let features = c.features.clone().unwrap();
    assert!(sasl1_mechanisms(&features)
        .iter()
        .all(|m| !m.ends_with("-PLUS")));
    assert_eq!(cb_types(&features), None, "{features}");
    let attempt = Attempt {
        sasl2: false,
        mechanism: "SCRAM-SHA-256-PLUS",
        hash: Hash::Sha256,
        gs2: "p=tls-exporter,,",
        cb_data: &[0; 32],
    };
    let outcome = scram(&mut c, "alice", "pw", attempt).await;
    assert_eq!(condition(&outcome), "invalid-mechanism", "{outcome}");
    let attempt = Attempt {
        sasl2: false,
        mechanism: "SCRAM-SHA-256",
        hash: Hash::Sha256,
        gs2: "y,,",
        cb_data: &[],
    };
    let outcome = scram(&mut c, "alice", "pw", attempt).await;
    assert_eq!(outcome.name, "success", "{outcome}");
    ts.stop().await;
}

/// RFC 7395 over the server's own TLS 1.3 (wss): still no `-PLUS` and no XEP-0440, as
/// the `binding` module decides for every WebSocket.
#[tokio::test]
async fn websocket_offers_no_plus() {
    let ts = TestServer::start(|c| c.http.tls = true).await;
    let tcp = tokio::net::TcpStream::connect(ts.http_addr())
        .await
        .unwrap();
    let connector = tokio_rustls::TlsConnector::from(tls_client(&ts.cert));
    let name = ServerName::try_from(ts.domain.clone()).unwrap();
    let tls = connector.connect(name, tcp).await.expect("TLS handshake");
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    let url = format!("wss://{}{}", ts.domain, ts.config.http.websocket_path);
    let mut req = url.into_client_request().unwrap();
    req.headers_mut()
        .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("xmpp"));
    let (mut ws, _) = tokio_tungstenite::client_async(req, tls)
        .await
        .expect("WebSocket handshake");
    let open = format!("<open xmlns='{FRAMING}' to='{}' version='1.0'/>", ts.domain);
    ws.send(Message::Text(open.into())).await.unwrap();
    let mut features = None;
    while features.is_none() {
        let m = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("message")
            .expect("open")
            .expect("frame");
        if let Message::Text(t) = m {
            let el = parse_element(&t).expect("one element");
            if el.name == "features" {
                features = Some(el);
            }
        }
    }
    let features = features.unwrap();
    let mechs = sasl1_mechanisms(&features);
    assert!(mechs.contains(&"SCRAM-SHA-256".to_owned()), "{features}");
    assert!(mechs.iter().all(|m| !m.ends_with("-PLUS")), "{features}");
    assert_eq!(sasl2_mechanisms(&features), mechs);
    assert_eq!(cb_types(&features), None, "{features}");
    ts.stop().await;
}

/// slixmpp (a client this project did not write) cannot read a TLS 1.3 exporter (Python's
/// ssl has only tls-unique): offered `-PLUS`, it falls back to plain SCRAM with `n` and
/// logs in, checking the server signature over a server-first that carries `h=`.
#[tokio::test]
async fn slixmpp_picks_a_mechanism_without_plus_and_logs_in() {
    let ts = TestServer::start(|_| {}).await;
    ts.add_user("alice", "wonder land").await;
    let args = vec![
        ts.addr.ip().to_string(),
        ts.addr.port().to_string(),
        ts.domain.clone(),
        "alice".to_owned(),
        "wonder land".to_owned(),
        "any".to_owned(),
        ts.cert.display().to_string(),
    ];
    let out = run_client_script("login.py", &args, Duration::from_secs(40)).await;
    assert_eq!(out.code, Some(0), "slixmpp failed: {out:?}");
    let mech = out.get("mechanism").unwrap_or_default();
    assert!(
        mech.starts_with("SCRAM-") && !mech.ends_with("-PLUS"),
        "{out:?}"
    );
    assert!(out
        .get("jid")
        .is_some_and(|j| j.starts_with(&format!("{}/", ts.jid("alice")))));
    ts.stop().await;
}
