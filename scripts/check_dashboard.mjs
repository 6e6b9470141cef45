// Drives the coordinator's live dashboard in headless Chromium against a real local cluster:
// a coordinator with a cluster token and `--metrics-listen 0.0.0.0:0` (not loopback, so the API
// asks for the token), 3 workers, a BERT-tiny job on part of the KJV; then checks what the page
// shows before and after one worker is killed with SIGKILL. Run by scripts/check-dashboard.sh,
// which installs Chromium and playwright-core; see there for the environment it passes.
//
// Environment: KEEL_BIN_DIR (keel, keel-coordinator, keel-worker), KEEL_PLAYWRIGHT_DIR (the
// folder holding node_modules/playwright-core), KEEL_CHROMIUM (the browser), KEEL_CORPUS (the
// KJV text), KEEL_WORK (a fresh folder for the cluster), KEEL_DASHBOARD_SHOTS (where the
// screenshots go).
import { spawn, execFile } from "node:child_process";
import { createRequire } from "node:module";
import fs from "node:fs";
import net from "node:net";
import path from "node:path";

const env = (name) => {
  const v = process.env[name];
  if (!v) fail(`${name} is not set (run scripts/check-dashboard.sh)`);
  return v;
};
const BIN = env("KEEL_BIN_DIR");
const WORK = env("KEEL_WORK");
const SHOTS = env("KEEL_DASHBOARD_SHOTS");
const CORPUS = env("KEEL_CORPUS");
const CHROMIUM = env("KEEL_CHROMIUM");
const { chromium } = createRequire(path.join(env("KEEL_PLAYWRIGHT_DIR"), "/"))("playwright-core");

const T0 = Date.now();
const secs = () => ((Date.now() - T0) / 1000).toFixed(1).padStart(5) + " s";
const log = (msg) => console.log(`check-dashboard: [${secs()}] ${msg}`);
function fail(msg) {
  console.error(`check-dashboard: FAILED: ${msg}`);
  cleanup();
  process.exit(1);
}

// ---------- processes ----------

const procs = []; // { name, child, log }
const pidFile = path.join(WORK, "pids");

function start(name, exe, args) {
  const logPath = path.join(WORK, "logs", `${name}.log`);
  const out = fs.openSync(logPath, "w");
  const child = spawn(path.join(BIN, exe), args, {
    stdio: ["ignore", out, out],
    env: { ...process.env, KEEL_TOKEN_FILE: tokenFile, KEEL_LOG: "info" },
  });
  fs.closeSync(out);
  const p = { name, child, log: logPath, exited: null };
  child.on("exit", (code, signal) => { p.exited = signal || code; });
  procs.push(p);
  // The shell wrapper kills these too if this script itself dies.
  fs.appendFileSync(pidFile, `${child.pid}\n`);
  return p;
}

let cleaned = false;
function cleanup() {
  if (cleaned) return;
  cleaned = true;
  for (const p of procs) {
    if (p.exited === null) { try { p.child.kill("SIGKILL"); } catch (e) { /* gone */ } }
  }
}
process.on("exit", cleanup);
for (const sig of ["SIGINT", "SIGTERM", "SIGHUP"]) process.on(sig, () => { cleanup(); process.exit(1); });
process.on("uncaughtException", (e) => fail(e.stack || String(e)));
process.on("unhandledRejection", (e) => fail((e && e.stack) || String(e)));

function tail(p, n = 15) {
  try {
    const lines = fs.readFileSync(p.log, "utf8").trimEnd().split("\n");
    return `${p.name} log (${p.log}), last lines:\n` + lines.slice(-n).map((l) => "  " + l).join("\n");
  } catch (e) { return `${p.name}: no log`; }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls `f` (async) every `every` ms until it returns a truthy value; fails after `limit` ms with
// `what` and the result of `why()`.
async function waitFor(what, limit, f, why = () => "") {
  const deadline = Date.now() + limit;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > deadline) fail(`timed out after ${limit / 1000} s waiting for ${what}. ${await why()}`);
    await sleep(250);
  }
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => { const port = s.address().port; s.close(() => resolve(port)); });
  });
}
function canConnect(port) {
  return new Promise((resolve) => {
    const c = net.connect(port, "127.0.0.1");
    c.on("connect", () => { c.destroy(); resolve(true); });
    c.on("error", () => resolve(false));
  });
}

function keel(args, limitMs = 60000) {
  return new Promise((resolve) => {
    execFile(path.join(BIN, "keel"), args, { env: { ...process.env, KEEL_TOKEN_FILE: tokenFile }, timeout: limitMs },
      (err, stdout, stderr) => {
        if (err) fail(`keel ${args.join(" ")}: ${err.message}\n${stderr}`);
        resolve(stdout);
      });
  });
}

async function http(url, headers = {}) {
  const res = await fetch(url, { headers, signal: AbortSignal.timeout(10000) });
  return { status: res.status, text: await res.text(), type: res.headers.get("content-type") || "" };
}

// ---------- the cluster ----------

fs.mkdirSync(path.join(WORK, "logs"), { recursive: true });
fs.mkdirSync(SHOTS, { recursive: true });
const tokenFile = path.join(WORK, "keel.token");
const token = (await import("node:crypto")).randomBytes(32).toString("base64");
fs.writeFileSync(tokenFile, token + "\n", { mode: 0o600 });

// 3,000 lines of the KJV: prepared in a second or two.
const corpus = path.join(WORK, "kjv-part.txt");
fs.writeFileSync(corpus, fs.readFileSync(CORPUS, "utf8").split("\n").slice(0, 3000).join("\n") + "\n");
const MAX_STEPS = 900;
const jobFile = path.join(WORK, "job.toml");
fs.writeFileSync(jobFile, `[data]
corpus = ["${corpus}"]
vocab_size = 1000
lowercase = true
objective = "mlm"
max_seq_length = 32
masked_lm_prob = 0.15
max_predictions_per_seq = 5
heldout_fraction = 0.02
[model]
preset = "tiny"
[train]
micro_batch_size = 16
max_steps = ${MAX_STEPS}
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 20
schedule = "linear"
seed = 7
checkpoint_every = 50
eval_every = 20
[cluster]
min_workers = 2
max_workers = 3
peer_timeout_seconds = 10
`);

const grpcPort = await freePort();
const coordAddr = `127.0.0.1:${grpcPort}`;
const coordinator = start("coordinator", "keel-coordinator", [
  "--listen", coordAddr, "--data-dir", path.join(WORK, "coordinator"),
  "--token-file", tokenFile, "--metrics-listen", "0.0.0.0:0",
]);
await waitFor(`the coordinator to listen on ${coordAddr}`, 30000,
  async () => coordinator.exited === null ? canConnect(grpcPort) : fail(`the coordinator exited (${coordinator.exited})\n${tail(coordinator)}`),
  () => tail(coordinator));
// "metrics listening addr=0.0.0.0:PORT" in its log (port 0 asked for, so read it back).
const metricsPort = await waitFor("the coordinator's 'metrics listening addr=...' log line", 30000, () => {
  const text = fs.readFileSync(coordinator.log, "utf8").replace(/\x1b\[[0-9;]*m/g, "");
  const line = text.split("\n").find((l) => l.includes("metrics listening"));
  const m = line && /addr=\S*:(\d+)/.exec(line);
  return m ? Number(m[1]) : null;
}, () => tail(coordinator));
const BASE = `http://127.0.0.1:${metricsPort}`;
log(`coordinator on ${coordAddr}, HTTP (dashboard, API, /metrics) on 0.0.0.0:${metricsPort}`);

const workers = [];
for (let i = 0; i < 3; i++) {
  const port = await freePort();
  const addr = `127.0.0.1:${port}`;
  const p = start(`worker-${i}`, "keel-worker", [
    "--coordinator", coordAddr, "--listen", addr, "--advertise-addr", addr,
    "--threads", "1", "--cache-dir", path.join(WORK, `worker-${i}`), "--token-file", tokenFile,
  ]);
  p.addr = addr;
  workers.push(p);
}

// The HTTP port's security, seen from outside the browser.
{
  const health = await http(`${BASE}/healthz`);
  if (health.status !== 200) fail(`/healthz answered ${health.status} without a token (it must be open)`);
  const noToken = await http(`${BASE}/api/jobs`);
  if (noToken.status !== 401) fail(`/api/jobs without a token answered ${noToken.status}, not 401: ${noToken.text.slice(0, 200)}`);
  let body = null;
  try { body = JSON.parse(noToken.text); } catch (e) { /* checked below */ }
  if (!body || typeof body.error !== "string") fail(`the 401 of /api/jobs is not JSON {"error": ...}: ${noToken.text.slice(0, 200)}`);
  const wrong = await http(`${BASE}/api/workers`, { Authorization: "Bearer not-the-token" });
  if (wrong.status !== 401) fail(`/api/workers with a wrong token answered ${wrong.status}, not 401`);
  const good = await http(`${BASE}/api/workers`, { Authorization: `Bearer ${token}` });
  if (good.status !== 200) fail(`/api/workers with the token answered ${good.status}: ${good.text.slice(0, 200)}`);
  for (const f of ["/", "/common.js", "/charts.js", "/ring.js", "/app.js", "/style.css"]) {
    const r = await http(BASE + f);
    if (r.status !== 200 || r.text.length < 100) fail(`${f} answered ${r.status} (${r.text.length} bytes) without a token`);
  }
  log(`API: /api/jobs without a token -> 401 ${JSON.stringify(body)}; a wrong token -> 401; the token -> 200; /healthz and the page's files open`);
}

// Submit once all 3 workers are registered, so that the job starts with a ring of 3.
await waitFor("3 registered workers in /api/workers", 60000, async () => {
  for (const w of workers) if (w.exited !== null) fail(`${w.name} exited (${w.exited})\n${tail(w)}`);
  const r = await http(`${BASE}/api/workers`, { Authorization: `Bearer ${token}` });
  return r.status === 200 && JSON.parse(r.text).workers.length >= 3;
});
const jobId = (await keel(["submit", jobFile, "--coordinator", coordAddr])).trim();
if (!/^job-\d+$/.test(jobId)) fail(`keel submit printed ${JSON.stringify(jobId)}, not a job id`);
log(`submitted ${jobId}: BERT-tiny, 32-token sequences, ${MAX_STEPS} steps, held-out eval every 20, 2..3 workers`);

// ---------- the browser ----------

const profile = fs.mkdtempSync(path.join(WORK, "chromium-profile-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: CHROMIUM,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1440, height: 1000 },
  deviceScaleFactor: 1,
  timeout: 60000,
});
const page = context.pages()[0] || (await context.newPage());
const pageErrors = [];
const foreign = [];
const unauthenticated = [];
let tokenGiven = false; // from the right token on, every API call must carry it
let authorized = 0;
page.on("pageerror", (e) => pageErrors.push(e.message));
page.on("console", (m) => { if (m.type() === "error" && !/status of 401/.test(m.text())) pageErrors.push("console: " + m.text()); });
page.on("request", (req) => {
  const u = new URL(req.url());
  if (u.protocol === "data:") return;
  if (u.origin !== BASE) foreign.push(req.url());
  if (u.pathname.startsWith("/api/") && tokenGiven) {
    if (req.headers().authorization === `Bearer ${token}`) authorized++;
    else unauthenticated.push(`${req.url()} (Authorization ${JSON.stringify(req.headers().authorization || null)})`);
  }
});

const ui = {
  points: () => page.$eval("#loss-chart", (e) => Number(e.dataset.points || 0)).catch(() => 0),
  ring: () => page.$$eval("#ring tbody tr[data-worker]", (rows) => rows.map((r) => ({
    id: r.dataset.worker, rank: Number(r.dataset.rank), state: r.dataset.state,
    address: r.querySelector("code") ? r.querySelector("code").textContent : "",
  }))).catch(() => []),
  recoveries: () => page.$$eval('#timeline [data-event="recovery"]', (e) => e.length).catch(() => 0),
  jobState: () => page.$eval(`#jobs tbody tr[data-job="${jobId}"]`, (e) => e.dataset.state).catch(() => null),
  describe: async () => `page: loss points ${await ui.points()}, ring ${JSON.stringify((await ui.ring()).map((w) => w.id))}, ` +
    `recoveries ${await ui.recoveries()}, job state ${await ui.jobState()}, ` +
    `error line ${JSON.stringify(await page.$eval("#api-error", (e) => e.hidden ? "" : e.textContent).catch(() => ""))}`,
};

await page.goto(BASE + "/", { timeout: 30000 });
await page.waitForSelector("#token-form:not([hidden])", { timeout: 20000 })
  .catch(() => fail("the token form did not appear although the API answers 401 without the token"));
log("the page asks for the cluster token (the API answered 401)");
// A wrong token first: the form must come back saying so.
await page.fill("#token-input", "not-the-token");
await page.click("#token-submit");
await waitFor("the token form to come back after a wrong token", 15000, async () =>
  page.$eval("#token-form", (e) => !e.hidden && /refused/.test(document.getElementById("token-message").textContent)));
log("a wrong token brings the form back ('refused'); filling in the right one");
await page.fill("#token-input", token);
tokenGiven = true;
await page.click("#token-submit");
await page.waitForSelector(`#jobs tbody tr[data-job="${jobId}"]`, { timeout: 20000 })
  .catch(async () => fail(`${jobId} did not appear in the jobs table. ${await ui.describe()}`));
const stored = await page.evaluate(() => sessionStorage.getItem("keel-token"));
if (stored !== token) fail("the token is not kept in sessionStorage under keel-token");
if (!(await page.$eval("#token-form", (e) => e.hidden))) fail("the token form is still shown after a good token");

await waitFor("the loss chart to show at least 10 training points", 240000, async () => {
  if ((await ui.jobState()) === "failed") fail(`${jobId} failed: ${await page.$eval("#job-error", (e) => e.textContent)}`);
  return (await ui.points()) >= 10;
}, ui.describe);
log(`loss chart: ${await ui.points()} training points drawn`);

const ring3 = await waitFor("the ring table to list 3 workers", 60000, async () => {
  const r = await ui.ring();
  return r.length === 3 ? r : null;
}, ui.describe);
const expected = new Set(workers.map((w) => w.addr));
for (const w of ring3) {
  if (!expected.has(w.address)) fail(`the ring lists ${w.id} at ${JSON.stringify(w.address)}, not one of our workers ${[...expected].join(", ")}`);
  if (w.state !== "training") log(`note: ${w.id} shows state ${w.state} (not training yet)`);
}
if (ring3.map((w) => w.rank).join() !== "0,1,2") fail(`ring ranks are ${ring3.map((w) => w.rank).join()}, not 0,1,2`);
log(`ring: ${ring3.map((w) => `${w.rank}:${w.id} ${w.address} ${w.state}`).join(", ")}`);
// Let a held-out point or two and the charts fill a little for the picture.
await waitFor("2 held-out loss points", 60000, async () =>
  Number(await page.$eval("#loss-chart", (e) => e.dataset.evalPoints || 0)) >= 2, ui.describe);
const before = path.join(SHOTS, "dashboard-before-kill.png");
await page.screenshot({ path: before, fullPage: true });
log(`screenshot: ${before}`);

// ---------- kill a worker ----------

const victimRow = ring3[1];
const victim = workers.find((w) => w.addr === victimRow.address);
if (!victim) fail(`no worker process behind ${victimRow.address}`);
const killedAtPoints = await ui.points();
victim.child.kill("SIGKILL");
const killedAt = Date.now();
log(`SIGKILL to ${victim.name} = ${victimRow.id} (rank ${victimRow.rank}, ${victim.addr}, pid ${victim.child.pid}) with ${killedAtPoints} points drawn`);

await waitFor("a recovery in the timeline", 90000, async () => (await ui.recoveries()) >= 1, ui.describe);
log(`timeline shows the recovery ${((Date.now() - killedAt) / 1000).toFixed(1)} s after the kill: ` +
  JSON.stringify(await page.$eval('#timeline [data-event="recovery"] .what', (e) => e.textContent)));
const ring2 = await waitFor("the ring table to list 2 workers, without the killed one", 90000, async () => {
  const r = await ui.ring();
  return r.length === 2 && !r.some((w) => w.id === victimRow.id) ? r : null;
}, ui.describe);
log(`ring ${((Date.now() - killedAt) / 1000).toFixed(1)} s after the kill: ${ring2.map((w) => `${w.rank}:${w.id} ${w.state}`).join(", ")}`);
// The job goes on with 2: wait for 20 more points and a running state for the picture.
await waitFor("the job to train on after the recovery (20 more loss points, state running)", 120000, async () => {
  const st = await ui.jobState();
  if (st === "failed") fail(`${jobId} failed after the kill: ${await page.$eval("#job-error", (e) => e.textContent)}`);
  return st === "running" && (await ui.points()) >= killedAtPoints + 20;
}, ui.describe);
const lostShown = await page.$(`#ring-others [data-other-worker="${victimRow.id}"][data-state="lost"]`);
const apiWorkers = JSON.parse((await http(`${BASE}/api/workers`, { Authorization: `Bearer ${token}` })).text).workers;
if (!lostShown) fail(`${victimRow.id} is not shown as lost beside the ring. ${await ui.describe()}`);
log(`job running again with ${await ui.points()} points; ${victimRow.id} shown as lost beside the ring ` +
  `(/api/workers now: ${apiWorkers.map((w) => `${w.id} ${w.state}`).join(", ")})`);

// The last checkpoint and its command: run the command the page shows, for real.
const cpStep = await waitFor("a checkpoint in the checkpoint panel", 120000, async () =>
  Number(await page.$eval("#checkpoint", (e) => e.dataset.step || 0)), ui.describe);
const command = await page.$eval("#pull-command", (e) => e.textContent.trim());
const words = command.split(/\s+/);
if (words[0] !== "keel" || words[1] !== "pull" || words[2] !== jobId) fail(`the pull command is ${JSON.stringify(command)}`);
const pulled = path.join(WORK, "pulled");
await keel([...words.slice(1).map((w) => (w === words[words.indexOf("--out") + 1] ? pulled : w)), "--coordinator", coordAddr], 120000);
for (const f of ["config.json", "model.safetensors"]) {
  if (!fs.existsSync(path.join(pulled, f))) fail(`\`${command}\` brought no ${f} (it wrote: ${fs.readdirSync(pulled).join(", ")})`);
}
log(`checkpoint panel: step ${cpStep}; its command \`${command}\` works (with --coordinator): ${fs.readdirSync(pulled).sort().join(", ")}`);
const after = path.join(SHOTS, "dashboard-after-kill.png");
await page.screenshot({ path: after, fullPage: true });
log(`screenshot: ${after}`);

// /metrics stays open (Prometheus scrapes it without the token).
{
  const m = await http(`${BASE}/metrics`);
  if (m.status !== 200) fail(`/metrics without a token answered ${m.status}: ${m.text.slice(0, 200)}`);
  if (!/^keel_\w+/m.test(m.text)) fail(`/metrics has no keel_ metric:\n${m.text.slice(0, 400)}`);
  const alive = /^keel_workers_alive\s+(\S+)/m.exec(m.text);
  log(`/metrics without a token: 200, ${m.text.split("\n").filter((l) => l.startsWith("keel_")).length} keel_ samples` +
    (alive ? `, keel_workers_alive ${alive[1]}` : ""));
}

if (foreign.length) fail(`the page made requests outside ${BASE}: ${[...new Set(foreign)].join(", ")}`);
if (unauthenticated.length) fail(`API calls without "Authorization: Bearer <token>": ${unauthenticated.slice(0, 3).join(", ")}`);
if (!authorized) fail("the page made no API call with the token");
if (pageErrors.length) fail(`errors in the page: ${pageErrors.slice(0, 5).join(" | ")}`);
for (const w of workers) if (w !== victim && w.exited !== null) fail(`${w.name} exited (${w.exited})\n${tail(w)}`);
if (coordinator.exited !== null) fail(`the coordinator exited (${coordinator.exited})\n${tail(coordinator)}`);

await context.close();
cleanup();
log(`${authorized} API calls from the page, each with the token; no request left ${BASE}`);
log(`OK: token form, 401 without the token, loss chart, ring of 3, SIGKILL -> recovery in the timeline and a ring of 2, open /metrics`);
console.log(`check-dashboard: screenshots:\n  ${before}\n  ${after}`);
process.exit(0);
