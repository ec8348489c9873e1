// @xmpp/client (the stock Node library, from npm) logs in with its password and is given a
// XEP-0484 FAST token, then reconnects as the same installation with the token and a
// wrong password (so only the token can log it in), then tries the token as another
// installation, which the server must refuse. Driven by tests/browser.rs.
//
// Usage: node xmpp-client-fast.mjs CONFIG_JSON
//   CONFIG_JSON: {"service", "domain", "username", "password", "resource", "timeout_ms"}
//
// Prints {"step": "token", "mechanism", "expiry", "jid"} after the password login,
// {"step": "fast", "jid"} once the token login is online, {"step": "refused", "error"}
// once the other installation's login failed; {"step": "failed"} and exit status 1 on
// anything else. A certificate is trusted through NODE_EXTRA_CA_CERTS.
import { client, xml } from '@xmpp/client';

const cfg = JSON.parse(process.argv[2]);
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');
const fail = (e) => {
  emit({ step: 'failed', error: String(e?.stack ?? e) });
  process.exit(1);
};
setTimeout(() => fail(new Error('timed out')), cfg.timeout_ms ?? 20000).unref();

// One client installation: its XEP-0388 user-agent id, which the token is bound to, and the
// token it keeps (in memory; an app would keep it on disk).
function connect(installation, password, stored) {
  const xmpp = client({
    service: cfg.service,
    domain: cfg.domain,
    username: cfg.username,
    password,
    resource: cfg.resource,
    userAgent: xml('user-agent', { id: installation }, xml('software', {}, 'presenced-test')),
    timeout: 10000,
  });
  xmpp.reconnect.stop();
  xmpp.fast.fetchToken = async () => stored.token;
  xmpp.fast.saveToken = async (t) => { stored.token = t; };
  xmpp.fast.deleteToken = async () => { stored.token = null; };
  return xmpp;
}

// Resolves with the bound JID once online; rejects with the first error.
function online(xmpp) {
  return new Promise((resolve, reject) => {
    xmpp.on('error', reject);
    xmpp.on('online', (address) => resolve(address.toString()));
    xmpp.start().catch(reject);
  });
}

const phone = globalThis.crypto.randomUUID();
const kept = { token: null };
try {
  const first = connect(phone, cfg.password, kept);
  const jid = await online(first);
  if (!kept.token) throw new Error('no FAST token after the password login');
  emit({ step: 'token', mechanism: kept.token.mechanism, expiry: kept.token.expiry, jid });
  await first.stop();

  const second = connect(phone, 'not-the-password', kept);
  emit({ step: 'fast', jid: await online(second) });
  await second.stop();
} catch (e) {
  fail(e);
}

const stolen = { token: kept.token };
const other = connect(globalThis.crypto.randomUUID(), 'not-the-password', stolen);
try {
  await online(other);
  fail(new Error('another installation logged in with the token'));
} catch (e) {
  emit({ step: 'refused', error: String(e?.condition ?? e) });
  process.exit(0);
}
