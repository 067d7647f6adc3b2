// The playground page: editors, one call into the engine, tables and inline SVG charts.
// Plain script (no modules, no fetch): it must run from file://, offline.
"use strict";

const PLUGINS = [
  { id: "latency_guard", name: "latency-guard", preset: "latency-guard.demo.json" },
  { id: "model_router", name: "model-router", preset: "model-router.demo.json" },
  { id: "tenant_budget", name: "tenant-budget", preset: "tenant-budget.full.json" },
];
// Broken policies the URL can ask for (?case=…): the page then shows the plugin's own refusal.
const CASES = {
  "broken-budget": { plugin: "tenant_budget", edit: (p) => { p.orgs[0].budgets[0].reset_day = 31; } },
  "broken-router": { plugin: "model_router", edit: (p) => { p.models[0].versions[0].weight = -1; } },
  "broken-guard": { plugin: "latency_guard", edit: (p) => { p.versions[0].breaker.window_s = 0; } },
};
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const SVG = "http://www.w3.org/2000/svg";
let engine = null;

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function setStatus(node, ok, text) {
  node.className = "status " + (ok ? "ok" : "error");
  node.textContent = text;
}

function buildEditors() {
  const root = document.getElementById("editors");
  for (const p of PLUGINS) {
    const box = el("div", { class: "editor", id: "editor-" + p.name });
    const header = el("header");
    header.appendChild(el("b", {}, p.name));
    const pick = el("select", { id: "pick-" + p.name });
    pick.appendChild(el("option", { value: "" }, "(not in the chain)"));
    for (const file of Object.keys(self.SLUICE_EXAMPLES.policies[p.name])) pick.appendChild(el("option", { value: file }, file));
    pick.value = p.preset;
    header.appendChild(pick);
    const check = el("button", {}, "Check");
    header.appendChild(check);
    box.appendChild(header);
    const area = el("textarea", { id: "policy-" + p.name, spellcheck: "false" });
    area.value = self.SLUICE_EXAMPLES.policies[p.name][p.preset] || "";
    box.appendChild(area);
    box.appendChild(el("p", { class: "status", id: "status-" + p.name }));
    pick.addEventListener("change", () => { area.value = pick.value ? self.SLUICE_EXAMPLES.policies[p.name][pick.value] : ""; checkPolicy(p); });
    check.addEventListener("click", () => checkPolicy(p));
    root.appendChild(box);
  }
  document.getElementById("workload").value = self.SLUICE_EXAMPLES.workload;
}

function checkPolicy(p) {
  const text = document.getElementById("policy-" + p.name).value;
  const status = document.getElementById("status-" + p.name);
  if (!text.trim()) { setStatus(status, true, "not in the chain"); return true; }
  const r = JSON.parse(engine.compile_policy(p.name, text));
  setStatus(status, r.ok, r.ok ? r.summary : r.log);
  return r.ok;
}

function applyCase() {
  const name = new URLSearchParams(location.search).get("case") || location.hash.replace(/^#case=/, "");
  const c = CASES[name];
  if (!c) return;
  const p = PLUGINS.find((x) => x.id === c.plugin);
  const area = document.getElementById("policy-" + p.name);
  const policy = JSON.parse(area.value);
  c.edit(policy);
  area.value = JSON.stringify(policy, null, 2);
  document.body.setAttribute("data-case", name);
}

function run() {
  const status = document.getElementById("run-status");
  let ok = true;
  for (const p of PLUGINS) ok = checkPolicy(p) && ok;
  const input = { workload: document.getElementById("workload").value };
  for (const p of PLUGINS) input[p.id] = document.getElementById("policy-" + p.name).value;
  const trace = document.getElementById("trace").value;
  if (trace.trim()) input.trace = trace;
  const t0 = performance.now();
  const r = JSON.parse(engine.run_workload(JSON.stringify(input)));
  if (!r.ok) {
    setStatus(status, false, r.log);
    document.body.setAttribute("data-run", "error");
    return;
  }
  const n = r.result.verdicts.length;
  setStatus(status, ok, `${n} requests over ${(r.result.span_ms / 1000).toFixed(1)} s of virtual time in ${Math.round(performance.now() - t0)} ms`);
  render(r.result);
  document.body.setAttribute("data-run", "done");
}

function fill(tbody, rows) {
  tbody.replaceChildren();
  for (const cells of rows) {
    const tr = el("tr");
    for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", {}, c));
    tbody.appendChild(tr);
  }
  return tbody;
}

function render(result) {
  const body = document.querySelector("#verdict-table tbody");
  body.replaceChildren();
  for (const t of result.tenants) {
    const tr = el("tr", { "data-tenant": t.tenant });
    const cells = [["tenant", t.tenant], ["requests", t.requests], ["admitted", t.admitted], ["clamped", t.clamped], ["refused", t.refused],
      ["refusals", Object.entries(t.refusals).map(([c, k]) => `${c}: ${k}`).join(", ")], ["tokens", t.charged_tokens], ["usd", (t.charged_micro_usd / 1e6).toFixed(4)]];
    for (const [cls, v] of cells) tr.appendChild(el("td", { class: cls }, v));
    body.appendChild(tr);
  }
  fill(document.querySelector("#transitions tbody"), result.transitions.map((t) => [(t.t_ms / 1000).toFixed(3), t.version, t.from, t.to, t.reason]));
  fill(document.querySelector("#requests tbody"), result.verdicts.slice(0, 1000).map((v) => [v.line, v.arrival_ms, v.tenant || "", v.decision, v.status, v.code || "",
    v.version || "", v.route_reason || "", v.shadow_version || "", v.class || "", v.ttft_ms === null ? "" : v.ttft_ms.toFixed(1), v.charged_input_tokens + v.charged_output_tokens]));
  const charts = document.getElementById("charts");
  charts.replaceChildren();
  const s = result.series;
  const t = s.t_ms.map((x) => x / 1000);
  charts.appendChild(chart("Spend per tenant (cumulative USD)", t, mapSeries(s.spend_micro_usd, (v) => v / 1e6), "line"));
  const budgets = {};
  for (const b of s.budgets) budgets[`${b.code} (of ${b.limit})`] = b.remaining.map((r) => (100 * r) / Math.max(1, b.limit));
  charts.appendChild(chart("Budgets remaining (% of limit)", t, budgets, "line"));
  charts.appendChild(chart("Refusals per interval, by code", t, s.refused_by_code, "bars"));
  charts.appendChild(chart("Admitted per interval, by version (the split)", t, s.admitted_by_version, "bars"));
  charts.appendChild(chart("Breaker state (0 closed, 1 open, 2 half-open)", t, s.breakers, "line"));
}

function mapSeries(obj, f) {
  const out = {};
  for (const [k, v] of Object.entries(obj)) out[k] = v.map(f);
  return out;
}

// One chart: step lines or stacked bars over the sample times, a legend, a <title> on each mark.
function chart(title, xs, series, kind) {
  const wrap = el("div", { class: "chart" });
  wrap.appendChild(el("h3", {}, title));
  const names = Object.keys(series);
  if (!names.length || !xs.length) { wrap.appendChild(el("p", {}, "Nothing to show for this workload.")); return wrap; }
  const W = 900, H = 220, L = 50, B = 24;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("role", "img");
  const n = xs.length;
  const stacked = xs.map((_, i) => names.reduce((a, k) => a + (series[k][i] || 0), 0));
  const max = Math.max(1e-9, ...(kind === "bars" ? stacked : names.flatMap((k) => series[k])));
  const x = (i) => L + ((W - L - 10) * i) / Math.max(1, n - 1);
  const y = (v) => H - B - ((H - B - 10) * v) / max;
  const line = (x1, y1, x2, y2, color) => { const l = document.createElementNS(SVG, "line"); for (const [a, b] of [["x1", x1], ["y1", y1], ["x2", x2], ["y2", y2], ["stroke", color]]) l.setAttribute(a, b); return l; };
  svg.appendChild(line(L, H - B, W - 10, H - B, "#999"));
  svg.appendChild(line(L, 10, L, H - B, "#999"));
  for (const [v, label] of [[0, "0"], [max, max >= 100 ? Math.round(max) : max.toPrecision(3)]]) {
    const tx = document.createElementNS(SVG, "text"); tx.setAttribute("x", 2); tx.setAttribute("y", y(v) + 4); tx.setAttribute("font-size", "10"); tx.textContent = label; svg.appendChild(tx);
  }
  const last = document.createElementNS(SVG, "text"); last.setAttribute("x", W - 60); last.setAttribute("y", H - 6); last.setAttribute("font-size", "10"); last.textContent = `${xs[n - 1]} s`; svg.appendChild(last);
  names.forEach((k, j) => {
    const color = COLORS[j % COLORS.length];
    if (kind === "bars") {
      const w = Math.max(1, (W - L - 10) / n - 1);
      series[k].forEach((v, i) => {
        if (!v) return;
        const below = names.slice(0, j).reduce((a, m) => a + (series[m][i] || 0), 0);
        const r = document.createElementNS(SVG, "rect");
        r.setAttribute("x", x(i) - w / 2); r.setAttribute("width", w); r.setAttribute("y", y(below + v)); r.setAttribute("height", y(below) - y(below + v)); r.setAttribute("fill", color);
        const tip = document.createElementNS(SVG, "title"); tip.textContent = `${k} at ${xs[i]} s: ${v}`; r.appendChild(tip);
        svg.appendChild(r);
      });
    } else {
      const p = document.createElementNS(SVG, "polyline");
      p.setAttribute("points", series[k].map((v, i) => `${x(i)},${y(v)}`).join(" "));
      p.setAttribute("fill", "none"); p.setAttribute("stroke", color); p.setAttribute("stroke-width", "2");
      const tip = document.createElementNS(SVG, "title"); tip.textContent = `${k}: last ${series[k][n - 1]}`; p.appendChild(tip);
      svg.appendChild(p);
    }
  });
  wrap.appendChild(svg);
  const legend = el("p", { class: "legend" });
  names.forEach((k, j) => { const s = el("span"); const i = el("i"); i.style.background = COLORS[j % COLORS.length]; s.appendChild(i); s.appendChild(document.createTextNode(k)); legend.appendChild(s); });
  wrap.appendChild(legend);
  return wrap;
}

function decode(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return bytes;
}

async function start() {
  const load = document.getElementById("load-status");
  if (!self.SLUICE_EXAMPLES || !self.SLUICE_PLAYGROUND_WASM || typeof wasm_bindgen === "undefined") {
    setStatus(load, false, "The engine is not built: run `cargo xtask playground` (it writes examples/playground/pkg/), then reload.");
    document.body.setAttribute("data-run", "error");
    return;
  }
  try {
    // Instantiated from the embedded bytes: nothing is fetched (file:// forbids it).
    await wasm_bindgen({ module_or_path: decode(self.SLUICE_PLAYGROUND_WASM) });
  } catch (e) {
    setStatus(load, false, "The engine failed to load: " + e);
    document.body.setAttribute("data-run", "error");
    return;
  }
  engine = wasm_bindgen;
  setStatus(load, true, `Engine loaded (${Math.round((self.SLUICE_PLAYGROUND_WASM.length * 3) / 4 / 1024)} KiB of wasm).`);
  buildEditors();
  applyCase();
  document.getElementById("run").addEventListener("click", run);
  run();
}

start();
