// Keel dashboard, the ring diagram: the job's ring as a circle of workers (rank r sends to
// rank r+1) and the workers it lost beside it. Needs common.js.
"use strict";

(function (Keel) {
  const { normState, fmtInt, svg } = Keel;

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

  const STATE_COLORS = { training: "#16a34a", idle: "#94a3b8", lost: "#dc2626", unknown: "#94a3b8" };
  // The ring as a circle: rank r sends its gradients to rank r+1; lost workers that last
  // belonged to this job sit outside it.
  function drawRingDiagram(el_, members, byId, noRing, lostIds) {
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

  Object.assign(Keel, { lostWorkers, drawRingDiagram });
})(window.Keel = window.Keel || {});
