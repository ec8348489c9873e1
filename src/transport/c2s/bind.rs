//! RFC 6120 §7 resource binding, XEP-0386 binding inline in a XEP-0388 authentication, the
//! per-account resource limit, and the legacy session iq.

use super::negotiate::Offer;
use super::{iq_result, new_id, Authenticated, Bound, Fail, Halt, Inline, Sasl2};
use crate::node::stream_management as sm;
use crate::node::Shared;
use crate::protocol::error::{StanzaCondition, StanzaError, StreamCondition, StreamError};
use crate::protocol::jid::FullJid;
use crate::protocol::stanza::IqType;
use crate::protocol::xml::{self as x, Element};

/// Why a resource cannot be bound.
pub(super) enum Refused {
    /// The account has `max_resources_per_account` bound.
    Exhausted(FullJid),
    /// The resource cannot be prepared (RFC 7622 §3.4).
    Unprepared,
}

/// What an authenticated client asked for.
enum Asked {
    /// A resource, bound (RFC 6120 §7).
    Bind(FullJid),
    /// To resume a detached session (XEP-0198 §5).
    Resume { previd: String, h: u32 },
}

impl Authenticated {
    /// RFC 6120 §7: the features offer binding; the stream is `Bound` once a resource is,
    /// or handed to the session it resumes (XEP-0198 §5).
    ///
    /// After XEP-0388 SASL2 there is no restart and no new features: the `<success/>` is
    /// written once what the `<authenticate/>` asked inline is done (`inline`), and a client
    /// that asked for no XEP-0386 bind goes on to bind as RFC 6120 says.
    pub(super) async fn bind(mut self) -> Result<Bound, Halt> {
        match self.sasl2.take() {
            Some(sasl2) => match self.inline(*sasl2).await? {
                Ok(bound) => return Ok(bound),
                Err(me) => self = me,
            },
            None => step!(self.link, self.link.open(Offer::Bind)),
        }
        loop {
            match step!(self.link, self.asked()) {
                Asked::Bind(jid) => {
                    let Authenticated { link, .. } = self;
                    return Ok(Bound {
                        link,
                        jid,
                        inline: None,
                    });
                }
                Asked::Resume { previd, h } => self = self.resume(&previd, h).await?,
            }
        }
    }

    /// Whether binding `jid` would exceed `max_resources_per_account`. Taking over a
    /// resource already bound (RFC 6120 §7.7.2.1: the older session is replaced) adds none.
    /// Resources bound on other nodes of the cluster count too (the directory). Two binds
    /// of the same account at the same instant may both pass; the overshoot is bounded by
    /// the connections negotiating at once.
    async fn resources_exhausted(shared: &Shared, jid: &FullJid) -> bool {
        let bare = jid.to_bare();
        let mut bound: Vec<String> = shared
            .sessions
            .of_user(&bare)
            .into_iter()
            .map(|s| s.jid.to_string())
            .collect();
        let max = shared.live.get().limits.max_resources_per_account;
        if bound.len() < max {
            // Only read the directory when this node's sessions alone leave room.
            let elsewhere = shared.cluster.holders(&[bare.as_str()]).await;
            bound.extend(elsewhere.into_values().flatten().map(|h| h.jid));
            bound.sort();
            bound.dedup();
        }
        bound.len() >= max && !bound.iter().any(|b| b == jid.as_str())
    }

    /// What a XEP-0388 `<authenticate/>` asked inline, then its `<success/>`: a XEP-0198
    /// resumption first (XEP-0198 §5 inline; the session writes the `<success/>` around its
    /// `<resumed/>` and this task has nothing left), else a XEP-0386 bind (the session
    /// writes the `<success/>` with `<bound/>` as it starts, after what `<bound/>` enables).
    /// Without a bind, or when its resource cannot be bound, the authentication stands: the
    /// `<success/>` names the bare JID and carries no `<bound/>`, and the client binds by
    /// iq (`Err` hands the stream back for that), whose answer says why it cannot.
    async fn inline(mut self, sasl2: Sasl2) -> Result<Result<Bound, Self>, Halt> {
        let Sasl2 {
            request,
            additional,
            token,
        } = sasl2;
        // XEP-0484: a new token goes in whichever `<success/>` is written.
        let mut before = token.clone();
        if let Some((previd, h)) = &request.resume {
            let data = additional.clone();
            let frame: sm::Frame = Box::new(move |jid: &str, resumed: &str| {
                super::sasl2::success(data.as_deref(), jid, &format!("{token}{resumed}"))
            });
            let (me, failed) = self.hand_over(previd, h.to_owned(), Some(frame)).await?;
            self = me;
            // The resumption failed; the authentication still succeeds, and says so.
            before.push_str(&failed);
        }
        if let Some(bind) = request.bind {
            let stable = match (&request.user_agent, self.link.account(&self.user)) {
                (Some(agent), Some(account)) => Some(super::sasl2::stable_id(
                    &self.link.shared.resource_secret,
                    account.as_str(),
                    agent,
                    bind.tag.as_deref(),
                )),
                _ => None,
            };
            match self.bindable(&bind.resource(stable)).await {
                Ok(jid) => {
                    tracing::info!(peer = %self.link.peer, %jid, "resource bound inline (XEP-0386)");
                    let Authenticated { link, .. } = self;
                    let inline = Inline {
                        additional,
                        before,
                        bind,
                    };
                    return Ok(Ok(Bound {
                        link,
                        jid,
                        inline: Some(Box::new(inline)),
                    }));
                }
                Err(Refused::Exhausted(jid)) => {
                    tracing::info!(peer = %self.link.peer, %jid, "inline bind refused: too many resources");
                }
                Err(Refused::Unprepared) => {}
            }
        }
        let authzid = self
            .link
            .account(&self.user)
            .map(|j| j.as_str().to_owned())
            .unwrap_or_default();
        let ok = super::sasl2::success(additional.as_deref(), &authzid, &before);
        step!(self.link, self.link.write(&ok));
        Ok(Err(self))
    }

    /// The full JID of `resource` for this account, if it may be bound: one rule for the
    /// RFC 6120 bind iq and the XEP-0386 bind.
    fn bindable(
        &self,
        resource: &str,
    ) -> impl std::future::Future<Output = Result<FullJid, Refused>> + Send {
        // Only what the check needs crosses the await: the stream is not `Sync`.
        let shared = self.link.shared.clone();
        let domain = self.link.domain.clone().unwrap_or_default();
        let jid = crate::protocol::jid::parse_full(&format!("{}@{domain}/{resource}", self.user));
        async move {
            let jid = jid.map_err(|_| Refused::Unprepared)?;
            if Self::resources_exhausted(&shared, &jid).await {
                return Err(Refused::Exhausted(jid));
            }
            Ok(jid)
        }
    }

    /// Reads up to a bound resource or a request to resume. Also answers the legacy session
    /// iq (RFC 3921 §3).
    async fn asked(&mut self) -> Result<Asked, Fail> {
        loop {
            let el = self.link.next_element().await?;
            match sm::Nonza::parse(&el) {
                Some(Ok(sm::Nonza::Resume { previd, h })) => {
                    return Ok(Asked::Resume { previd, h });
                }
                Some(Ok(sm::Nonza::Enable { .. })) => {
                    // XEP-0198 §3: stream management is enabled after resource binding.
                    self.link
                        .write(&sm::failed(StanzaCondition::UnexpectedRequest, None))
                        .await?;
                    continue;
                }
                Some(Err(sm::Malformed(why))) => {
                    return Err(Fail::Stream(StreamError::new(
                        StreamCondition::BadFormat,
                        why,
                    )));
                }
                Some(Ok(sm::Nonza::Request | sm::Nonza::Ack { .. })) | None => {}
            }
            let is_set = el.is("iq", x::NS_CLIENT) && IqType::of(&el) == Some(IqType::Set);
            let Some(bind) = el.get_child("bind", x::NS_BIND).filter(|_| is_set) else {
                if is_set && el.get_child("session", x::NS_SESSION).is_some() {
                    self.link.write_el(&iq_result(&el)).await?;
                    continue;
                }
                // RFC 6120 §7.1: no stanzas before a resource is bound.
                return Err(Fail::Stream(StreamError::new(
                    StreamCondition::NotAuthorized,
                    "bind a resource first",
                )));
            };
            let requested = bind
                .get_child("resource", x::NS_BIND)
                .map(|r| r.text_content())
                .filter(|r| !r.is_empty());
            let resource = requested.unwrap_or_else(new_id);
            let jid = self.bindable(&resource).await;
            match jid {
                Err(Refused::Exhausted(jid)) => {
                    // RFC 6120 §7.6.2.1 (server-generated resource) and §7.7.2.2 (client-
                    // submitted): the account has reached its limit of connected resources.
                    // The stream stays open; the client may bind once one has gone.
                    tracing::info!(peer = %self.link.peer, %jid, "bind refused: too many resources");
                    if let Some(r) = StanzaError::resource_constraint()
                        .with_text("too many resources bound to this account")
                        .reply_to(&el)
                    {
                        self.link.write_el(&r).await?;
                    }
                }
                Ok(jid) => {
                    let reply = iq_result(&el).child(
                        Element::new("bind", x::NS_BIND)
                            .child(Element::new("jid", x::NS_BIND).text(jid.to_string())),
                    );
                    self.link.write_el(&reply).await?;
                    return Ok(Asked::Bind(jid));
                }
                Err(Refused::Unprepared) => {
                    // RFC 6120 §7.7.2.1: a resource that cannot be prepared is bad-request.
                    if let Some(r) = StanzaError::bad_request()
                        .with_text("resource cannot be prepared")
                        .reply_to(&el)
                    {
                        self.link.write_el(&r).await?;
                    }
                }
            }
        }
    }
}
