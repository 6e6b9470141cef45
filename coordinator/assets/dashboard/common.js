// Keel dashboard, shared helpers: number and state formatting, and the HTML/SVG element
// builders. Loaded first; the other scripts take these from the `Keel` namespace object.
"use strict";

(function (Keel) {
  const SVG_NS = "http://www.w3.org/2000/svg";

  // ---------- formatting ----------

  const isNum = (v) => typeof v === "number" && isFinite(v);
  const normState = (s) => String(s || "unknown").replace(/-/g, "_").toLowerCase();
  const stateLabel = (s) => normState(s).replace(/_/g, " ");

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

  Object.assign(Keel, { isNum, normState, stateLabel, fmtLoss, fmtLr, fmtInt, fmtSeconds, fmtDuration, parseMember, el, svg });
})(window.Keel = window.Keel || {});
