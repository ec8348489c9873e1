//! XEP-0484 Fast Authentication Streamlining Tokens on a client stream: logging in with a
//! token (HT-SHA-256-NONE, [`crate::protocol::sasl::ht`]) and the `<token/>` a SASL2
//! `<success/>` carries when the client asked for one or its token is due for rotation.
//! What the store keeps and the rules that keep it small are [`crate::store::fast`].
//!
//! Decisions worth knowing:
//! - A token is bound to the account, the client's XEP-0388 user-agent id and the
//!   mechanism it was asked for: a login without the same user-agent id, of another
//!   account or with another mechanism fails as a wrong token does (not-authorized).
//! - A token that matches but has expired fails with credentials-expired (RFC 6120
//!   §6.5.2), which tells the client to log in with its password and ask for a new one.
//! - Token logins count towards the same back-off per address and account as passwords.
//! - After `[auth] fast_token_rotation` a login with a token is given a new one; the old
//!   one works until the client logs in with the new one, so a client that missed the
//!   `<success/>` is not locked out.
//! - `<fast invalidate='true'/>` ends the client's tokens once the login succeeds; a
//!   `count` not above every count the token carried before is a replay and fails.

use super::sasl::{auth_checked, auth_locked, Authed};
use super::sasl2::Request;
use super::Secured;
use crate::protocol::conditions::SaslCondition;
use crate::protocol::error::{StreamCondition, StreamError};
use crate::protocol::sasl::ht;
use crate::store::fast::{FastToken, Issue};
use crate::transport::stream::Fail;

/// The token a FAST login used.
#[derive(Debug, Clone, Copy)]
pub(super) struct Used {
    id: i64,
    issued_at: i64,
}

/// A failure of the store during a login: the stream ends with internal-server-error.
fn storage(peer: std::net::SocketAddr, e: crate::store::StoreError) -> Fail {
    tracing::error!(%peer, error = %e, "FAST token lookup failed");
    Fail::Stream(StreamError::new(
        StreamCondition::InternalServerError,
        "storage unavailable",
    ))
}

impl Secured {
    /// An HT mechanism's login (XEP-0484 "FAST authentication"): the client's only message
    /// is checked against the tokens of its account and user agent, with no PBKDF2; the
    /// server's proof goes in `<additional-data/>`.
    pub(super) async fn fast(
        &mut self,
        mechanism: &str,
        initial: &[u8],
        request: &Request,
    ) -> Result<Result<Authed, SaslCondition>, Fail> {
        let Some(msg) = ht::initiator_message(initial) else {
            return Ok(Err(SaslCondition::MalformedRequest));
        };
        let (Some(jid), Some(agent)) = (self.link.account(&msg.authcid), &request.user_agent)
        else {
            return Ok(Err(SaslCondition::NotAuthorized));
        };
        let Some(seen) = auth_locked(&self.link.shared, self.link.peer, &jid).await else {
            return Ok(Err(SaslCondition::NotAuthorized));
        };
        let local = crate::protocol::jid::node_str(&jid.clone().into()).to_owned();
        let domain = jid.domain().as_str().to_owned();
        let shared = self.link.shared.clone();
        let tokens = shared
            .store
            .fast_tokens(&local, &domain, agent)
            .await
            .map_err(|e| storage(self.link.peer, e))?;
        let binding = ht::Binding {
            account: jid.as_str(),
            user_agent: agent,
            mechanism,
        };
        // Each stored token derived once; the one that matches also makes the proof.
        let matched = tokens
            .iter()
            .filter(|t| t.mechanism == mechanism)
            .map(|t| (t, ht::token(&shared.fast_secret, &t.nonce, binding)))
            .find(|(_, token)| ht::initiator_matches(token, &msg.hashed_token));
        let now = shared.liveness.clock.now().timestamp();
        let outcome = match matched {
            None => Err(SaslCondition::NotAuthorized),
            Some((t, _)) if t.expires_at <= now => Err(SaslCondition::CredentialsExpired),
            Some((t, token)) => {
                let count = request.fast.as_ref().and_then(|f| f.count);
                // The rows read are newest first: one after `t` is older.
                let older = tokens.iter().any(|o| o.id < t.id);
                let fresh = shared
                    .store
                    .fast_token_used(t.id, count, older)
                    .await
                    .map_err(|e| storage(self.link.peer, e))?;
                if fresh {
                    Ok((t, token))
                } else {
                    tracing::warn!(peer = %self.link.peer, %jid, "FAST token count replayed");
                    Err(SaslCondition::NotAuthorized)
                }
            }
        };
        auth_checked(&shared, self.link.peer, &jid, outcome.is_ok(), seen).await;
        Ok(outcome.map(|(t, token): (&FastToken, String)| Authed {
            user: local,
            additional: Some(ht::responder(&token)),
            token: Some(Used {
                id: t.id,
                issued_at: t.issued_at,
            }),
        }))
    }

    /// What a SASL2 login leaves for its `<success/>` (XML, or empty): a new token when
    /// the client asked for one (`<request-token/>`) or logged in with a token due for
    /// rotation, none when it asked to invalidate the one it used. A store failure costs
    /// the client its new token, not its login.
    pub(super) async fn fast_token(&mut self, authed: &Authed, request: &Request) -> String {
        let shared = &self.link.shared;
        let auth = &shared.config.auth;
        let (Some(agent), Some(domain), true) = (&request.user_agent, &self.link.domain, auth.fast)
        else {
            return String::new();
        };
        if request.fast.as_ref().is_some_and(|f| f.invalidate) && authed.token.is_some() {
            let revoked = shared
                .store
                .revoke_fast_tokens(&authed.user, domain, Some(agent))
                .await;
            if let Err(e) = revoked {
                tracing::error!(peer = %self.link.peer, error = %e, "FAST token not invalidated");
            }
            return String::new();
        }
        let now = shared.liveness.clock.now().timestamp();
        let rotation = i64::try_from(auth.fast_token_rotation.as_secs()).unwrap_or(i64::MAX);
        let mechanism = match (&request.request_token, authed.token) {
            (Some(m), _) if ht::offered(m) => m.as_str(),
            (None, Some(used)) if now.saturating_sub(used.issued_at) >= rotation => {
                request.mechanism.as_str()
            }
            _ => return String::new(),
        };
        let issue = Issue {
            user_agent: agent,
            mechanism,
            now,
            lifetime: i64::try_from(auth.fast_token_lifetime.as_secs()).unwrap_or(i64::MAX),
            keep: authed.token.map(|u| u.id),
            max_clients: i64::from(auth.max_fast_clients),
        };
        let token = match shared
            .store
            .issue_fast_token(&authed.user, domain, issue)
            .await
        {
            Ok(Some(t)) => t,
            Ok(None) => return String::new(),
            Err(e) => {
                tracing::error!(peer = %self.link.peer, error = %e, "FAST token not issued");
                return String::new();
            }
        };
        let Some(account) = self.link.account(&authed.user) else {
            return String::new();
        };
        let binding = ht::Binding {
            account: account.as_str(),
            user_agent: agent,
            mechanism,
        };
        let value = ht::token(&shared.fast_secret, &token.nonce, binding);
        tracing::debug!(peer = %self.link.peer, %account, "FAST token issued");
        super::sasl2::token(&value, crate::clock::to_datetime(token.expires_at * 1000))
    }
}
