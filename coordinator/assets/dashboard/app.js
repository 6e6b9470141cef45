// Keel dashboard: polls the coordinator's JSON API every 2 s and draws the jobs, the chosen
// job's curves (inline SVG, no library), its ring, its generations and its last checkpoint.
// Plain JavaScript, no build step, no request leaves this coordinator.
"use strict";

(function () {
  const POLL_MS = 2000;
  const TOKEN_KEY = "keel-token";
  const MAX_CHART_POINTS = 1500; // per series; longer series are thinned (min/max per bucket)
  const SVG_NS = "http://www.w3.org/2000/svg";

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

  // ---------- formatting ----------

  const isNum = (v) => typeof v === "number" && isFinite(v);
  const normState = (s) => String(s || "unknown").replace(/-/g, "_").toLowerCase();
  const stateLabel = (s) => normState(s).replace(/_/g, " ");
  const ACTIVE = new Set(["running", "recovering", "waiting_for_workers", "preparing", "queued"]);

  function fmtLoss(v) { return isNum(v) ? v.toFixed(3) : "–"; }
  function fmtLr(v) {
    if (!isNum(v)) return "–";
    if (v === 0) return "0";
    return v.toExponential(2).replace("e-", "e−");
  }
  function fmtInt(v) { return isNum(v) ? Math.round(v).toLocaleString("en-US") : "–"; }
  function fmtSeconds(v) {
    if (!isNum(v)) return "–";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 1 : 0) + " ms";
    if (v < 10) return v.toFixed(2) + " s";
    return v.toFixed(1) + " s";
  }
  function fmtDuration(s) {
    if (!isNum(s)) return "–";
    s = Math.max(0, Math.round(s));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    if (h > 0) return h + "h " + String(m).padStart(2, "0") + "m";
    if (m > 0) return m + "m " + String(sec).padStart(2, "0") + "s";
    return sec + "s";
  }
  function fmtTick(v, step) {
    const a = Math.abs(v);
    if (v === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(step >= 1e6 ? 0 : 1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(step >= 1e3 ? 0 : 1) + "k";
    if (a < 1e-2) {
      let d = 0;
      while (d < 4 && Math.abs(Number(v.toExponential(d)) - v) > step * 1e-3) d++;
      return v.toExponential(d).replace("e-", "e−");
    }
    const decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
    return v.toFixed(decimals);
  }

  // "w-1 (127.0.0.1:7071)" -> { id: "w-1", address: "127.0.0.1:7071" }
  function parseMember(text) {
    const m = /^\s*(\S+)\s*\((.*)\)\s*$/.exec(String(text));
    return m ? { id: m[1], address: m[2] } : { id: String(text).trim(), address: "" };
  }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

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
    err.hidden = !job.error;
    err.textContent = job.error || "";

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

  // ---------- charts ----------

  // Thins a series to at most `max` points, keeping each bucket's min and max.
  function thin(points, max) {
    if (points.length <= max) return points;
    const out = [];
    const per = Math.ceil(points.length / (max / 2));
    for (let i = 0; i < points.length; i += per) {
      let lo = null, hi = null;
      for (let k = i; k < Math.min(points.length, i + per); k++) {
        const p = points[k];
        if (lo === null || p[1] < lo[1]) lo = p;
        if (hi === null || p[1] > hi[1]) hi = p;
      }
      if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
    }
    return out;
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
  }
  function ticks(lo, hi, count) {
    if (!(hi > lo)) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
    const step = niceStep(hi - lo, count);
    const start = Math.floor(lo / step) * step, end = Math.ceil(hi / step) * step;
    const out = [];
    for (let v = start; v <= end + step * 1e-6; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return { lo: start, hi: end, step, values: out };
  }

  // Draws a line chart into `svgEl`. series: [{ name, color, points: [[x, y]], dots }]
  function lineChart(svgEl, opts) {
    const width = Math.max(240, Math.round(svgEl.getBoundingClientRect().width || svgEl.parentElement.clientWidth || 600));
    const height = Math.max(120, Math.round(svgEl.getBoundingClientRect().height || 260));
    svgEl.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const nodes = [];
    const all = opts.series.flatMap((s) => s.points);
    const pad = { l: 52, r: 14, t: opts.legend ? 26 : 10, b: 34 };
    const W = width - pad.l - pad.r, H = height - pad.t - pad.b;
    if (!all.length) {
      nodes.push(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "no-data" }, opts.empty || "no data yet"));
      svgEl.replaceChildren(...nodes);
      return;
    }
    let xmin = Math.min(...all.map((p) => p[0])), xmax = Math.max(...all.map((p) => p[0]));
    if (isNum(opts.xMax) && opts.xMax > xmax) xmax = opts.xMax;
    if (isNum(opts.xMin)) xmin = Math.min(xmin, opts.xMin);
    let ymin = Math.min(...all.map((p) => p[1])), ymax = Math.max(...all.map((p) => p[1]));
    if (opts.yZero) ymin = Math.min(0, ymin);
    const xt = ticks(xmin, xmax, Math.max(2, Math.floor(W / 90)));
    const yt = ticks(ymin, ymax, Math.max(2, Math.floor(H / 45)));
    const xLo = isNum(opts.xMin) ? Math.min(opts.xMin, xmin) : xt.lo;
    const xHi = Math.max(xmax, xLo + 1);
    const X = (x) => pad.l + ((x - xLo) / (xHi - xLo)) * W;
    const Y = (y) => pad.t + H - ((y - yt.lo) / (yt.hi - yt.lo)) * H;

    for (const v of yt.values) {
      const y = Y(v);
      nodes.push(svg("line", { x1: pad.l, x2: pad.l + W, y1: y, y2: y, class: "grid-line" }));
      nodes.push(svg("text", { x: pad.l - 6, y: y + 4, "text-anchor": "end" }, fmtTick(v, yt.step)));
    }
    for (const v of xt.values) {
      if (v < xLo - 1e-9 || v > xHi + 1e-9) continue;
      const x = X(v);
      nodes.push(svg("line", { x1: x, x2: x, y1: pad.t, y2: pad.t + H, class: "grid-line" }));
      nodes.push(svg("line", { x1: x, x2: x, y1: pad.t + H, y2: pad.t + H + 4, class: "axis" }));
      nodes.push(svg("text", { x, y: pad.t + H + 16, "text-anchor": "middle" }, fmtTick(v, xt.step)));
    }
    nodes.push(svg("line", { x1: pad.l, x2: pad.l, y1: pad.t, y2: pad.t + H, class: "axis" }));
    nodes.push(svg("line", { x1: pad.l, x2: pad.l + W, y1: pad.t + H, y2: pad.t + H, class: "axis" }));
    if (opts.xLabel) nodes.push(svg("text", { x: pad.l + W / 2, y: height - 3, "text-anchor": "middle", class: "axis-title" }, opts.xLabel));
    if (opts.yLabel) nodes.push(svg("text", { x: 12, y: pad.t + H / 2, transform: `rotate(-90 12 ${pad.t + H / 2})`, "text-anchor": "middle", class: "axis-title" }, opts.yLabel));

    for (const ev of opts.markers || []) {
      if (ev.x < xLo || ev.x > xHi) continue;
      const x = X(ev.x);
      const line = svg("line", { x1: x, x2: x, y1: pad.t, y2: pad.t + H, class: "event-line", "data-event": ev.kind });
      line.append(svg("title", {}, ev.title));
      nodes.push(line);
    }

    for (const s of opts.series) {
      if (!s.points.length) continue;
      const d = s.points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join("");
      nodes.push(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.6, "stroke-linejoin": "round", "data-series": s.name }));
      if (s.dots) for (const p of s.points) nodes.push(svg("circle", { cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: 3, fill: "#fff", stroke: s.color, "stroke-width": 1.6 }));
    }

    if (opts.legend) {
      let x = pad.l + W;
      const items = opts.series.filter((s) => s.legend !== false).reverse();
      for (const s of items) {
        const label = s.name;
        const w = 22 + label.length * 6.4;
        x -= w;
        nodes.push(svg("line", { x1: x, x2: x + 16, y1: 12, y2: 12, stroke: s.color, "stroke-width": 2.5 }));
        if (s.dots) nodes.push(svg("circle", { cx: x + 8, cy: 12, r: 3, fill: "#fff", stroke: s.color, "stroke-width": 1.6 }));
        nodes.push(svg("text", { x: x + 20, y: 16 }, label));
        x -= 12;
      }
    }

    // Hover read-out: the nearest point of each series at the pointer's step.
    const hover = svg("g", { class: "hover", visibility: "hidden" });
    nodes.push(hover);
    const hit = svg("rect", { x: pad.l, y: pad.t, width: W, height: H, fill: "transparent" });
    nodes.push(hit);
    hit.addEventListener("mousemove", (ev) => {
      const box = svgEl.getBoundingClientRect();
      const px = ((ev.clientX - box.left) / box.width) * width;
      const xv = xLo + ((px - pad.l) / W) * (xHi - xLo);
      const rows = [];
      let xs = null;
      for (const s of opts.series) {
        if (!s.points.length) continue;
        let best = s.points[0];
        for (const p of s.points) if (Math.abs(p[0] - xv) < Math.abs(best[0] - xv)) best = p;
        if (xs === null) xs = best[0];
        rows.push(`${s.name}: ${(s.format || String)(best[1])}`);
      }
      const parts = [svg("line", { x1: X(xs), x2: X(xs), y1: pad.t, y2: pad.t + H, class: "hover-line" })];
      const lines = [`step ${fmtInt(xs)}`, ...rows];
      const tw = 12 + Math.max(...lines.map((l) => l.length)) * 6.2, th = 8 + lines.length * 15;
      let tx = X(xs) + 10;
      if (tx + tw > pad.l + W) tx = X(xs) - 10 - tw;
      const tip = svg("g", { class: "tip" });
      tip.append(svg("rect", { x: tx, y: pad.t + 4, width: tw, height: th, rx: 4 }));
      lines.forEach((l, i) => tip.append(svg("text", { x: tx + 6, y: pad.t + 18 + i * 15 }, l)));
      parts.push(tip);
      hover.replaceChildren(...parts);
      hover.setAttribute("visibility", "visible");
    });
    hit.addEventListener("mouseleave", () => hover.setAttribute("visibility", "hidden"));

    svgEl.replaceChildren(...nodes);
  }

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
      .filter((e) => e.event === "recovery" || e.event === "stall" || e.event === "grow")
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

  // Workers the job lost, from its recovery lines ("worker w-2 (127.0.0.1:7072), rank 1, ...")
  // and stall lines (`dropped`): /api/workers forgets a worker whose connection closed.
  function lostWorkers(m, inRing, alive) {
    const lost = new Map();
    for (const e of m ? m.events : []) {
      const ids = [];
      if (e.event === "recovery") {
        const r = /worker (\S+) \(([^)]*)\)/.exec(String(e.reason || ""));
        if (r) ids.push(r[1]);
      } else if (e.event === "stall") ids.push(...(e.dropped || []));
      for (const id of ids) lost.set(id, e.step);
    }
    for (const id of [...lost.keys()]) if (inRing.has(id) || alive.has(id)) lost.delete(id);
    return lost; // id -> step
  }

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
    drawRingDiagram(members, byId, job, noRing, lost);

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

  const STATE_COLORS = { training: "#16a34a", idle: "#94a3b8", lost: "#dc2626", unknown: "#94a3b8" };
  // The ring as a circle: rank r sends its gradients to rank r+1; lost workers that last
  // belonged to this job sit outside it.
  function drawRingDiagram(members, byId, job, noRing, lostIds) {
    const el_ = $("ring-diagram");
    const width = Math.max(240, Math.round(el_.getBoundingClientRect().width || 400));
    const height = Math.max(120, Math.round(el_.getBoundingClientRect().height || 200));
    el_.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const nodes = [];
    const defs = svg("defs");
    const marker = svg("marker", { id: "ring-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    marker.append(svg("path", { d: "M0 0 L10 5 L0 10 z", fill: "#94a3b8" }));
    defs.append(marker);
    nodes.push(defs);
    const n = members.length;
    const cx = width / 2, cy = height / 2 + 2, R = Math.min(height / 2 - 50, width / 4), r = 22;
    if (!n) {
      nodes.push(svg("text", { x: cx, y: cy, "text-anchor": "middle", class: "no-data" }, noRing));
      el_.replaceChildren(...nodes);
      return;
    }
    const pos = members.map((_, i) => {
      const a = (n === 2 ? Math.PI : -Math.PI / 2) + (2 * Math.PI * i) / n;
      return [cx + R * Math.cos(a), cy + R * Math.sin(a)];
    });
    if (n > 1) {
      for (let i = 0; i < n; i++) {
        const [x0, y0] = pos[i], [x1, y1] = pos[(i + 1) % n];
        const dx = x1 - x0, dy = y1 - y0, len = Math.hypot(dx, dy) || 1;
        const ux = dx / len, uy = dy / len;
        // Bend each edge slightly outwards so that a 2-worker ring shows both directions.
        const bend = n === 2 ? 26 : 14;
        const mx = (x0 + x1) / 2 - uy * bend, my = (y0 + y1) / 2 + ux * bend;
        nodes.push(svg("path", {
          d: `M${x0 + ux * (r + 3)} ${y0 + uy * (r + 3)} Q${mx} ${my} ${x1 - ux * (r + 5)} ${y1 - uy * (r + 5)}`,
          fill: "none", stroke: "#94a3b8", "stroke-width": 1.5, "marker-end": "url(#ring-arrow)",
        }));
      }
    }
    members.forEach((mem, i) => {
      const w = byId.get(mem.id) || {};
      const ws = w.state ? normState(w.state) : "unknown";
      const [x, y] = pos[i];
      const g = svg("g", { "data-worker": mem.id, "data-rank": String(i) });
      g.append(svg("circle", { cx: x, cy: y, r, fill: "#fff", stroke: STATE_COLORS[ws] || "#94a3b8", "stroke-width": 3 }));
      g.append(svg("text", { x, y: y + 4, "text-anchor": "middle", "font-weight": 600 }, mem.id));
      const a = Math.atan2(y - cy, x - cx);
      const lx = x + Math.cos(a) * (r + 16), ly = y + Math.sin(a) * (r + 12) + 4;
      const anchor = Math.abs(Math.cos(a)) < 0.3 ? "middle" : Math.cos(a) > 0 ? "start" : "end";
      g.append(svg("text", { x: lx, y: ly, "text-anchor": n === 1 ? "middle" : anchor, class: "node-sub" }, "rank " + i));
      g.append(svg("title", {}, `${mem.id} ${mem.address} · ${ws}`));
      nodes.push(g);
    });
    [...lostIds.keys()].slice(-4).forEach((id, i) => {
      const x = width - 40, y = 30 + i * 44;
      const g = svg("g", { "data-lost-worker": id });
      g.append(svg("circle", { cx: x, cy: y, r: 17, fill: "#fff", stroke: "#dc2626", "stroke-width": 2, "stroke-dasharray": "3 2" }));
      g.append(svg("text", { x, y: y + 4, "text-anchor": "middle", class: "node-sub" }, id));
      const step = lostIds.get(id);
      g.append(svg("text", { x: x - 24, y: y + 4, "text-anchor": "end", class: "node-sub lost" }, "lost" + (step !== null && step !== undefined ? ` at step ${fmtInt(step)}` : "")));
      nodes.push(g);
    });
    el_.replaceChildren(...nodes);
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
})();
