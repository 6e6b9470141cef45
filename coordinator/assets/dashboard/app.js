// Keel dashboard: polls the coordinator's JSON API every 2 s and draws the jobs, the chosen
// job's curves (inline SVG, no library), its ring, its generations and its last checkpoint.
// Plain JavaScript, no build step, no request leaves this coordinator. The helpers come from
// common.js, charts.js and ring.js (loaded before this file, on the `Keel` namespace).
"use strict";

(function (Keel) {
  const POLL_MS = 2000;
  const TOKEN_KEY = "keel-token";
  const MAX_CHART_POINTS = 1500; // per series; longer series are thinned (min/max per bucket)

  const $ = (id) => document.getElementById(id);

  const state = {
    jobs: [],
    workers: [],
    selected: null, // job id chosen by a click; null = follow the newest running job
    metrics: new Map(), // job id -> { next, steps, evals, events }
    timer: null,
    busy: false,
    needToken: false,
  };

  // ---------- API ----------

  class AuthError extends Error {}

  async function api(path) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = "Bearer " + token;
    const res = await fetch(path, { headers, cache: "no-store" });
    if (res.status === 401) throw new AuthError("401");
    const text = await res.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { /* not JSON */ }
    if (!res.ok) {
      const msg = body && body.error ? body.error : text.slice(0, 200);
      throw new Error(path + ": HTTP " + res.status + (msg ? " " + msg : ""));
    }
    return body;
  }

  // ---------- helpers (common.js, charts.js, ring.js) ----------

  const { isNum, normState, stateLabel, fmtLoss, fmtLr, fmtInt, fmtSeconds, fmtDuration, parseMember, el, svg } = Keel;
  const { thin, lineChart, lostWorkers, drawRingDiagram } = Keel;
  const ACTIVE = new Set(["running", "recovering", "waiting_for_workers", "preparing", "queued"]);

  // ---------- connection / token ----------

  function setConn(kind, text) {
    $("conn").dataset.state = kind;
    $("conn-text").textContent = text;
  }

  function askToken(refused) {
    state.needToken = true;
    setConn("auth", "token needed");
    const form = $("token-form");
    $("token-message").textContent = refused
      ? "The coordinator refused this token. Enter the cluster token (the contents of its --token-file)."
      : "This coordinator asks for the cluster token (the contents of its --token-file). It is kept in this browser tab only (sessionStorage).";
    if (form.hidden) {
      form.hidden = false;
      $("token-input").value = "";
      $("token-input").focus();
    }
  }

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const token = $("token-input").value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    $("token-form").hidden = true;
    state.needToken = false;
    poll();
  });

  // ---------- metrics (incremental) ----------

  function metricsOf(jobId) {
    let m = state.metrics.get(jobId);
    if (!m) {
      m = { next: 0, steps: [], evals: [], events: [] };
      state.metrics.set(jobId, m);
    }
    return m;
  }

  function addLine(m, line) {
    if (!line || typeof line !== "object") return;
    if (typeof line.event === "string") {
      m.events.push(line);
      // A generation resumed from an earlier step: the steps after it are trained again,
      // and the later lines are the ones that count.
      if (line.event === "resume" && isNum(line.step)) {
        const s = line.step;
        if (m.steps.length && m.steps[m.steps.length - 1].step > s) m.steps = m.steps.filter((p) => p.step <= s);
        if (m.evals.length && m.evals[m.evals.length - 1].step > s) m.evals = m.evals.filter((p) => p.step <= s);
      }
    } else if ("eval_loss" in line) {
      m.evals.push(line);
    } else if ("loss" in line && isNum(line.step)) {
      m.steps.push(line);
    }
  }

  async function fetchMetrics(jobId) {
    const m = metricsOf(jobId);
    // `next` is opaque (the server's offset to go on from). One answer holds at most 5000
    // lines (and a few MiB): follow `next` a few times per poll while answers are large.
    for (let page = 0; page < 20; page++) {
      const body = await api("/api/jobs/" + encodeURIComponent(jobId) + "/metrics?from=" + m.next);
      const lines = (body && body.lines) || [];
      for (const raw of lines) {
        let line = raw;
        if (typeof raw === "string") { try { line = JSON.parse(raw); } catch (e) { continue; } }
        addLine(m, line);
      }
      const next = body && isNum(body.next) ? body.next : m.next;
      if (next < m.next) { // the file was replaced (a restarted coordinator): start over
        state.metrics.delete(jobId);
        return fetchMetrics(jobId);
      }
      m.next = next;
      if (lines.length < 1000) break;
    }
    return m;
  }

  // ---------- polling ----------

  async function poll() {
    if (state.busy) return;
    state.busy = true;
    clearTimeout(state.timer);
    try {
      const [jobs, workers] = await Promise.all([api("/api/jobs"), api("/api/workers")]);
      state.jobs = (jobs && jobs.jobs) || [];
      state.workers = (workers && workers.workers) || [];
      const job = chosenJob();
      let m = null;
      if (job) m = await fetchMetrics(job.job_id);
      render(job, m);
      setConn("ok", "live");
      $("api-error").hidden = true;
      $("updated").textContent = "Updated " + new Date().toLocaleTimeString() + " · every " + POLL_MS / 1000 + " s";
    } catch (e) {
      if (e instanceof AuthError) {
        askToken(Boolean(sessionStorage.getItem(TOKEN_KEY)));
      } else {
        setConn("error", "no answer");
        $("api-error").hidden = false;
        $("api-error").textContent = String(e.message || e);
      }
    } finally {
      state.busy = false;
      if (!state.needToken) state.timer = setTimeout(poll, POLL_MS);
    }
  }

  function chosenJob() {
    const jobs = state.jobs;
    if (!jobs.length) return null;
    if (state.selected) {
      const j = jobs.find((x) => x.job_id === state.selected);
      if (j) return j;
    }
    // The newest running job, else the newest active one, else the newest.
    for (let i = jobs.length - 1; i >= 0; i--) if (normState(jobs[i].state) === "running") return jobs[i];
    for (let i = jobs.length - 1; i >= 0; i--) if (ACTIVE.has(normState(jobs[i].state))) return jobs[i];
    return jobs[jobs.length - 1];
  }

  // ---------- rendering ----------

  function render(job, m) {
    renderSummary();
    renderJobs(job);
    const section = $("job");
    if (!job) { section.hidden = true; return; }
    section.hidden = false;
    section.dataset.job = job.job_id;
    renderHead(job, m);
    renderCharts(m);
    renderRing(job, m);
    renderTimeline(job, m);
    renderCheckpoint(job);
  }

  function renderSummary() {
    const alive = state.workers.filter((w) => normState(w.state) !== "lost");
    const training = state.workers.filter((w) => normState(w.state) === "training");
    const running = state.jobs.filter((j) => normState(j.state) === "running").length;
    const s = $("cluster-summary");
    s.dataset.workersAlive = String(alive.length);
    s.textContent = `${state.jobs.length} job${state.jobs.length === 1 ? "" : "s"} (${running} running) · ` +
      `${alive.length} worker${alive.length === 1 ? "" : "s"} alive, ${training.length} training`;
  }

  function renderJobs(chosen) {
    const tbody = $("jobs").querySelector("tbody");
    const rows = [];
    // Newest first on screen.
    for (const j of [...state.jobs].reverse()) {
      const st = normState(j.state);
      const tr = el("tr", { "data-job": j.job_id, "data-state": st, class: chosen && chosen.job_id === j.job_id ? "selected" : "" },
        el("td", {}, el("strong", { text: j.job_id })),
        el("td", {}, el("span", { class: "badge", "data-state": st, text: stateLabel(st) })),
        el("td", { class: "num", text: `${fmtInt(j.step)} / ${fmtInt(j.max_steps)}` }),
        el("td", { class: "num", text: fmtLoss(j.loss) }),
        el("td", { class: "num", text: fmtLoss(j.eval_loss) }),
        el("td", { class: "num", text: String((j.workers || []).length) }),
        el("td", { class: "num", text: String(j.generation ?? "–") }),
        el("td", { class: "num", text: fmtDuration(j.elapsed_seconds) }));
      tr.addEventListener("click", () => {
        state.selected = j.job_id;
        poll();
      });
      rows.push(tr);
    }
    tbody.replaceChildren(...rows);
    $("jobs-empty").hidden = state.jobs.length > 0;
  }

  function renderHead(job, m) {
    const st = normState(job.state);
    $("job-title").textContent = job.job_id;
    const badge = $("job-state");
    badge.dataset.state = st;
    badge.textContent = stateLabel(st);
    const err = $("job-error");
    err.textContent = job.error || job.checkpoint_problem || "";
    err.hidden = !err.textContent;

    const step = isNum(job.step) ? job.step : 0;
    const max = isNum(job.max_steps) && job.max_steps > 0 ? job.max_steps : 0;
    const pct = max ? Math.min(100, (100 * step) / max) : 0;
    $("progress").dataset.progress = pct.toFixed(1);
    $("progress").setAttribute("aria-valuenow", pct.toFixed(1));
    $("progress-bar").style.width = pct + "%";
    $("step-text").textContent = `step ${fmtInt(step)} / ${fmtInt(max)} (${pct.toFixed(pct < 10 ? 1 : 0)}%)`;

    // ETA from the recent steps' wall time (the last 30 step lines), else the status's.
    const eta = $("eta");
    let perStep = NaN;
    const recent = m ? m.steps.slice(-30).map((p) => p.step_seconds).filter(isNum) : [];
    if (recent.length) perStep = recent.reduce((a, b) => a + b, 0) / recent.length;
    else if (isNum(job.step_seconds)) perStep = job.step_seconds;
    if (st === "completed") { eta.textContent = "done in " + fmtDuration(job.elapsed_seconds); eta.dataset.etaSeconds = "0"; }
    else if (!ACTIVE.has(st)) { eta.textContent = stateLabel(st) + " after " + fmtDuration(job.elapsed_seconds); eta.dataset.etaSeconds = ""; }
    else if (max && isNum(perStep)) {
      const left = Math.max(0, max - step) * perStep;
      eta.textContent = `ETA ${fmtDuration(left)} at ${fmtSeconds(perStep)}/step`;
      eta.dataset.etaSeconds = left.toFixed(0);
    } else { eta.textContent = "ETA –"; eta.dataset.etaSeconds = ""; }

    $("stat-loss").textContent = fmtLoss(job.loss);
    $("stat-eval-loss").textContent = fmtLoss(job.eval_loss);
    $("stat-eval-acc").textContent = isNum(job.eval_accuracy) ? `accuracy ${(100 * job.eval_accuracy).toFixed(1)}%` : "";
    $("stat-lr").textContent = fmtLr(job.learning_rate);
    $("stat-tps").textContent = fmtInt(job.tokens_per_second);
    $("stat-step-time").textContent = fmtSeconds(job.step_seconds);
    $("stat-generation").textContent = String(job.generation ?? "–");
    const rec = isNum(job.recoveries) ? job.recoveries : 0;
    const skipped = isNum(job.skipped_steps) && job.skipped_steps > 0 ? ` · ${job.skipped_steps} skipped` : "";
    $("stat-recoveries").textContent = `${rec} recover${rec === 1 ? "y" : "ies"}${skipped}` + (job.precision ? ` · ${job.precision}` : "");
  }

  // ---------- charts (drawn by charts.js) ----------

  let lastChartData = null;
  function renderCharts(m) {
    lastChartData = m;
    drawCharts();
  }
  function drawCharts() {
    const m = lastChartData;
    if (!m) return;
    const train = thin(m.steps.filter((p) => isNum(p.loss)).map((p) => [p.step, p.loss]), MAX_CHART_POINTS);
    const held = m.evals.filter((p) => isNum(p.eval_loss)).map((p) => [p.step, p.eval_loss]);
    const markers = m.events
      .filter((e) => e.event === "recovery" || e.event === "stall" || e.event === "grow" || e.event === "checkpoint_failed")
      .map((e) => ({ x: e.step, kind: e.event, title: `${e.event} at step ${e.step}` }));
    const loss = $("loss-chart");
    lineChart(loss, {
      series: [
        { name: "training loss", color: "#2563eb", points: train, format: fmtLoss },
        { name: "held-out loss", color: "#e4572e", points: held, dots: held.length <= 60, width: 2, format: fmtLoss },
      ],
      legend: true, xLabel: "step", yLabel: "loss (nats)", xMin: 0, markers,
      empty: "waiting for the first step…",
    });
    loss.dataset.points = String(train.length);
    loss.dataset.evalPoints = String(held.length);

    const lr = thin(m.steps.filter((p) => isNum(p.lr)).map((p) => [p.step, p.lr]), MAX_CHART_POINTS);
    lineChart($("lr-chart"), {
      series: [{ name: "learning rate", color: "#7c3aed", points: lr, format: fmtLr }],
      xLabel: "step", xMin: 0, yZero: true,
    });
    $("lr-chart").dataset.points = String(lr.length);

    const tps = thin(m.steps.filter((p) => isNum(p.tokens_per_s)).map((p) => [p.step, p.tokens_per_s]), MAX_CHART_POINTS);
    lineChart($("tps-chart"), {
      series: [{ name: "tokens/s", color: "#0f9d76", points: tps, format: fmtInt }],
      xLabel: "step", yLabel: "tokens/s", xMin: 0, yZero: true, markers,
    });
    $("tps-chart").dataset.points = String(tps.length);
  }
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { drawCharts(); drawTrack(); if (lastRing) renderRing(lastRing.job, lastRing.m); }, 150);
  });

  // ---------- ring ----------

  let lastRing = null;
  function renderRing(job, m) {
    if (m === undefined && lastRing) m = lastRing.m;
    lastRing = { job, m };
    const byId = new Map(state.workers.map((w) => [w.id, w]));
    const members = (job.workers || []).map(parseMember);
    const inRing = new Set(members.map((m) => m.id));
    const rows = members.map((mem, rank) => {
      const w = byId.get(mem.id) || {};
      const ws = w.state ? normState(w.state) : "unknown";
      const beat = w.last_heartbeat_seconds_ago;
      return el("tr", { "data-worker": mem.id, "data-rank": String(rank), "data-state": ws },
        el("td", { class: "num", text: String(rank) }),
        el("td", {}, el("strong", { text: mem.id })),
        el("td", {}, el("code", { text: mem.address || w.address || "" })),
        el("td", {}, el("span", { class: "state-dot", "data-state": ws }), ws),
        el("td", { class: "num", text: fmtInt(w.step) }),
        el("td", { class: "num", text: isNum(beat) ? fmtSeconds(beat) + " ago" : "–" }),
        el("td", { class: "num", text: fmtSeconds(w.step_seconds) }),
        el("td", { class: "num", text: fmtSeconds(w.ring_wait_seconds) }));
    });
    const table = $("ring");
    table.querySelector("tbody").replaceChildren(...rows);
    table.dataset.workers = String(rows.length);
    const st = normState(job.state);
    const noRing = ACTIVE.has(st) ? "no ring yet" : `no ring: the job is ${stateLabel(st)}`;
    $("ring-size").textContent = rows.length ? `${rows.length} worker${rows.length === 1 ? "" : "s"}, generation ${job.generation ?? "–"}` : noRing;

    const alive = new Set(state.workers.filter((w) => normState(w.state) !== "lost").map((w) => w.id));
    const lost = lostWorkers(m, inRing, alive);
    for (const w of state.workers) if (normState(w.state) === "lost" && !inRing.has(w.id) && !lost.has(w.id) && w.job === job.job_id) lost.set(w.id, null);
    drawRingDiagram($("ring-diagram"), members, byId, noRing, lost);

    // Workers outside this ring: the ones this job lost, and the cluster's others.
    const others = [];
    for (const [id, step] of lost) others.push({ id, state: "lost", text: `${id} lost` + (step !== null && step !== undefined ? ` at step ${fmtInt(step)}` : "") });
    for (const w of state.workers) {
      if (inRing.has(w.id) || lost.has(w.id)) continue;
      const ws = normState(w.state);
      others.push({ id: w.id, state: ws, text: `${w.id} ${ws}` + (w.job && w.job !== job.job_id ? ` (${w.job})` : "") });
    }
    const p = $("ring-others");
    p.replaceChildren();
    if (others.length) {
      p.append("Not in this ring: ");
      others.forEach((o, i) => {
        if (i) p.append(", ");
        p.append(el("span", { "data-other-worker": o.id, "data-state": o.state }, el("span", { class: "state-dot", "data-state": o.state }), o.text));
      });
    }
  }

  // ---------- timeline ----------

  function eventText(e) {
    switch (e.event) {
      case "resume": {
        const src = String(e.source || "").replace(/^STATE_SOURCE_/, "").toLowerCase().replace(/_/g, " ");
        return `generation ${e.generation} starts after step ${fmtInt(e.step)} with ${e.world_size} worker${e.world_size === 1 ? "" : "s"}` + (src ? ` (state from ${src})` : "");
      }
      // `generation` of recovery and grow lines is the generation being formed.
      case "recovery": return `forming generation ${e.generation} after a loss: ${e.reason || ""}`;
      case "grow": return `forming generation ${e.generation}, larger: ${e.reason || ""}`;
      case "stall": {
        const dropped = (e.dropped || []).join(", ");
        return `no progress for ${fmtDuration(e.silent_seconds)} in generation ${e.generation}` + (dropped ? `; dropped ${dropped}` : "");
      }
      default: return JSON.stringify(e);
    }
  }

  let lastTrack = null;
  function renderTimeline(job, m) {
    const events = m ? m.events : [];
    const items = [...events].reverse().map((e) => el("li", { "data-event": e.event, "data-step": String(e.step ?? ""), "data-generation": String(e.generation ?? "") },
      el("span", { class: "kind", text: e.event }),
      el("span", { class: "where", text: "step " + fmtInt(e.step) }),
      el("span", { class: "what", text: eventText(e) })));
    if (!items.length) items.push(el("li", { class: "none" }, el("span", { class: "kind muted", text: "–" }), el("span", {}), el("span", { class: "what muted", text: `generation ${job.generation ?? 1}: no recoveries` })));
    const list = $("timeline");
    list.replaceChildren(...items);
    list.dataset.events = String(events.length);
    lastTrack = { job, events };
    drawTrack();
  }

  const GEN_COLORS = ["#93c5fd", "#a5b4fc", "#86efac", "#fcd34d", "#f9a8d4", "#99f6e4", "#c4b5fd", "#fdba74"];
  function drawTrack() {
    if (!lastTrack) return;
    const { job, events } = lastTrack;
    const el_ = $("timeline-track");
    const width = Math.max(200, Math.round(el_.getBoundingClientRect().width || 400));
    const height = 46;
    el_.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const max = Math.max(1, job.max_steps || 1, job.step || 0);
    const X = (s) => 6 + (Math.min(max, Math.max(0, s)) / max) * (width - 12);
    // Generations as segments: each resume starts one; the current runs to the current step.
    const starts = events.filter((e) => e.event === "resume").map((e) => ({ gen: e.generation, step: e.step }));
    if (!starts.length || starts[0].step > 0) starts.unshift({ gen: starts.length ? Math.max(1, starts[0].gen - 1) : (job.generation || 1), step: 0 });
    const nodes = [svg("rect", { x: 6, y: 10, width: width - 12, height: 14, rx: 3, fill: "#f1f5f9" })];
    starts.forEach((s, i) => {
      const end = i + 1 < starts.length ? starts[i + 1].step : (job.step || 0);
      const x0 = X(s.step), x1 = Math.max(X(end), x0 + 2);
      const seg = svg("rect", { x: x0, y: 10, width: x1 - x0, height: 14, fill: GEN_COLORS[(s.gen || 0) % GEN_COLORS.length], "data-generation": s.gen });
      seg.append(svg("title", {}, `generation ${s.gen}: steps ${s.step}–${end}`));
      nodes.push(seg);
      if (x1 - x0 > 34) nodes.push(svg("text", { x: x0 + 4, y: 21 }, "gen " + s.gen));
    });
    for (const e of events) {
      if (e.event === "resume") continue;
      const x = X(e.step);
      const color = e.event === "grow" ? "#16a34a" : "#dc2626";
      const mark = svg("path", { d: `M${x} 8 l-4 -6 h8 z`, fill: color, "data-event": e.event });
      mark.append(svg("title", {}, `${e.event} at step ${e.step}`));
      nodes.push(mark, svg("line", { x1: x, x2: x, y1: 8, y2: 26, stroke: color, "stroke-width": 1.5 }));
    }
    nodes.push(svg("text", { x: 6, y: 40 }, "0"));
    nodes.push(svg("text", { x: width - 6, y: 40, "text-anchor": "end" }, fmtInt(max) + " steps"));
    el_.replaceChildren(...nodes);
  }

  // ---------- checkpoint ----------

  function renderCheckpoint(job) {
    const cps = (job.checkpoints || []).filter(isNum).sort((a, b) => a - b);
    const box = $("checkpoint");
    const last = cps.length ? cps[cps.length - 1] : null;
    box.dataset.step = last === null ? "" : String(last);
    const text = $("checkpoint-text");
    if (last === null) {
      text.textContent = "No checkpoint yet.";
      $("pull-box").hidden = true;
      $("pull-note").hidden = true;
      $("checkpoint-list").textContent = "";
      return;
    }
    text.replaceChildren("Last checkpoint: ", el("strong", { text: `step ${fmtInt(last)}` }),
      normState(job.state) === "completed" && last === job.step ? " (final)" : "");
    const cmd = `keel pull ${job.job_id} --step ${last} --out ${job.job_id}-step-${last}`;
    $("pull-command").textContent = cmd;
    $("pull-box").hidden = false;
    $("pull-note").hidden = false;
    $("checkpoint-list").textContent = cps.length > 1 ? "All checkpoints: steps " + cps.slice(-12).join(", ") + (cps.length > 12 ? " (the last 12)" : "") : "";
  }

  $("pull-copy").addEventListener("click", async () => {
    const text = $("pull-command").textContent;
    try {
      await navigator.clipboard.writeText(text);
      $("pull-copy").textContent = "Copied";
    } catch (e) {
      const range = document.createRange();
      range.selectNodeContents($("pull-command"));
      const sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      $("pull-copy").textContent = "Selected";
    }
    setTimeout(() => { $("pull-copy").textContent = "Copy"; }, 1500);
  });

  poll();
})(window.Keel = window.Keel || {});
