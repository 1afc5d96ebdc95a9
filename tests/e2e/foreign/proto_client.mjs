// A tenant's client of xpupool written from proto/ alone, in another language than the services,
// on the NATS wire protocol itself (node's standard library, no NATS package): what an upstream
// system in any language does. It reads the stack from the environment a tenant gets
// (XPUPOOL_NATS_URL, XPUPOOL_NATS_CREDS: an NKey seed file, XPUPOOL_NATS_TLS_CA), runs the job's
// whole life by proto/asyncapi.yaml's channels and operations, and prints one JSON line per message
// it sent or received ({"dir", "subject", "reply", "headers", "payload"}) for the test to check against
// proto/ and the invariants. Usage: node proto_client.mjs TENANT MAX_REQUEST_BYTES (the document's
// x-xpupool-max-request-bytes), or node proto_client.mjs --observe: as the operator (its seed in
// XPUPOOL_NATS_CREDS on the secure server), print every message on xpupool.> until SIGTERM.
import crypto from "node:crypto";
import fs from "node:fs";
import net from "node:net";
import tls from "node:tls";

const observing = process.argv[2] === "--observe";
const tenant = observing ? "operator" : process.argv[2];
const maxRequestBytes = Number(process.argv[3] || 0);
const url = new URL(process.env.XPUPOOL_NATS_URL);
const seedPath = process.env.XPUPOOL_NATS_CREDS || "";
const caPath = process.env.XPUPOOL_NATS_TLS_CA || "";
// A secured server lets a tenant use only its own inbox prefix (asyncapi: servers.secure).
const inbox = observing ? `_INBOX.${crypto.randomBytes(6).toString("hex")}` : `_INBOX.t.${tenant}.${crypto.randomBytes(6).toString("hex")}`;
const space = `xpupool.tenant.v1.${tenant}`;

function log(dir, subject, headers, body, reply = "") {
  let payload = body;
  try { payload = JSON.parse(body); } catch { /* recorded as the text it was */ }
  process.stdout.write(JSON.stringify({ dir, subject, reply, headers, payload }) + "\n");
}

// --- NKey: a seed is base32 of [prefix, prefix, 32-byte ed25519 seed, crc16]; the public key of a
// user is base32 of [20 << 3, 32-byte key, crc16]. The server's nonce is signed with the seed.
const B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
function b32decode(text) {
  let bits = 0, value = 0; const out = [];
  for (const ch of text.replace(/=+$/, "")) {
    value = (value << 5) | B32.indexOf(ch); bits += 5;
    if (bits >= 8) { out.push((value >>> (bits - 8)) & 0xff); bits -= 8; }
  }
  return Buffer.from(out);
}
function b32encode(bytes) {
  let bits = 0, value = 0, out = "";
  for (const b of bytes) {
    value = (value << 8) | b; bits += 8;
    while (bits >= 5) { out += B32[(value >>> (bits - 5)) & 31]; bits -= 5; }
  }
  if (bits > 0) out += B32[(value << (5 - bits)) & 31];
  return out;
}
function crc16(bytes) {  // CRC-16/XMODEM, as NKeys use
  let crc = 0;
  for (const b of bytes) {
    crc ^= b << 8;
    for (let i = 0; i < 8; i++) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
  }
  return crc;
}
function nkeyAuth(seedText, nonce) {
  const raw = b32decode(seedText.trim()).subarray(2, 34);
  const der = Buffer.concat([Buffer.from("302e020100300506032b657004220420", "hex"), raw]);
  const key = crypto.createPrivateKey({ key: der, format: "der", type: "pkcs8" });
  const pub = crypto.createPublicKey(key).export({ format: "der", type: "spki" }).subarray(-32);
  const body = Buffer.concat([Buffer.from([20 << 3]), pub]);
  const crc = crc16(body);
  const nkey = b32encode(Buffer.concat([body, Buffer.from([crc & 0xff, crc >> 8])]));
  const sig = crypto.sign(null, Buffer.from(nonce), key).toString("base64url");
  return { nkey, sig };
}

// --- The NATS protocol: INFO, CONNECT, SUB, HPUB, MSG/HMSG, PING/PONG.
let socket; let buffer = Buffer.alloc(0);
const waiters = []; const subscriptions = new Map(); let nextSid = 1;

function send(line, body) {
  socket.write(body === undefined ? line + "\r\n" : Buffer.concat([Buffer.from(line + "\r\n"), body, Buffer.from("\r\n")]));
}
function headerBlock(headers) {
  let text = "NATS/1.0\r\n";
  for (const [k, v] of Object.entries(headers)) text += `${k}: ${v}\r\n`;
  return Buffer.from(text + "\r\n");
}
function parseHeaders(block) {
  const lines = block.toString().split("\r\n");
  const headers = {};
  for (const line of lines.slice(1)) {
    const at = line.indexOf(":");
    if (at > 0) headers[line.slice(0, at).trim()] = line.slice(at + 1).trim();
  }
  return headers;
}
function onData(chunk) {
  buffer = Buffer.concat([buffer, chunk]);
  for (;;) {
    const end = buffer.indexOf("\r\n");
    if (end < 0) return;
    const line = buffer.subarray(0, end).toString();
    const [op, ...args] = line.split(" ");
    if (op === "MSG" || op === "HMSG") {
      const total = Number(args[args.length - 1]);
      const headerLen = op === "HMSG" ? Number(args[args.length - 2]) : 0;
      if (buffer.length < end + 2 + total + 2) return;
      const data = buffer.subarray(end + 2, end + 2 + total);
      buffer = buffer.subarray(end + 2 + total + 2);
      const [subject, sid] = args;
      const headers = headerLen ? parseHeaders(data.subarray(0, headerLen)) : {};
      subscriptions.get(sid)?.(subject, headers, data.subarray(headerLen).toString());
      continue;
    }
    buffer = buffer.subarray(end + 2);
    if (op === "PING") send("PONG");
    else if (op === "PONG") waiters.shift()?.();
    else if (op === "-ERR") { process.stderr.write(line + "\n"); process.exit(3); }
    else if (op === "INFO") onInfo(JSON.parse(args.join(" ")));
  }
}
let onInfo = () => {};
const flush = () => new Promise((resolve) => { waiters.push(resolve); send("PING"); });
function subscribe(subject, callback) {
  const sid = String(nextSid++);
  subscriptions.set(sid, callback);
  send(`SUB ${subject} ${sid}`);
}
function publish(subject, payload, headers = {}, reply = "") {
  const body = Buffer.from(typeof payload === "string" ? payload : JSON.stringify(payload));
  const block = headerBlock(headers);
  log("sent", subject, headers, body.toString(), reply);
  send(`HPUB ${subject} ${reply ? reply + " " : ""}${block.length} ${block.length + body.length}`, Buffer.concat([block, body]));
}

async function connect() {
  const port = Number(url.port || 4222);
  socket = net.connect(port, url.hostname);
  const info = await new Promise((resolve, reject) => {
    onInfo = resolve; socket.on("data", onData); socket.on("error", reject);
  });
  if (info.tls_required || url.protocol === "tls:") {
    socket.removeAllListeners("data");
    socket = tls.connect({ socket, ca: caPath ? fs.readFileSync(caPath) : undefined, servername: url.hostname });
    await new Promise((resolve, reject) => { socket.once("secureConnect", resolve); socket.once("error", reject); });
    socket.on("data", onData);
  }
  const options = { verbose: false, pedantic: false, headers: true, no_responders: true, protocol: 1, lang: "node", version: "proto", name: `proto-client-${tenant}` };
  if (seedPath) Object.assign(options, nkeyAuth(fs.readFileSync(seedPath, "utf8"), info.nonce));
  send(`CONNECT ${JSON.stringify(options)}`);
  await flush();
}

// --- Request/reply on one inbox subscription, as every official client does it.
const pendingReplies = new Map(); let nextReply = 1;
function request(subject, payload, headers = {}, timeoutMs = 10000) {
  const token = String(nextReply++);
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no reply on ${subject}`)), timeoutMs);
    pendingReplies.set(token, (message) => { clearTimeout(timer); resolve(message); });
    publish(subject, payload, headers, `${inbox}.${token}`);
  });
}

// Events, deduplicated by ce-id as proto/asyncapi.yaml's info says (a fault may deliver one twice).
const events = [];
const eventWaiters = [];
const seenIds = new Set();
function until(test, what, timeoutMs = 15000) {
  const found = events.find(test);
  if (found) return Promise.resolve(found);
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`timed out waiting for ${what}`)), timeoutMs);
    eventWaiters.push({ test, resolve: (e) => { clearTimeout(timer); resolve(e); } });
  });
}
const is = (type, key, value) => (e) => e.payload.type === type && e.payload[key] === value;
const check = (ok, what) => { if (!ok) throw new Error(what); };

async function observe() {
  // What an operator follows: every subject of the document, on a plain subscription.
  await connect();
  subscribe("xpupool.>", (subject, headers, body) => log("observed", subject, headers, body));
  await flush();
  log("ready", "", {}, "{}");
  process.on("SIGTERM", () => { socket.end(); process.exit(0); });
}

async function main() {
  await connect();
  subscribe(`${space}.events.>`, (subject, headers, body) => {
    log("event", subject, headers, body);
    const event = { subject, headers, payload: JSON.parse(body) };
    if (seenIds.has(headers["ce-id"])) return;
    seenIds.add(headers["ce-id"]);
    events.push(event);
    for (const w of eventWaiters.splice(0)) (w.test(event) ? w.resolve(event) : eventWaiters.push(w));
  });
  subscribe(`${inbox}.*`, (subject, headers, body) => {
    log("reply", subject, headers, body);
    let payload = null;
    try { payload = JSON.parse(body); } catch { /* a service error or a status reply has no body */ }
    pendingReplies.get(subject.slice(inbox.length + 1))?.({ headers, payload });
  });
  await flush();

  // 1. Submit by request/reply (operation send_..._jobs_submit; reply: SubmitReply).
  const first = await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-1", count: 1, device: { memory_mib: 1000 } });
  // 2. Submit on the stream (channel ..._jobs_requested, Nats-Msg-Id = job_id), twice: the same job.
  const stored = await request(`${space}.jobs.requested`, { type: "xpupool.job.requested.v1", job_id: "proto-2", count: 1, device: { memory_mib: 1000 } }, { "Nats-Msg-Id": "proto-2" });
  await request(`${space}.jobs.requested`, { type: "xpupool.job.requested.v1", job_id: "proto-2", count: 1, device: { memory_mib: 1000 } }, { "Nats-Msg-Id": "proto-2" });
  const second = await until(is("xpupool.alloc.granted.v1", "job_id", "proto-2"), "proto-2's grant");
  // 3. Renew the first, then release both with their secret and fencing token.
  const lease1 = first.payload.granted; const lease2 = second.payload;
  const renewed = await request(`${space}.leases.renew`, { type: "xpupool.lease.renew.v1", lease_id: lease1.lease_id, lease_secret: lease1.lease_secret, fencing_token: lease1.fencing_token, ttl_s: 60 });
  for (const lease of [lease1, lease2]) {
    await request(`${space}.leases.release`, { type: "xpupool.lease.release.v1", lease_id: lease.lease_id, lease_secret: lease.lease_secret, fencing_token: lease.fencing_token });
  }
  for (const lease of [lease1, lease2]) {
    await until(is("xpupool.alloc.ended.v1", "lease_id", lease.lease_id), `${lease.lease_id}'s end`);
  }
  // 3b. The same request again once its job ended (its keys in another order) is a retry: no
  // second outcome, answered known (SubmitOutcome), its state ended. Another request under the
  // job id is refused duplicate_job (JobReason).
  const retried = await request(`${space}.jobs.submit`, { device: { memory_mib: 1000 }, count: 1, job_id: "proto-1", type: "xpupool.job.requested.v1" });
  check(retried.payload.outcome === "known" && retried.payload.state === "ended", `proto-1 retried: ${JSON.stringify(retried.payload)}`);
  const reused = await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-1", count: 1, device: { memory_mib: 2000 } });
  check(reused.payload.outcome === "rejected" && reused.payload.rejected.reason === "duplicate_job", `proto-1 reused: ${JSON.stringify(reused.payload)}`);
  // 4. What a careless or hostile client sends is answered, not dropped.
  await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-bad", count: -1 });
  await request(`${space}.jobs.submit`, "this is not JSON");
  await request(`${space}.leases.release`, { type: "xpupool.lease.release.v1", lease_id: lease1.lease_id, lease_secret: "0".repeat(48), fencing_token: lease1.fencing_token });
  // The size the document gives: a payload of exactly that many bytes is read (and refused for
  // what it says), one byte more is not read at all; the job is named by Nats-Msg-Id.
  const padded = (job, size) => { const text = JSON.stringify({ type: "xpupool.job.requested.v1", job_id: job, count: -1 }); return text + " ".repeat(size - text.length); };
  await request(`${space}.jobs.submit`, padded("proto-edge", maxRequestBytes), { "Nats-Msg-Id": "proto-edge" });
  await request(`${space}.jobs.submit`, padded("proto-huge", maxRequestBytes + 1), { "Nats-Msg-Id": "proto-huge" });
  // A request whose reply subject is no inbox is handled and not answered (info.description): a
  // reply there would arrive as an "event" on the tenant's own subject.
  publish(`${space}.jobs.list`, { type: "xpupool.job.list.v1", limit: 1 }, {}, `${space}.events.rejected`);

  // 5. Queries: the jobs so far, an ended lease, a lease that does not exist.
  const jobs = await request(`${space}.jobs.list`, { type: "xpupool.job.list.v1", limit: 100 });
  check(jobs.payload.ok && jobs.payload.jobs.some((j) => j.job_id === "proto-1"), "proto-1 listed");
  await request(`${space}.leases.get`, { type: "xpupool.lease.get.v1", lease_id: lease1.lease_id });
  await request(`${space}.leases.get`, { type: "xpupool.lease.get.v1", lease_id: "proto-no-such-lease" });

  // 6. A job that waits: two whole devices held, a third asked for.
  const hold = await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-hold", count: 2, lease_ttl_s: 60 });
  check(hold.payload.outcome === "granted", `proto-hold: ${JSON.stringify(hold.payload)}`);
  const held = hold.payload.granted;
  const wait = await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-wait", count: 1, max_wait_s: 60 });
  check(wait.payload.outcome === "waiting", `proto-wait: ${JSON.stringify(wait.payload)}`);
  await until(is("xpupool.job.pending.v1", "job_id", "proto-wait"), "proto-wait's pending");
  await request(`${space}.jobs.list`, { type: "xpupool.job.list.v1", limit: 10 });
  await request(`${space}.leases.list`, { type: "xpupool.lease.list.v1" });
  await request(`${space}.leases.get`, { type: "xpupool.lease.get.v1", lease_id: held.lease_id });
  // A renewal with a token that is not the lease's is refused; one published without a reply
  // subject (fire and forget) renews, and the event says so.
  await request(`${space}.leases.renew`, { type: "xpupool.lease.renew.v1", lease_id: held.lease_id, lease_secret: held.lease_secret, fencing_token: held.fencing_token + 1 });
  publish(`${space}.leases.renew`, { type: "xpupool.lease.renew.v1", lease_id: held.lease_id, lease_secret: held.lease_secret, fencing_token: held.fencing_token, ttl_s: 120 });
  await until(is("xpupool.alloc.renewed.v1", "lease_id", held.lease_id), "proto-hold's renewal");

  // 7. Cancel: the waiting job (then again), a job that does not exist, the holding job.
  await request(`${space}.jobs.cancel`, { type: "xpupool.job.cancel.v1", job_id: "proto-wait" });
  await until(is("xpupool.job.cancelled.v1", "job_id", "proto-wait"), "proto-wait's cancel");
  await request(`${space}.jobs.cancel`, { type: "xpupool.job.cancel.v1", job_id: "proto-wait" });
  await request(`${space}.jobs.cancel`, { type: "xpupool.job.cancel.v1", job_id: "proto-nobody" });
  await request(`${space}.jobs.cancel`, { type: "xpupool.job.cancel.v1", job_id: "proto-hold" });
  await until(is("xpupool.alloc.ended.v1", "lease_id", held.lease_id), "proto-hold's end");
  await request(`${space}.leases.get`, { type: "xpupool.lease.get.v1", lease_id: held.lease_id });

  // 8. A maximum run time: warned (LeaseEnding), then ended on ended.max_runtime.
  const short = await request(`${space}.jobs.submit`, { type: "xpupool.job.requested.v1", job_id: "proto-short", count: 1, max_runtime_s: 2 });
  check(short.payload.outcome === "granted", `proto-short: ${JSON.stringify(short.payload)}`);
  await until(is("xpupool.alloc.ending.v1", "lease_id", short.payload.granted.lease_id), "proto-short's warning");
  await until(is("xpupool.alloc.ended.v1", "lease_id", short.payload.granted.lease_id), "proto-short's end");
  await request(`${space}.jobs.list`, { type: "xpupool.job.list.v1", limit: 100 });

  await flush();
  log("done", "", {}, JSON.stringify({ renewed: renewed.payload.ok, stream_ack: stored.payload }));
  socket.end();
}

(observing ? observe() : main()).catch((error) => { process.stderr.write(String(error.stack || error) + "\n"); process.exit(1); });
