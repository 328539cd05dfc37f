// The attention explorer: POST /v1/attention, drawn as SVG heatmaps (one <rect> per (row, key)
// pair, the exact weight on hover) and a canvas grid of every (layer, head). No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("qkv-key") || "", scaled: null, unscaled: null, input: null, image: null };

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
  if (document.querySelector("input[name=mode]:checked").value === "prompt") {
    if (state.image) throw new Error("an image goes with chat messages: pick the chat mode");
    return { prompt: text };
  }
  const messages = text.split("\n").filter((l) => l.trim()).map((line) => {
    const m = line.match(/^\s*(system|user|assistant)\s*:\s?(.*)$/);
    return m ? { role: m[1], content: m[2] } : { role: "user", content: line };
  });
  const user = messages.find((m) => m.role === "user");
  if (state.image && !user) throw new Error("an image goes in a user message: add a line `user: ...`");
  if (state.image) user.content = [{ type: "image_url", image_url: { url: state.image } }, { type: "text", text: user.content }];
  return { messages };
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function fetchMaps(input, maxTokens, scale) {
  return api("/v1/attention", { ...input, max_tokens: maxTokens, scale });
}

async function run(maxTokens = 0) {
  setStatus("computing\u2026");
  try {
    state.input = readInput();
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
  drawPatches(d, li, hi);
}

// Where the chosen query token's attention falls on each image: the image's patch grid (rows x
// cols, row-major; its token offset + j shows patch j - (length - rows * cols)), each patch shaded
// by its weight over the image's largest, over the picture when the page sent it.
function drawPatches(d, li, hi) {
  $("patches").hidden = !d.images;
  if (!d.images) return;
  const sel = $("query"), keep = sel.value, last = d.rows.length - 1;
  if (sel.options.length !== d.rows.length) {
    sel.innerHTML = d.rows.map((r, i) => `<option value="${i}">${r}: ${visible(d.tokens[r])}</option>`).join("");
    sel.value = keep && keep < d.rows.length ? keep : last;
  }
  const i = +sel.value, W = d.attention[li][hi][i];
  $("patch-maps").replaceChildren(...d.images.map((im) => patchMap(im, W, d.rows[i])));
}

function patchMap(im, W, row) {
  const fig = document.createElement("figure"), c = document.createElement("canvas");
  const lead = im.length - im.rows * im.cols, cell = Math.max(8, Math.floor(320 / Math.max(im.rows, im.cols)));
  c.width = im.cols * cell; c.height = im.rows * cell;
  const weights = [];  // [patch, weight]; a negative patch is a class token
  for (let j = 0; j < im.length; j++) weights.push([j - lead, W[im.offset + j]]);
  const top = Math.max(1e-12, ...weights.map(([, w]) => w));
  const total = weights.reduce((sum, [, w]) => sum + w, 0);
  const ctx = c.getContext("2d");
  const shade = () => weights.forEach(([p, w]) => {
    if (p < 0) return;
    ctx.fillStyle = `rgba(220,30,30,${(0.85 * w / top).toFixed(3)})`;
    ctx.fillRect((p % im.cols) * cell, Math.floor(p / im.cols) * cell, cell, cell);
  });
  if (state.image) {
    const pic = new Image();
    pic.onload = () => { ctx.drawImage(pic, 0, 0, c.width, c.height); shade(); };
    pic.src = state.image;
  } else shade();
  const cap = document.createElement("figcaption");
  cap.textContent = row < im.offset ? `image at tokens ${im.offset}-${im.offset + im.length - 1}: after this query (masked)`
    : `image at tokens ${im.offset}-${im.offset + im.length - 1} (${im.rows}x${im.cols} patches): ` +
      `${(100 * total).toFixed(1)}% of this query's attention`;
  fig.append(c, cap);
  return fig;
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
  $("query").addEventListener("change", draw);
  $("image").addEventListener("change", async () => {
    const file = $("image").files[0];
    state.image = file ? await readImage(file) : null;
  });
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
