// streamkv block map: one canvas cell per KV block, coloured by state, this
// browser's session outlined. Data comes from /ws/stats (falls back to polling
// /api/stats while the socket is down). Drawing happens only when a new
// snapshot arrives or the canvas is resized, at most once per animation frame.
//
// Test hooks:
//   window.streamkvStats               last snapshot drawn
//   #blockmap[data-own-blocks]         own-session blocks outlined
//   #blockmap[data-nonfree]            cells drawn with a state other than free
//   #blockmap[data-num-blocks], [data-cell-size] (CSS px), [data-t] (snapshot t),
//   [data-draw-ms] (last redraw time)

const STATE_NAMES = ["free", "cached", "used", "pinned", "shared"];
const SPARK_WINDOW_S = 60;

const canvas = document.getElementById("blockmap");
const ctx = canvas.getContext("2d", { alpha: true });
const wrap = document.getElementById("map-wrap");
const tip = document.getElementById("map-tip");
const spark = document.getElementById("sparkline");
const sctx = spark.getContext("2d");
const legend = document.getElementById("legend");
const poolInfo = document.getElementById("pool-info");
const foot = document.getElementById("map-foot");
const connEl = document.getElementById("stats-conn");

const tiles = {
  kv: document.getElementById("stat-kv"),
  hit: document.getElementById("stat-hit"),
  reqs: document.getElementById("stat-reqs"),
  tps: document.getElementById("stat-tps"),
  preempt: document.getElementById("stat-preempt"),
  evict: document.getElementById("stat-evict"),
};

// ---------------------------------------------------------------- colours --

const css = getComputedStyle(document.documentElement);
const cssColor = (name, fallback) => css.getPropertyValue(name).trim() || fallback;

const COLORS = {
  free: cssColor("--blk-free", "#222a36"),
  cached: cssColor("--blk-cached", "#2f7f86"),
  used: cssColor("--blk-used", "#5b93ff"),
  pinned: cssColor("--blk-pinned", "#f5b53d"),
  shared: cssColor("--blk-shared", "#c084fc"),
  own: cssColor("--blk-own", "#ffffff"),
  unknown: "#ff00ff",
  accent: cssColor("--accent", "#5b93ff"),
  line: cssColor("--line", "#252c39"),
  muted: cssColor("--muted", "#8b94a5"),
};

/** "#rrggbb" -> 0xAABBGGRR, the byte order of a little-endian Uint32 over RGBA. */
function packRGBA(hex) {
  const m = /^#?([0-9a-f]{6})$/i.exec(hex);
  const v = m ? parseInt(m[1], 16) : 0xff00ff;
  const r = (v >> 16) & 255, g = (v >> 8) & 255, b = v & 255;
  return ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
}

// Indexed by state byte, following the snapshot's state_names (the default
// order when absent); an unknown byte draws as magenta.
let stateNames = STATE_NAMES;
let PALETTE = buildPalette(STATE_NAMES);
let FREE_BYTE = 0;

function buildPalette(names) {
  const pal = new Uint32Array(256).fill(packRGBA(COLORS.unknown));
  names.forEach((name, i) => { if (COLORS[name]) pal[i] = packRGBA(COLORS[name]); });
  return pal;
}

function useStateNames(names) {
  const next = Array.isArray(names) && names.length ? names.map(String) : STATE_NAMES;
  if (next.join() === stateNames.join()) return;
  stateNames = next;
  PALETTE = buildPalette(next);
  FREE_BYTE = Math.max(0, next.indexOf("free"));
}
const OWN_RGBA = packRGBA(COLORS.own);

// ------------------------------------------------------------------ state --

let snap = null;            // last snapshot received
let drawnSnap = null;       // last snapshot drawn
let states = new Uint8Array(0);
let ownSessionId = window.streamkvSessionId || null;
let layout = null;          // {x0, y0, pitch, cell, cols, rows, n, dpr}
let imgCache = null;        // {img: ImageData, buf: Uint32Array view} reused while the size holds
let hover = null;           // {x, y} in CSS px relative to the canvas
let frameScheduled = false;
let dirty = true;
let ownerCache = null;      // {snap, map: Map<blockId, sessionId>}
const history = [];         // [{t, v}] kv_usage over the last minute

// ----------------------------------------------------------------- decode --

function decodeStates(b64) {
  if (typeof b64 !== "string" || b64.length === 0) return new Uint8Array(0);
  if (typeof Uint8Array.fromBase64 === "function") {
    try { return Uint8Array.fromBase64(b64); } catch { /* fall through */ }
  }
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// -------------------------------------------------------------- scheduling --

function schedule() {
  dirty = true;
  if (frameScheduled) return;
  frameScheduled = true;
  // rAF does not fire in a hidden tab; keep the test hooks fresh anyway.
  if (document.hidden) setTimeout(frame, 50);
  else requestAnimationFrame(frame);
}

function frame() {
  frameScheduled = false;
  if (!dirty) return;
  dirty = false;
  if (snap !== drawnSnap) {
    states = decodeStates(snap.states);
    useStateNames(snap.state_names);
    drawnSnap = snap;
    window.streamkvStats = snap;
    ownerCache = null;
    renderFigures(snap);
  }
  drawMap();
  drawSparkline();
  if (hover) updateTip();
}

function onSnapshot(s) {
  if (!s || typeof s !== "object") return;
  snap = s;
  const t = Number.isFinite(s.t) ? s.t : Date.now() / 1000;
  const v = Number.isFinite(s.kv_usage) ? s.kv_usage : null;
  if (v !== null) {
    if (history.length && t < history[history.length - 1].t) history.length = 0; // clock went back
    history.push({ t, v });
    while (history.length && history[0].t < t - SPARK_WINDOW_S - 2) history.shift();
  }
  schedule();
}

// -------------------------------------------------------------------- map --

/**
 * Largest square cell (device px, integer) such that a cols x rows grid of
 * n cells fits in w x h. The pitch includes a 1-device-px gap once cells are
 * big enough for it to read as a grid.
 */
function computeLayout(w, h, n, dpr) {
  if (n <= 0 || w <= 2 || h <= 2) return null;
  const pad = Math.max(1, Math.round(dpr)); // room for the own-session outline at the edge
  const W = w - 2 * pad, H = h - 2 * pad;
  const maxPitch = Math.round(26 * dpr);
  let pitch = Math.min(maxPitch, Math.max(1, Math.floor(Math.sqrt((W * H) / n))));
  while (pitch > 1 && Math.floor(W / pitch) * Math.floor(H / pitch) < n) pitch--;
  const cols = Math.max(1, Math.min(n, Math.floor(W / pitch)));
  const rows = Math.ceil(n / cols);
  const gap = pitch >= 4 ? Math.max(1, Math.round(dpr * (pitch >= 14 * dpr ? 2 : 1))) : 0;
  const cell = pitch - gap;
  const gridW = cols * pitch - gap;
  const x0 = pad + Math.max(0, Math.floor((W - gridW) / 2));
  const y0 = pad;
  return { x0, y0, pitch, cell, gap, cols, rows, n, dpr, pad };
}

function fillRect(buf, W, H, x, y, w, h, color) {
  const xa = Math.max(0, x), xb = Math.min(W, x + w);
  const ya = Math.max(0, y), yb = Math.min(H, y + h);
  if (xa >= xb) return;
  for (let yy = ya; yy < yb; yy++) buf.fill(color, yy * W + xa, yy * W + xb);
}

function ring(buf, W, H, x, y, w, h, lw, color) {
  fillRect(buf, W, H, x, y, w, lw, color);
  fillRect(buf, W, H, x, y + h - lw, w, lw, color);
  fillRect(buf, W, H, x, y + lw, lw, h - 2 * lw, color);
  fillRect(buf, W, H, x + w - lw, y + lw, lw, h - 2 * lw, color);
}

function drawMap() {
  const dpr = window.devicePixelRatio || 1;
  const rect = wrap.getBoundingClientRect();
  const W = Math.max(1, Math.round(rect.width * dpr));
  const H = Math.max(1, Math.round(rect.height * dpr));
  if (canvas.width !== W || canvas.height !== H) {
    canvas.width = W;
    canvas.height = H;
  }
  if (!drawnSnap) {
    ctx.clearRect(0, 0, W, H);
    return;
  }

  const t0 = performance.now();
  const n = Math.max(0, drawnSnap.num_blocks | 0);
  const L = computeLayout(W, H, n, dpr);
  layout = L;
  if (!imgCache || imgCache.img.width !== W || imgCache.img.height !== H) {
    const img = ctx.createImageData(W, H);
    imgCache = { img, buf: new Uint32Array(img.data.buffer) };
  }
  const { img, buf } = imgCache;
  buf.fill(0);
  let nonfree = 0;
  let own = 0;

  if (L) {
    const { x0, y0, pitch, cell, cols } = L;
    const drawable = Math.min(n, cols * Math.floor((H - y0) / pitch) || n);
    for (let i = 0; i < drawable; i++) {
      const st = i < states.length ? states[i] : FREE_BYTE;
      if (st !== FREE_BYTE) nonfree++;
      const x = x0 + (i % cols) * pitch;
      const y = y0 + Math.floor(i / cols) * pitch;
      const color = PALETTE[st];
      for (let yy = y, ye = Math.min(H, y + cell); yy < ye; yy++) {
        const row = yy * W;
        buf.fill(color, row + x, row + x + cell);
      }
    }

    // Own session: outline each block. The ring sits just outside the cell
    // (in the gap) so the state colour stays readable; cells big enough to
    // spare it get a second, inner ring so the outline reads at a glance.
    const ids = ownBlockIds();
    if (ids) {
      const seen = new Uint8Array(drawable);
      const lwIn = Math.max(1, Math.round(dpr * (cell >= 16 * dpr ? 2 : 1)));
      const inside = cell >= 6 * dpr;
      for (const raw of ids) {
        const id = raw | 0;
        if (id < 0 || id >= drawable || seen[id]) continue;
        seen[id] = 1;
        own++;
        const x = x0 + (id % cols) * pitch;
        const y = y0 + Math.floor(id / cols) * pitch;
        const lw = Math.max(1, Math.round(dpr));
        if (inside) {
          ring(buf, W, H, x - lw, y - lw, cell + 2 * lw, cell + 2 * lw, lw, OWN_RGBA);
          ring(buf, W, H, x, y, cell, cell, lwIn, OWN_RGBA);
        } else {
          // Tiny cells: a 2-px frame, eating one pixel of the neighbours, so
          // a handful of own blocks stays findable among 10k+.
          ring(buf, W, H, x - 2 * lw, y - 2 * lw, cell + 4 * lw, cell + 4 * lw, 2 * lw, OWN_RGBA);
        }
      }
    }
  }

  ctx.putImageData(img, 0, 0);
  canvas.dataset.ownBlocks = String(own);
  canvas.dataset.nonfree = String(nonfree);
  canvas.dataset.numBlocks = String(n);
  canvas.dataset.cellSize = L ? String(L.pitch / dpr) : "0";
  canvas.dataset.t = String(drawnSnap.t ?? "");
  canvas.dataset.drawMs = (performance.now() - t0).toFixed(2);
  updateLegend(own);
}

function ownBlockIds() {
  if (!ownSessionId || !drawnSnap) return null;
  const sb = drawnSnap.session_blocks;
  if (!sb || typeof sb !== "object") return null;
  const ids = sb[ownSessionId];
  return Array.isArray(ids) ? ids : null;
}

// -------------------------------------------------------------- sparkline --

function drawSparkline() {
  const dpr = window.devicePixelRatio || 1;
  const r = spark.getBoundingClientRect();
  const W = Math.max(1, Math.round(r.width * dpr));
  const H = Math.max(1, Math.round(r.height * dpr));
  if (spark.width !== W || spark.height !== H) {
    spark.width = W;
    spark.height = H;
  }
  sctx.setTransform(1, 0, 0, 1, 0, 0);
  sctx.clearRect(0, 0, W, H);
  sctx.scale(dpr, dpr);
  const w = r.width, h = r.height;
  const top = 3, bottom = h - 2;
  const yOf = (v) => bottom - Math.max(0, Math.min(1, v)) * (bottom - top);

  // 0 / 50 / 100 % guides
  sctx.strokeStyle = COLORS.line;
  sctx.lineWidth = 1;
  sctx.setLineDash([2, 3]);
  for (const g of [0.5, 1]) {
    sctx.beginPath();
    sctx.moveTo(0, Math.round(yOf(g)) + 0.5);
    sctx.lineTo(w, Math.round(yOf(g)) + 0.5);
    sctx.stroke();
  }
  sctx.setLineDash([]);
  sctx.beginPath();
  sctx.moveTo(0, Math.round(bottom) + 0.5);
  sctx.lineTo(w, Math.round(bottom) + 0.5);
  sctx.stroke();

  if (history.length === 0) return;
  const tEnd = history[history.length - 1].t;
  const tStart = tEnd - SPARK_WINDOW_S;
  const xOf = (t) => ((t - tStart) / SPARK_WINDOW_S) * w;
  const pts = history.filter((p) => p.t >= tStart - 1);
  if (pts.length === 0) return;

  const grad = sctx.createLinearGradient(0, top, 0, bottom);
  grad.addColorStop(0, "rgba(91, 147, 255, 0.35)");
  grad.addColorStop(1, "rgba(91, 147, 255, 0.02)");
  sctx.beginPath();
  sctx.moveTo(Math.max(0, xOf(pts[0].t)), bottom);
  for (const p of pts) sctx.lineTo(Math.max(0, xOf(p.t)), yOf(p.v));
  sctx.lineTo(xOf(tEnd), bottom);
  sctx.closePath();
  sctx.fillStyle = grad;
  sctx.fill();

  sctx.beginPath();
  pts.forEach((p, i) => {
    const x = Math.max(0, xOf(p.t)), y = yOf(p.v);
    if (i === 0) sctx.moveTo(x, y);
    else sctx.lineTo(x, y);
  });
  sctx.strokeStyle = COLORS.accent;
  sctx.lineWidth = 1.5;
  sctx.lineJoin = "round";
  sctx.stroke();

  const last = pts[pts.length - 1];
  sctx.fillStyle = COLORS.accent;
  sctx.beginPath();
  sctx.arc(Math.min(w - 2.5, xOf(last.t)), yOf(last.v), 2.5, 0, Math.PI * 2);
  sctx.fill();
}

// ---------------------------------------------------------------- figures --

const fmtInt = (v) => (Number.isFinite(v) ? Math.round(v).toLocaleString("en-US") : "–");
const fmtPct = (v, d = 1) => (Number.isFinite(v) ? `${(v * 100).toFixed(d)}%` : "–");

function setTile(el, main, small) {
  el.textContent = main;
  if (small) {
    const s = document.createElement("small");
    s.textContent = small;
    el.append(s);
  }
}

function renderFigures(s) {
  const c = s.counters || {};
  const r = s.requests || {};
  setTile(tiles.kv, fmtPct(s.kv_usage));
  const q = c.prefix_cache_queries, h = c.prefix_cache_hits;
  setTile(tiles.hit, q > 0 ? fmtPct(h / q) : "–");
  tiles.hit.parentElement.title = `prefix cache: ${fmtInt(h)} hit / ${fmtInt(q)} queried tokens`;
  tiles.reqs.replaceChildren();
  [r.running, r.waiting, r.swapped].forEach((v, i) => {
    if (i > 0) {
      const sep = document.createElement("span");
      sep.className = "sep";
      sep.textContent = "/";
      tiles.reqs.append(sep);
    }
    tiles.reqs.append(fmtInt(v));
  });
  const tps = s.tokens_per_s;
  setTile(tiles.tps, Number.isFinite(tps) ? (tps < 100 ? tps.toFixed(1) : fmtInt(tps)) : "–");
  setTile(tiles.preempt, fmtInt(c.preemptions));
  setTile(tiles.evict, fmtInt(c.evictions));

  const n = s.num_blocks | 0, bs = s.block_size | 0;
  poolInfo.textContent = `${fmtInt(n)} blocks × ${bs} tok = ${fmtInt(n * bs)} slots`;

  const se = s.sessions || {};
  const items = [
    ["sessions", fmtInt(se.active)],
    // Every block a session pin holds, shared ones included; the legend's "pinned" colours only those with
    // one reference (a pinned block another request also holds is drawn, and counted, as "shared").
    ["session-held", fmtInt(se.pinned_blocks),
      "blocks pinned by chat sessions, shared ones included (the legend counts a shared one as shared)"],
    ["prompt tok", fmtInt(c.prompt_tokens)],
    ["gen tok", fmtInt(c.generation_tokens)],
    ["CoW copies", fmtInt(c.cow_copies)],
    ["swapped out", fmtInt(c.swapped_out_blocks)],
  ];
  const off = s.offload;
  if (off && (off.host_sessions || off.disk_sessions)) {
    // idle sessions whose KV lives off the pool: host memory, then disk
    items.push(["off the pool", `${fmtInt((off.host_sessions | 0) + (off.disk_sessions | 0))} sessions ` +
      `(host ${fmtInt(off.host_sessions)}, disk ${fmtInt(off.disk_sessions)})`]);
  }
  foot.replaceChildren(...items.map(([k, v, title]) => {
    const span = document.createElement("span");
    if (title) span.title = title;
    const b = document.createElement("b");
    b.textContent = v;
    span.append(`${k} `, b);
    return span;
  }));
}

function stateCounts() {
  const counts = drawnSnap && drawnSnap.counts;
  if (counts && typeof counts === "object") return counts;
  const out = Object.fromEntries(STATE_NAMES.map((k) => [k, 0]));
  for (let i = 0; i < states.length; i++) {
    const name = stateNames[states[i]];
    if (name) out[name]++;
  }
  return out;
}

let legendItems = null;
function updateLegend(own) {
  if (!legendItems) {
    legendItems = {};
    const labels = { free: "free", cached: "cached", used: "running", pinned: "pinned", shared: "shared" };
    const titles = {
      free: "unreferenced, empty",
      cached: "free, but holds a reusable prefix (evictable)",
      used: "held by one running request",
      pinned: "held by an idle chat session alone (pinned blocks that are shared count as shared)",
      shared: "ref count > 1 (prefix shared / forked)",
    };
    for (const name of [...STATE_NAMES, "own"]) {
      const li = document.createElement("li");
      li.dataset.state = name;
      const sw = document.createElement("span");
      sw.className = name === "own" ? "sw own" : "sw";
      if (name !== "own") sw.style.background = COLORS[name];
      const label = document.createElement("span");
      label.textContent = name === "own" ? "this session" : labels[name];
      const num = document.createElement("span");
      num.className = "n";
      li.title = name === "own" ? "blocks held by this browser's chat session" : titles[name];
      li.append(sw, label, num);
      legend.append(li);
      legendItems[name] = num;
    }
  }
  const counts = stateCounts();
  for (const name of STATE_NAMES) legendItems[name].textContent = fmtInt(counts[name] ?? 0);
  legendItems.own.textContent = ownSessionId ? fmtInt(own) : "–";
}

// ---------------------------------------------------------------- tooltip --

function ownerOf(id) {
  if (!drawnSnap || !drawnSnap.session_blocks) return null;
  if (!ownerCache || ownerCache.snap !== drawnSnap) {
    const map = new Map();
    for (const [sid, ids] of Object.entries(drawnSnap.session_blocks)) {
      if (Array.isArray(ids)) for (const b of ids) if (!map.has(b)) map.set(b, sid);
    }
    ownerCache = { snap: drawnSnap, map };
  }
  return ownerCache.map.get(id) ?? null;
}

function updateTip() {
  const L = layout;
  if (!hover || !L || !drawnSnap) {
    tip.hidden = true;
    return;
  }
  const px = hover.x * L.dpr - L.x0, py = hover.y * L.dpr - L.y0;
  const col = Math.floor(px / L.pitch), row = Math.floor(py / L.pitch);
  const id = row * L.cols + col;
  if (px < 0 || py < 0 || col >= L.cols || id >= L.n) {
    tip.hidden = true;
    return;
  }
  const st = id < states.length ? states[id] : FREE_BYTE;
  const owner = ownerOf(id);
  const bs = drawnSnap.block_size | 0;
  let text = `block ${id} · ${stateNames[st] ?? `state ${st}`} · slots ${id * bs}–${id * bs + bs - 1}`;
  if (owner) text += " · this session"; // snapshots name only the viewer's own session
  tip.textContent = text;
  tip.hidden = false;
  const wr = wrap.clientWidth;
  const tw = tip.offsetWidth;
  let x = hover.x + 12;
  if (x + tw > wr) x = hover.x - tw - 12;
  tip.style.left = `${Math.max(0, x)}px`;
  tip.style.top = `${Math.max(0, hover.y - 30)}px`;
}

canvas.addEventListener("mousemove", (e) => {
  const r = canvas.getBoundingClientRect();
  hover = { x: e.clientX - r.left, y: e.clientY - r.top };
  updateTip();
});
canvas.addEventListener("mouseleave", () => {
  hover = null;
  tip.hidden = true;
});

// ----------------------------------------------------------------- socket --

let ws = null;
let retryMs = 500;
let reconnectTimer = null;
let pollTimer = null;

function statsUrl() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const q = ownSessionId ? `?session_id=${encodeURIComponent(ownSessionId)}` : "";
  return `${proto}//${location.host}/ws/stats${q}`;
}

function setConn(s) {
  connEl.dataset.state = s;
  connEl.title = `stats socket: ${s}`;
}

function connect() {
  clearTimeout(reconnectTimer);
  setConn("connecting");
  const sock = new WebSocket(statsUrl());
  ws = sock;
  sock.addEventListener("open", () => {
    if (ws !== sock) return;
    setConn("open");
    retryMs = 500;
    stopPolling();
  });
  sock.addEventListener("message", (ev) => {
    if (ws !== sock) return;
    try {
      onSnapshot(JSON.parse(ev.data));
    } catch { /* ignore a malformed frame */ }
  });
  sock.addEventListener("close", () => {
    if (ws !== sock) return; // replaced on purpose (session changed)
    ws = null;
    setConn("closed");
    startPolling();
    reconnectTimer = setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 8000);
  });
}

function reconnectNow() {
  const old = ws;
  ws = null;
  if (old) old.close(1000, "session changed");
  retryMs = 500;
  connect();
}

// While the socket is down, keep the map alive from GET /api/stats.
async function pollOnce() {
  try {
    const res = await fetch("/api/stats", { cache: "no-store" });
    if (res.ok) onSnapshot(await res.json());
  } catch { /* server down; the socket retry loop handles it */ }
}
function startPolling() {
  if (pollTimer === null) pollTimer = setInterval(pollOnce, 1000);
}
function stopPolling() {
  if (pollTimer !== null) clearInterval(pollTimer);
  pollTimer = null;
}

window.addEventListener("streamkv:session", (e) => {
  const id = (e.detail && e.detail.sessionId) || null;
  if (id === ownSessionId) return;
  ownSessionId = id;
  schedule();
  reconnectNow();
});

new ResizeObserver(() => schedule()).observe(wrap);
new ResizeObserver(() => schedule()).observe(spark);
document.addEventListener("visibilitychange", () => { if (!document.hidden) schedule(); });

updateLegend(0);
connect();
