// The attention explorer: POST /v1/attention, drawn as SVG heatmaps (one <rect> per (row, key)
// pair, the exact weight on hover) and a canvas grid of every (layer, head). No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("qkv-key") || "", scaled: null, unscaled: null, input: null };

function visible(tok) {
  return tok.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function api(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const res = await fetch(path, body ? { method: "POST", headers, body: JSON.stringify(body) } : { headers });
  const data = await res.json().catch(() => ({}));
  if (res.status === 401) $("key-box").hidden = false;
  if (!res.ok) throw new Error((data.error && data.error.message) || res.statusText);
  return data;
}

function readInput() {
  const text = $("prompt").value;
  if (document.querySelector("input[name=mode]:checked").value === "prompt") return { prompt: text };
  const messages = text.split("\n").filter((l) => l.trim()).map((line) => {
    const m = line.match(/^\s*(system|user|assistant)\s*:\s?(.*)$/);
    return m ? { role: m[1], content: m[2] } : { role: "user", content: line };
  });
  return { messages };
}

async function fetchMaps(input, maxTokens, scale) {
  return api("/v1/attention", { ...input, max_tokens: maxTokens, scale });
}

async function run(maxTokens = 0) {
  state.input = readInput();
  setStatus("computing\u2026");
  try {
    state.scaled = await fetchMaps(state.input, maxTokens, "sqrt_dk");
    state.unscaled = $("compare").checked ? await fetchMaps(state.input, maxTokens, "none") : null;
    fillSelectors();
    draw();
    setStatus(`${state.scaled.tokens.length} tokens, ${state.scaled.attention_kind} attention`);
  } catch (err) {
    setStatus(err.message, true);
  }
}

async function generate() {
  // One request per new token (greedy, so each extends the last): rows appear as they come.
  const n = Math.max(1, Math.min(64, parseInt($("gen-n").value, 10) || 1));
  const base = state.scaled ? state.scaled.max_tokens_done || 0 : 0;
  for (let k = base + 1; k <= base + n; k++) {
    await run(k);
    if (!state.scaled) return;
    state.scaled.max_tokens_done = k;
    setStatus(`generated ${k} token(s)`);
  }
}

function fillSelectors() {
  const d = state.scaled;
  $("compare").disabled = d.attention_kind !== "dot";  // scale "none" exists for dot products only
  for (const [id, list] of [["layer", d.layers], ["head", d.heads]]) {
    const sel = $(id), keep = sel.value;
    if (sel.options.length !== list.length) {
      sel.innerHTML = list.map((v, i) => `<option value="${i}">${v}</option>`).join("");
      if (keep && keep < list.length) sel.value = keep;
    }
  }
}

function color(w) {
  const c = Math.round(255 * (1 - Math.min(1, w)));
  return `rgb(${c},${Math.round(c * 0.9 + 25 * (1 - w))},255)`;
}

function heatmap(el, data, li, hi) {
  const rows = data.rows, toks = data.tokens, W = data.attention[li][hi];
  const n = toks.length, cs = Math.max(10, Math.min(24, Math.floor(480 / n)));
  const label = 90, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", label + cs * n + 4);
  svg.setAttribute("height", label + cs * rows.length + 4);
  const text = (x, y, s, rot) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.textContent = s;
    if (rot) t.setAttribute("transform", `rotate(-90 ${x} ${y})`);
    else t.setAttribute("text-anchor", "end");
    svg.appendChild(t);
  };
  toks.forEach((tok, k) => text(label + k * cs + cs * 0.7, label - 4, visible(tok), true));
  rows.forEach((r, i) => text(label - 4, label + i * cs + cs * 0.75, visible(toks[r])));
  rows.forEach((r, i) => {
    for (let k = 0; k < n; k++) {
      const w = W[i][k], rect = document.createElementNS(ns, "rect");
      rect.setAttribute("class", "cell");
      rect.setAttribute("x", label + k * cs); rect.setAttribute("y", label + i * cs);
      rect.setAttribute("width", cs - 1); rect.setAttribute("height", cs - 1);
      rect.setAttribute("fill", k > r ? "#f2f2f2" : color(w));
      rect.dataset.row = r; rect.dataset.key = k; rect.dataset.w = String(w);
      svg.appendChild(rect);
    }
  });
  svg.addEventListener("mousemove", (ev) => {
    const t = ev.target;
    if (!t.dataset || t.dataset.w === undefined) { $("tooltip").hidden = true; return; }
    const r = +t.dataset.row, k = +t.dataset.key;
    $("tooltip").textContent = `query ${r} "${visible(toks[r])}" \u2192 key ${k} "${visible(toks[k])}"\n` +
      `weight ${t.dataset.w}` + (k > r ? " (future key: masked)" : "");
    Object.assign($("tooltip").style, { left: ev.clientX + 14 + "px", top: ev.clientY + 14 + "px" });
    $("tooltip").hidden = false;
  });
  svg.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  el.replaceChildren(svg);
}

function caption(data, li, hi, what) {
  const std = data.score_std[li][hi].toFixed(3), ent = data.entropy[li][hi].toFixed(3);
  return `layer ${data.layers[li]}, head ${data.heads[hi]} \u2014 ${what}: score std ${std}, mean row entropy ${ent} nats`;
}

function draw() {
  const d = state.scaled;
  if (!d) return;
  const li = +$("layer").value || 0, hi = +$("head").value || 0;
  const dk = d.head_dim;
  heatmap($("map-scaled"), d, li, hi);
  $("cap-scaled").textContent = caption(d, li, hi, d.attention_kind === "dot" ? `scaled by 1/\u221a${dk}` : "additive");
  const u = state.unscaled;
  $("fig-unscaled").hidden = !u;
  if (u) {
    heatmap($("map-unscaled"), u, li, hi);
    $("cap-unscaled").textContent = caption(u, li, hi, "without 1/\u221ad_k");
  }
  drawGrid(d, li, hi);
}

function drawGrid(d, li, hi) {
  const grid = $("grid"), n = d.tokens.length, px = Math.max(2, Math.floor(64 / n));
  grid.style.gridTemplateColumns = `auto repeat(${d.heads.length}, auto)`;
  grid.replaceChildren();
  const cell = (s) => { const e = document.createElement("span"); e.className = "label"; e.textContent = s; grid.appendChild(e); };
  cell("");
  d.heads.forEach((h) => cell(`head ${h}`));
  d.layers.forEach((layer, l) => {
    cell(`layer ${layer}`);
    d.heads.forEach((h, j) => {
      const c = document.createElement("canvas");
      c.width = c.height = n * px;
      c.title = `layer ${layer}, head ${h}: score std ${d.score_std[l][j].toFixed(3)}, entropy ${d.entropy[l][j].toFixed(3)}`;
      if (l === li && j === hi) c.className = "selected";
      const ctx = c.getContext("2d");
      d.attention[l][j].forEach((row, i) => row.forEach((w, k) => {
        ctx.fillStyle = k > d.rows[i] ? "#f2f2f2" : color(w);
        ctx.fillRect(k * px, i * px, px, px);
      }));
      c.addEventListener("click", () => { $("layer").value = l; $("head").value = j; draw(); });
      grid.appendChild(c);
    });
  });
}

async function init() {
  $("run").addEventListener("click", () => run(0));
  $("generate").addEventListener("click", generate);
  $("layer").addEventListener("change", draw);
  $("head").addEventListener("change", draw);
  $("compare").addEventListener("change", async () => {
    if ($("compare").checked && state.scaled && !state.unscaled) {
      try {
        state.unscaled = await fetchMaps(state.input, state.scaled.max_tokens_done || 0, "none");
      } catch (err) { setStatus(err.message, true); $("compare").checked = false; }
    } else if (!$("compare").checked) state.unscaled = null;
    draw();
  });
  $("key-save").addEventListener("click", () => {
    state.key = $("api-key").value.trim();
    sessionStorage.setItem("qkv-key", state.key);
    $("key-box").hidden = true;
    loadModel();
  });
  loadModel();
}

async function loadModel() {
  try {
    const models = await api("/v1/models");
    $("model-info").textContent = models.data.map((m) => m.id).join(", ");
  } catch (err) { setStatus(err.message, true); }
}

init();
