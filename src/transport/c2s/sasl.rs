//! The SASL exchange of a client stream (RFC 6120 §6): SCRAM-SHA-256, SCRAM-SHA-1 and PLAIN,
//! the back-off per source address and account, and the failures that end the stream. The mechanisms are
//! [`crate::protocol::sasl`]. One exchange, two framings: RFC 6120 SASL and XEP-0388 SASL2
//! (whose request and success are read and written by `sasl2`).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;

use super::negotiate::Offer;
use super::sasl2::{Request, NS_SASL2};
use super::{limits, Authenticated, Fail, Halt, Sasl2, Secured};
use crate::protocol::conditions::SaslCondition;
use crate::protocol::error::{StreamCondition, StreamError};
use std::net::SocketAddr;

use crate::node::Shared;
use crate::protocol::jid::{BareJid, Jid};
use crate::protocol::sasl::scram::{self, ScramHash, ScramServer};
use crate::protocol::xml::{self as x, Element};

/// How the elements of one SASL exchange are framed: RFC 6120 §6.4 (`<auth/>`, restart
/// after `<success/>`) or XEP-0388 SASL2 (`<authenticate/>`, the stream goes on). The
/// mechanisms, the back-off and the failure count are the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Sasl1,
    Sasl2,
}

impl Framing {
    fn ns(self) -> &'static str {
        match self {
            Framing::Sasl1 => x::NS_SASL,
            Framing::Sasl2 => NS_SASL2,
        }
    }

    /// `<challenge/>`, base64 (RFC 6120 §6.4.2; XEP-0388 "Challenges and Responses": the
    /// same in its namespace).
    fn challenge(self, data: &[u8]) -> Element {
        let c = Element::new("challenge", self.ns());
        if data.is_empty() {
            c
        } else {
            c.text(B64.encode(data))
        }
    }

    /// `<failure/>` with the RFC 6120 §6.5 condition (XEP-0388 "Failure": in the SASL
    /// namespace, inside the SASL2 failure).
    fn failure(self, condition: SaslCondition) -> Element {
        Element::new("failure", self.ns()).child(Element::new(condition.as_str(), x::NS_SASL))
    }
}

/// A mechanism exchange that succeeded: the account's localpart and the data `<success/>`
/// carries (SCRAM's server-final, RFC 5802 §5.1).
pub(super) struct Authed {
    pub(super) user: String,
    pub(super) additional: Option<Vec<u8>>,
    /// The XEP-0484 token a FAST login used.
    pub(super) token: Option<super::fast::Used>,
}

/// What one SASL element asked for, before its mechanism runs.
struct Attempt {
    framing: Framing,
    mechanism: String,
    initial: Vec<u8>,
    sasl2: Option<Box<Request>>,
}

impl Secured {
    /// RFC 6120 §6: the features offer the SASL mechanisms, XEP-0388 SASL2 with them (and
    /// XEP-0077 registration). After SASL1 `<success/>` both sides restart the stream
    /// (§6.4.6); after SASL2 the stream goes on (XEP-0388 "Success") and its `<success/>` waits
    /// for what the `<authenticate/>` asked inline (`Authenticated::bind`). Either way the
    /// reader takes the limits of an authenticated peer.
    pub(super) async fn authenticate(mut self) -> Result<Authenticated, Halt> {
        step!(self.link, self.link.open(Offer::Sasl));
        let (authed, sasl2) = step!(self.link, self.sasl());
        let token = match &sasl2 {
            Some(request) => self.fast_token(&authed, request).await,
            None => String::new(),
        };
        let Secured { mut link } = self;
        let limits = limits(&link.shared, true);
        let sasl2 = match sasl2 {
            Some(request) => {
                link.stream.set_limits(limits);
                link.user_agent = request.user_agent.as_deref().map(Into::into);
                Some(Box::new(Sasl2 {
                    request: *request,
                    additional: authed.additional,
                    token,
                }))
            }
            None => {
                link.stream = link.stream.restart_with(limits);
                None
            }
        };
        Ok(Authenticated {
            link,
            user: authed.user,
            sasl2,
        })
    }

    async fn sasl_failure(
        &mut self,
        framing: Framing,
        condition: SaslCondition,
        failures: &mut u32,
    ) -> Result<(), Fail> {
        self.link.write_el(&framing.failure(condition)).await?;
        *failures += 1;
        self.link.shared.metrics.auth_failure();
        tracing::info!(peer = %self.link.peer, %condition, failures = *failures, "SASL failure");
        if *failures >= self.link.shared.live.get().limits.max_auth_failures {
            // RFC 6120 §6.4.5: after the configured number of retries, end the stream.
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::PolicyViolation,
                "too many failed authentication attempts",
            )));
        }
        Ok(())
    }

    /// The next authentication attempt, SASL1 or SASL2; XEP-0077 registration is answered
    /// on the way.
    async fn attempt(&mut self) -> Result<Result<Attempt, (Framing, SaslCondition)>, Fail> {
        loop {
            let el = self.link.next_element().await?;
            if el.is("iq", x::NS_CLIENT) {
                if let Some(q) = el.get_child("query", x::NS_REGISTER) {
                    let q = q.clone();
                    self.register(&el, &q).await?;
                    continue;
                }
            }
            let (framing, mechanism, initial, sasl2) = if el.is("auth", x::NS_SASL) {
                let mech = el.get_attr("mechanism").unwrap_or("").to_owned();
                (Framing::Sasl1, mech, el.text_content(), None)
            } else if el.is("authenticate", NS_SASL2) {
                let request = Request::parse(&el)
                    .map_err(|m| Fail::Stream(StreamError::new(StreamCondition::BadFormat, m.0)))?;
                if request
                    .user_agent
                    .as_ref()
                    .is_some_and(|id| id.is_empty() || id.len() > super::sasl2::MAX_USER_AGENT_ID)
                {
                    // RFC 6120 §6.5.8: a request the mechanism's rules cannot take.
                    return Ok(Err((Framing::Sasl2, SaslCondition::MalformedRequest)));
                }
                let (mech, initial) = (request.mechanism.clone(), request.initial.clone());
                (Framing::Sasl2, mech, initial, Some(Box::new(request)))
            } else {
                // RFC 6120 §4.9.3.12: stanzas before authentication.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::NotAuthorized,
                    "authenticate first",
                )));
            };
            let Some(initial) = decode_b64(&initial) else {
                return Ok(Err((framing, SaslCondition::IncorrectEncoding)));
            };
            return Ok(Ok(Attempt {
                framing,
                mechanism,
                initial,
                sasl2,
            }));
        }
    }

    /// RFC 6120 §6: SASL with SCRAM-SHA-256, SCRAM-SHA-1, or PLAIN, framed as SASL1 or
    /// XEP-0388 SASL2, up to the account's localpart; also XEP-0077 registration. SASL1's
    /// `<success/>` is written here; SASL2's comes with the inline results.
    async fn sasl(&mut self) -> Result<(Authed, Option<Box<Request>>), Fail> {
        let mut failures = 0u32;
        loop {
            let attempt = match self.attempt().await? {
                Ok(a) => a,
                Err((framing, condition)) => {
                    self.sasl_failure(framing, condition, &mut failures).await?;
                    continue;
                }
            };
            let Attempt {
                framing,
                mechanism: mech,
                initial,
                sasl2,
            } = attempt;
            // SCRAM and its -PLUS variants as this stream offers them (`binding`).
            let scram = self.link.scram_server(&mech);
            let outcome = match (scram, mech.as_str(), sasl2.as_deref()) {
                (Some(server), _, _) => self.scram(framing, server, initial).await?,
                // Only a `Secured` stream gets here: PLAIN never crosses the wire in the clear.
                (None, "PLAIN", _) if self.link.shared.config.auth.allow_plain => {
                    self.plain(&initial).await?
                }
                // XEP-0484: a token is only used inside a SASL2 authentication.
                (None, m, Some(request))
                    if crate::protocol::sasl::ht::offered(m)
                        && self.link.shared.config.auth.fast =>
                {
                    self.fast(m, &initial, request).await?
                }
                _ => Err(SaslCondition::InvalidMechanism),
            };
            match outcome {
                Ok(authed) => {
                    let user = &authed.user;
                    tracing::info!(peer = %self.link.peer, %user, mech, ?framing, "authenticated");
                    if framing == Framing::Sasl1 {
                        let mut ok = Element::new("success", x::NS_SASL);
                        if let Some(data) = &authed.additional {
                            ok = ok.text(B64.encode(data));
                        }
                        self.link.write_el(&ok).await?;
                    }
                    return Ok((authed, sasl2));
                }
                Err(condition) => self.sasl_failure(framing, condition, &mut failures).await?,
            }
        }
    }

    /// SCRAM exchange (RFC 5802 §5). Returns the localpart or a SASL failure condition.
    async fn scram(
        &mut self,
        framing: Framing,
        mut server: ScramServer,
        mut initial: Vec<u8>,
    ) -> Result<Result<Authed, SaslCondition>, Fail> {
        let hash = server.hash();
        if initial.is_empty() {
            // RFC 6120 §6.4.2: no initial response, so ask for it with an empty challenge.
            self.link.write_el(&framing.challenge(&[])).await?;
            initial = match self.sasl_response(framing).await? {
                Some(r) => r,
                None => return Ok(Err(SaslCondition::Aborted)),
            };
        }
        let first = match server.client_first(&initial) {
            Ok(f) => f,
            Err(e) => return Ok(Err(e.condition())),
        };
        let account = self.link.account(&first.username);
        let mut seen = super::backoff::Seen::default();
        if let Some(jid) = &account {
            match auth_locked(&self.link.shared, self.link.peer, jid).await {
                Some(s) => seen = s,
                None => return Ok(Err(SaslCondition::NotAuthorized)),
            }
            server.set_fake_salt_name(jid.as_str());
        }
        let creds = match &account {
            Some(jid) => self
                .link
                .shared
                .store
                .scram_credentials(
                    crate::protocol::jid::node_str(&Jid::from(jid.clone())),
                    jid.domain().as_str(),
                    hash,
                )
                .await
                .map_err(|e| {
                    tracing::error!(peer = %self.link.peer, error = %e, "credential lookup failed");
                    Fail::Stream(StreamError::new(
                        StreamCondition::InternalServerError,
                        "storage unavailable",
                    ))
                })?,
            None => None,
        };
        if let (Some(authz), Some(jid)) = (&first.authzid, &account) {
            if authz != jid.as_str() {
                return Ok(Err(SaslCondition::InvalidAuthzid));
            }
        }
        let challenge = server.server_first(creds.as_ref());
        self.link.write_el(&framing.challenge(&challenge)).await?;
        let Some(response) = self.sasl_response(framing).await? else {
            return Ok(Err(SaslCondition::Aborted));
        };
        let verdict = server.client_final(&response);
        if let Some(jid) = &account {
            let ok = verdict.is_ok() && creds.is_some();
            auth_checked(&self.link.shared, self.link.peer, jid, ok, seen).await;
        }
        match verdict {
            Ok(server_final) if creds.is_some() => Ok(Ok(Authed {
                user: account
                    .map(|j| crate::protocol::jid::node_str(&Jid::from(j)).to_owned())
                    .unwrap_or_default(),
                additional: Some(server_final),
                token: None,
            })),
            Ok(_) => Ok(Err(SaslCondition::NotAuthorized)),
            Err(e) => Ok(Err(e.condition())),
        }
    }

    /// Reads `<response/>`; `None` for `<abort/>` (RFC 6120 §6.4.4, XEP-0388 "Aborting").
    async fn sasl_response(&mut self, framing: Framing) -> Result<Option<Vec<u8>>, Fail> {
        let el = self.link.next_element().await?;
        if el.is("abort", framing.ns()) {
            return Ok(None);
        }
        if !el.is("response", framing.ns()) {
            return Err(Fail::Stream(StreamError::new(
                StreamCondition::NotAuthorized,
                "expected a SASL response",
            )));
        }
        decode_b64(&el.text_content()).map(Some).ok_or_else(|| {
            Fail::Stream(StreamError::new(
                StreamCondition::BadFormat,
                "SASL response is not base64",
            ))
        })
    }

    /// SASL PLAIN (RFC 4616), checked against the stored SCRAM-SHA-256 credentials.
    async fn plain(&mut self, msg: &[u8]) -> Result<Result<Authed, SaslCondition>, Fail> {
        let mut parts = msg.split(|b| *b == 0);
        let (Some(authz), Some(authc), Some(pass), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Ok(Err(SaslCondition::MalformedRequest));
        };
        let (Ok(authz), Ok(authc), Ok(pass)) = (
            std::str::from_utf8(authz),
            std::str::from_utf8(authc),
            std::str::from_utf8(pass),
        ) else {
            return Ok(Err(SaslCondition::MalformedRequest));
        };
        let Some(jid) = self.link.account(authc) else {
            return Ok(Err(SaslCondition::NotAuthorized));
        };
        if !authz.is_empty() && authz != jid.as_str() {
            return Ok(Err(SaslCondition::InvalidAuthzid));
        }
        let Some(seen) = auth_locked(&self.link.shared, self.link.peer, &jid).await else {
            return Ok(Err(SaslCondition::NotAuthorized));
        };
        let local = crate::protocol::jid::node_str(&Jid::from(jid.clone())).to_owned();
        let creds = self
            .link
            .shared
            .store
            .scram_credentials(&local, jid.domain().as_str(), ScramHash::Sha256)
            .await
            .map_err(|_| {
                Fail::Stream(StreamError::new(
                    StreamCondition::InternalServerError,
                    "storage",
                ))
            })?;
        // An unknown user is checked against made-up credentials with the configured
        // iterations, so both cost the same PBKDF2 work and the time taken does not tell
        // whether the account exists.
        let (creds, exists) = match creds {
            Some(c) => (c, true),
            None => (
                scram::fake_credentials(
                    ScramHash::Sha256,
                    jid.as_str(),
                    &self.link.shared.fake_salt_secret,
                    self.link.shared.config.auth.scram_iterations,
                ),
                false,
            ),
        };
        let pass = pass.to_owned();
        // PBKDF2 is CPU-heavy: keep it off the async workers.
        let matched = tokio::task::spawn_blocking(move || {
            scram::verify_plain(ScramHash::Sha256, &creds, &pass)
        })
        .await
        .unwrap_or(false);
        let ok = matched && exists;
        auth_checked(&self.link.shared, self.link.peer, &jid, ok, seen).await;
        if !ok {
            return Ok(Err(SaslCondition::NotAuthorized));
        }
        Ok(Ok(Authed {
            user: local,
            additional: None,
            token: None,
        }))
    }
}

fn decode_b64(text: &str) -> Option<Vec<u8>> {
    let t = text.trim();
    // RFC 6120 §6.4.2: "=" is an empty initial response.
    if t.is_empty() || t == "=" {
        return Some(Vec::new());
    }
    B64.decode(t).ok()
}

/// Back-off per source address and account, the same for every mechanism: `None` if
/// `jid` is locked for this peer's address after repeated failures from it (on this
/// node, or with Redis on any node, [`super::backoff`]), and the attempt must be refused
/// without a password check; else what Redis said, for [`auth_checked`].
/// The refusal is RFC 6120 §6.5.10 not-authorized ("some generic authentication
/// failure ... the receiving entity does not wish to disclose specific information
/// about the cause"): §6.5.11 temporary-auth-failure is for an error within the
/// server, and would tell a guesser which answers to ignore.
pub(super) async fn auth_locked(
    shared: &Shared,
    peer: SocketAddr,
    jid: &BareJid,
) -> Option<super::backoff::Seen> {
    let ip = peer.ip();
    // This node's own table first: a pair it has locked costs no Redis round trip.
    let here = shared
        .auth_backoff
        .locked(ip, jid.as_str(), shared.liveness.clock.instant());
    let left = match here {
        Some(left) => left,
        None => {
            let seen = super::backoff::seen(shared, ip, jid.as_str()).await;
            match seen.locked {
                Some(left) => left,
                None => return Some(seen),
            }
        }
    };
    tracing::info!(%peer, %jid, ?left, "SASL refused: account locked after failures");
    None
}

/// Records the outcome of a password check for `jid` in the back-off table, and with
/// Redis for every node.
pub(super) async fn auth_checked(
    shared: &Shared,
    peer: SocketAddr,
    jid: &BareJid,
    ok: bool,
    seen: super::backoff::Seen,
) {
    let ip = peer.ip();
    let backoff = &shared.auth_backoff;
    if ok {
        backoff.succeeded(ip, jid.as_str());
        if seen.failures {
            super::backoff::succeeded(shared, ip, jid.as_str()).await;
        }
        return;
    }
    let here = backoff.failed(ip, jid.as_str(), shared.liveness.clock.instant());
    let everywhere = super::backoff::failed(shared, backoff.policy(), ip, jid.as_str()).await;
    if let Some(lock) = here.max(everywhere) {
        tracing::warn!(%peer, %jid, ?lock, "SASL failures lock the account for this address");
    }
}
