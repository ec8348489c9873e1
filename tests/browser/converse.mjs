// converse.js (the stock web client, from npm) in headless Chromium, logged in to a test
// server over RFC 7395 WebSocket. Driven by tests/browser.rs, which plays the contact.
//
// Usage: node converse.mjs CONFIG_JSON
//   CONFIG_JSON: {"ws_url", "jid", "password", "contact", "offline_body", "live_body",
//                 "reply_body", "block_jid", "avatar_base64", "out_dir", "chromium",
//                 "timeout_ms"}
//
// It talks to the test in JSON lines: on standard output it prints {"step": ...} as it
// reaches each point, and it waits for a line on standard input where the test has to act
// in between. The last line is {"step": "report", ...}: every stanza error converse.js
// received with the request it answered, the replies to the feature requests the test
// checks, converse.js' console errors, and the screenshot's path. The whole console (with
// every stanza, loglevel debug) is written to OUT_DIR/converse-console.log.
import { createServer } from 'node:http';
import { readFile, mkdir, rm, writeFile } from 'node:fs/promises';
import { createInterface } from 'node:readline';
import { dirname, join, normalize } from 'node:path';
import { fileURLToPath } from 'node:url';
import puppeteer from 'puppeteer-core';

const cfg = JSON.parse(process.argv[2]);
const here = dirname(fileURLToPath(import.meta.url));
const dist = join(here, 'node_modules', 'converse.js', 'dist');
const deadline = Date.now() + (cfg.timeout_ms ?? 40000);
const left = () => Math.max(1, deadline - Date.now());

const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');
// Lines from the test, kept until asked for.
const lines = createInterface({ input: process.stdin });
const queued = [];
const waiting = [];
let stdinClosed = false;
lines.on('line', (l) => (waiting.length ? waiting.shift().resolve(l) : queued.push(l)));
lines.on('close', () => {
  stdinClosed = true;
  waiting.splice(0).forEach((w) => w.reject(new Error('the test closed standard input')));
});
const nextLine = () => new Promise((resolve, reject) => {
  if (queued.length) return resolve(queued.shift());
  if (stdinClosed) return reject(new Error('the test closed standard input'));
  waiting.push({ resolve, reject });
});

// The page: converse.js with a one-line plugin that hands its API to the driver.
const page_html = `<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>presenced: converse.js</title>
<link rel="stylesheet" href="/dist/converse.min.css">
<script type="module" src="/dist/converse.min.js"></script></head>
<body class="converse-fullscreen"><script type="module">
converse.plugins.add('presenced-test', {
  initialize() { window.presencedTest = { api: this._converse.api, converse: this._converse }; }
});
converse.initialize(${JSON.stringify({
  websocket_url: cfg.ws_url,
  jid: cfg.jid,
  password: cfg.password,
  auto_login: true,
  auto_reconnect: false,
  discover_connection_methods: false,
  view_mode: 'fullscreen',
  loglevel: 'debug',
  // XEP-0352: report the client inactive after one idle second.
  csi_waiting_time: 1,
  play_sounds: false,
  show_desktop_notifications: false,
  whitelisted_plugins: ['presenced-test'],
})});
</script></body></html>`;

// Static files on an ephemeral loopback port: the page and converse.js' dist folder.
const types = { '.js': 'text/javascript', '.css': 'text/css', '.json': 'application/json',
  '.svg': 'image/svg+xml', '.woff2': 'font/woff2', '.woff': 'font/woff', '.wasm': 'application/wasm',
  '.png': 'image/png', '.mp3': 'audio/mpeg', '.ogg': 'audio/ogg' };
const http = createServer(async (req, res) => {
  const path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
  if (path === '/favicon.ico') { res.writeHead(204); return res.end(); }
  if (path === '/' || path === '/index.html') {
    res.writeHead(200, { 'content-type': 'text/html' });
    return res.end(page_html);
  }
  const rel = normalize(path).replace(/^\/+/, '');
  if (!rel.startsWith('dist/')) { res.writeHead(404); return res.end(); }
  try {
    const body = await readFile(join(dist, rel.slice('dist/'.length)));
    const ext = rel.slice(rel.lastIndexOf('.'));
    res.writeHead(200, { 'content-type': types[ext] ?? 'application/octet-stream' });
    res.end(body);
  } catch {
    res.writeHead(404);
    res.end();
  }
});
await new Promise((resolve) => http.listen(0, '127.0.0.1', resolve));
const page_url = `http://127.0.0.1:${http.address().port}/`;

await mkdir(cfg.out_dir, { recursive: true });
await rm(join(cfg.out_dir, 'converse-failed.png'), { force: true });
const consoleLines = [];
const browser = await puppeteer.launch({
  executablePath: cfg.chromium,
  headless: true,
  // DevTools over a pipe: Chromium ends with this process even if it is killed.
  pipe: true,
  args: [
    // The server's development certificate is self-signed.
    '--ignore-certificate-errors',
    '--disable-gpu',
    '--disable-dev-shm-usage',
    '--no-first-run',
    // Loopback only: no name is ever resolved (converse.js' control box links sponsors' logos).
    '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1',
    // Chromium's sandbox refuses to run as root (CI containers).
    ...(process.getuid?.() === 0 ? ['--no-sandbox'] : []),
  ],
});

let exitCode = 0;
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1100, height: 700 });
  page.on('console', (m) => consoleLines.push({ type: m.type(), text: m.text() }));
  page.on('pageerror', (e) => consoleLines.push({ type: 'pageerror', text: String(e) }));
  page.on('requestfailed', (r) =>
    consoleLines.push({ type: 'requestfailed', text: `${r.url()} ${r.failure()?.errorText}` }));
  await page.goto(page_url, { timeout: left() });

  // Logged in: the session is bound and the roster fetched.
  await page.waitForFunction(
    () => window.presencedTest?.api.connection.get()?.authenticated === true,
    { timeout: left(), polling: 50 });
  await page.evaluate(() => window.presencedTest.api.waitUntil('rosterContactsFetched'));
  emit({ step: 'logged-in' });

  // The contact is shown online, and the message sent while we were offline is here with
  // its XEP-0203 delay stamp.
  await page.waitForFunction(async (contact) => {
    const c = await window.presencedTest.api.contacts.get(contact);
    return c?.getStatus() === 'online';
  }, { timeout: left(), polling: 100 }, cfg.contact);

  // The contact's avatar, published over PEP (XEP-0084): converse.js knows only vCards
  // (XEP-0153), so it arrives through the server's conversion (XEP-0398) and is drawn in
  // the roster as an SVG <image> with the picture as a data: URI.
  if (cfg.avatar_base64) {
    const shown = await page.waitForFunction((b64) => {
      const img = [...document.querySelectorAll('converse-avatar svg image')]
        .find((i) => (i.getAttribute('href') ?? '').includes(b64));
      return img ? img.getAttribute('href') : false;
    }, { timeout: left(), polling: 100 }, cfg.avatar_base64);
    const screenshot = join(cfg.out_dir, 'converse-avatar.png');
    await page.screenshot({ path: screenshot });
    emit({ step: 'avatar-shown', href: await shown.jsonValue(), screenshot });
  }
  const offline = await waitForMessage(page, cfg.contact, cfg.offline_body);
  await page.evaluate((c) => window.presencedTest.api.chats.open(c, {}, true), cfg.contact);
  await page.waitForFunction((body) => [...document.querySelectorAll('converse-chat-message')]
    .some((m) => m.textContent.includes(body)), { timeout: left(), polling: 100 }, cfg.offline_body);
  emit({ step: 'offline-shown', delayed: offline.is_delayed, time: offline.time });

  // XEP-0191 from the client's side: block and unblock a stranger.
  await page.evaluate(async (jid) => {
    const { api } = window.presencedTest;
    await api.blocklist.add(jid);
    await api.blocklist.remove(jid);
  }, cfg.block_jid);

  // XEP-0352: idle, converse.js reports itself inactive. A message must still come at once.
  await waitForConsole((l) => /<inactive xmlns="urn:xmpp:csi:0"/.test(l.text), 'CSI inactive sent');
  emit({ step: 'inactive' });
  await nextLine();
  const live = await waitForMessage(page, cfg.contact, cfg.live_body);
  emit({ step: 'live-shown', delayed: live.is_delayed });

  // Type a reply like a user (which also makes the client active again).
  await page.click('textarea.chat-textarea');
  await page.type('textarea.chat-textarea', cfg.reply_body);
  await page.keyboard.press('Enter');
  await waitForConsole((l) => l.text.includes(cfg.reply_body) && l.text.includes('darkcyan'),
    'reply sent');
  await waitForConsole((l) => /<active xmlns="urn:xmpp:csi:0"/.test(l.text), 'CSI active sent');
  emit({ step: 'replied' });
  // The test confirms the contact got it, so the screenshot shows the whole exchange.
  await nextLine();

  const screenshot = join(cfg.out_dir, 'converse-chat.png');
  await page.screenshot({ path: screenshot });
  const analysis = await page.evaluate(analyse, consoleLines);
  emit({
    step: 'report',
    screenshot,
    ...analysis,
    console_errors: consoleLines.filter((l) => l.type === 'error' || l.type === 'pageerror')
      .map((l) => l.text),
  });
} catch (e) {
  exitCode = 1;
  emit({ step: 'failed', error: String(e?.stack ?? e) });
  try {
    const pages = await browser.pages();
    if (pages.length) await pages[pages.length - 1].screenshot({ path: join(cfg.out_dir, 'converse-failed.png') });
  } catch { /* the failure itself is reported */ }
} finally {
  await writeFile(join(cfg.out_dir, 'converse-console.log'),
    consoleLines.map((l) => `[${l.type}] ${l.text}`).join('\n') + '\n');
  await browser.close();
  http.close();
  lines.close();
}
process.exit(exitCode);

// The chat message with `body` from `contact`, once converse.js has it.
async function waitForMessage(page, contact, body) {
  const h = await page.waitForFunction(async (contact, body) => {
    const chat = await window.presencedTest.api.chats.get(contact);
    const m = chat?.messages?.findWhere({ body });
    return m ? { is_delayed: m.get('is_delayed'), time: m.get('time') } : false;
  }, { timeout: left(), polling: 100 }, contact, body);
  return h.jsonValue();
}

// Polls the collected console until a line matches (converse.js logs every stanza).
async function waitForConsole(pred, what) {
  while (!consoleLines.some(pred)) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

// In the page: parses the stanzas converse.js logged (outgoing darkcyan, incoming
// darkgoldenrod) and pairs every iq reply with its request.
function analyse(lines) {
  const parse = (xml) => new DOMParser().parseFromString(xml, 'text/xml').documentElement;
  const sent = new Map();
  const errors = [];
  const replies = [];
  for (const l of lines) {
    const m = /^%c%s color: (darkcyan|darkgoldenrod) ([\s\S]*)$/.exec(l.text);
    if (!m) continue;
    const el = parse(m[2]);
    if (!el || el.nodeName === 'parsererror') continue;
    const out = m[1] === 'darkcyan';
    if (out && el.nodeName === 'iq') {
      const payload = el.firstElementChild;
      sent.set(el.getAttribute('id'), {
        to: el.getAttribute('to'),
        type: el.getAttribute('type'),
        payload: payload?.localName ?? null,
        ns: payload?.namespaceURI ?? null,
        node: payload?.getAttribute('node') ?? null,
      });
      continue;
    }
    if (out) continue;
    const type = el.getAttribute('type');
    if (el.nodeName === 'iq' && (type === 'result' || type === 'error')) {
      const request = sent.get(el.getAttribute('id')) ?? null;
      replies.push({ type, request });
    }
    if (type === 'error') {
      const err = [...el.children].find((c) => c.localName === 'error');
      const condition = err && [...err.children].find((c) => c.localName !== 'text')?.localName;
      errors.push({
        stanza: el.nodeName,
        from: el.getAttribute('from'),
        condition: condition ?? null,
        request: el.nodeName === 'iq' ? sent.get(el.getAttribute('id')) ?? null : null,
        xml: m[2],
      });
    }
  }
  return { stanza_errors: errors, iq_replies: replies };
}
