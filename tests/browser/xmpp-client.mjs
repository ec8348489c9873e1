// @xmpp/client (the stock Node library, from npm) logs in, sends a message and waits for
// the answer. Driven by tests/browser.rs, which plays the contact.
//
// Usage: node xmpp-client.mjs CONFIG_JSON
//   CONFIG_JSON: {"service", "domain", "username", "password", "resource", "contact",
//                 "send_body", "expect_body", "timeout_ms"}
//
// Prints {"step": "online", "jid"} once bound with its initial presence sent (the message
// is sent right after), then {"step": "report", "errors": [...]} with every error stanza
// it received, once the contact's message with expect_body has come; {"step": "failed"}
// and exit status 1 on any failure. A certificate is trusted through NODE_EXTRA_CA_CERTS.
import { client, xml } from '@xmpp/client';

const cfg = JSON.parse(process.argv[2]);
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');
const fail = (e) => {
  emit({ step: 'failed', error: String(e?.stack ?? e) });
  process.exit(1);
};
setTimeout(() => fail(new Error('timed out')), cfg.timeout_ms ?? 20000).unref();

const xmpp = client({
  service: cfg.service,
  domain: cfg.domain,
  username: cfg.username,
  password: cfg.password,
  resource: cfg.resource,
  // Each negotiation step's wait (2 s by default): a loaded test machine can take longer.
  timeout: 10000,
});
xmpp.reconnect.stop();

const errors = [];
let answered;
const answer = new Promise((resolve) => { answered = resolve; });
xmpp.on('error', fail);
xmpp.on('stanza', (stanza) => {
  if (stanza.attrs.type === 'error') errors.push(stanza.toString());
  if (stanza.is('message') && stanza.getChildText('body') === cfg.expect_body) {
    answered(stanza.attrs.from);
  }
});
xmpp.on('online', async (address) => {
  try {
    await xmpp.send(xml('presence'));
    emit({ step: 'online', jid: address.toString() });
    await xmpp.send(xml('message', { to: cfg.contact, type: 'chat' },
      xml('body', {}, cfg.send_body)));
    const from = await answer;
    emit({ step: 'report', from, errors });
    await xmpp.stop();
    process.exit(0);
  } catch (e) {
    fail(e);
  }
});
xmpp.start().catch(fail);
