// Keel dashboard, charts: line charts drawn as inline SVG (no library): axes, nice ticks,
// grid, event markers, legend and the hover read-out; and thinning of long series.
// Needs common.js.
"use strict";

(function (Keel) {
  const { isNum, fmtInt, svg } = Keel;

  // Axis tick labels: short (1.5k, 2M, 3e−4) with as many decimals as the tick step needs.
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

  Object.assign(Keel, { thin, lineChart });
})(window.Keel = window.Keel || {});
