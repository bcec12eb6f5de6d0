// streamkv chat pane: one WebSocket to /ws/chat, streaming deltas into the
// message list. Model text is only ever written with textContent.
//
// Shares the chat session id with blockmap.js through
//   window.streamkvSessionId            (current id or null)
//   window "streamkv:session" event     (detail: {sessionId})

const $ = (sel) => document.querySelector(sel);

const els = {
  messages: $("#messages"),
  input: $("#chat-input"),
  send: $("#send"),
  stop: $("#stop"),
  reset: $("#reset"),
  composer: $("#composer"),
  settings: $("#settings"),
  settingsToggle: $("#settings-toggle"),
  conn: $("#chat-conn"),
  sessionLabel: $("#session-id"),
  empty: $("#empty-hint"),
  system: $("#set-system"),
  maxTokens: $("#set-max-tokens"),
  temperature: $("#set-temperature"),
  topP: $("#set-top-p"),
  topK: $("#set-top-k"),
  seed: $("#set-seed"),
  n: $("#set-n"),
  stopStrings: $("#set-stop"),
};

const state = {
  ws: null,
  sessionId: null,
  /** The session id in the open socket's URL (the conversation's, or a fresh one for the next). */
  socketSessionId: null,
  /** The turn in flight: {el, samples: Map<index, {text: Text}>, frame, retried}. */
  turn: null,
  /** A frame typed while the socket was down; sent on (re)open. */
  pending: null,
  retryMs: 500,
  reconnectTimer: null,
};

// --------------------------------------------------------------- API key --
// With --api-key the server closes /ws/* with 1008 and answers /api/stats
// with 401. Ask once per refusal, keep the key in sessionStorage for this
// tab, and add it to every same-origin WebSocket (?api_key=, browsers cannot
// set headers there) and fetch (Authorization header). Patched here, before
// blockmap.js runs (module scripts run in document order), so its /ws/stats
// socket and /api/stats polls carry the key too; the reconnect loops retry.

const KEY_STORE = "streamkv.apiKey";
let keyDeclined = false;

function storedKey() {
  return sessionStorage.getItem(KEY_STORE);
}

function keyRefused(usedKey) {
  if (keyDeclined || storedKey() !== usedKey) return; // declined, or a new key is already in
  const key = window.prompt("This server needs an API key (kept for this tab only):");
  if (key && key.trim()) {
    sessionStorage.setItem(KEY_STORE, key.trim());
  } else {
    sessionStorage.removeItem(KEY_STORE);
    keyDeclined = true;
  }
}

function isSameOrigin(url) {
  try {
    return new URL(url, location.href).host === location.host;
  } catch {
    return false;
  }
}

const NativeWebSocket = window.WebSocket;
window.WebSocket = class extends NativeWebSocket {
  constructor(url, protocols) {
    const key = storedKey();
    let target = url;
    if (key && isSameOrigin(url)) {
      const u = new URL(url, location.href);
      u.searchParams.set("api_key", key);
      target = u.toString();
    }
    super(target, protocols);
    this.addEventListener("close", (ev) => {
      if (ev.code === 1008) keyRefused(key);
    });
  }
};

const nativeFetch = window.fetch.bind(window);
window.fetch = async (input, init = {}) => {
  const url = input instanceof Request ? input.url : String(input);
  const key = storedKey();
  if (!isSameOrigin(url)) return nativeFetch(input, init);
  if (key) {
    const headers = new Headers(init.headers || (input instanceof Request ? input.headers : undefined));
    headers.set("Authorization", `Bearer ${key}`);
    init = { ...init, headers };
  }
  const res = await nativeFetch(input, init);
  if (res.status === 401) keyRefused(key);
  return res;
};

// ---------------------------------------------------------------- socket --

function wsUrl(path) {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}${path}`;
}

function setConn(s) {
  els.conn.dataset.state = s;
  els.conn.title = `chat socket: ${s}`;
}

// The session id is chosen here, before the first socket, and rides in the URL of
// every socket (?session_id=): a balancer hashing it (nginx `hash $arg_session_id`,
// or one that copies it into the x-session-id header Ray Serve routes on) sends
// every socket of the conversation to the replica that holds it.
function newSessionId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function connect() {
  clearTimeout(state.reconnectTimer);
  setConn("connecting");
  state.socketSessionId = state.sessionId || newSessionId();
  const ws = new WebSocket(wsUrl(`/ws/chat?session_id=${encodeURIComponent(state.socketSessionId)}`));
  state.ws = ws;

  ws.addEventListener("open", () => {
    if (state.ws !== ws) return;
    setConn("open");
    state.retryMs = 500;
    if (state.pending) {
      const frame = state.pending;
      state.pending = null;
      sendFrame(frame);
    }
    updateButtons();
  });

  ws.addEventListener("message", (ev) => {
    if (state.ws !== ws) return;
    let msg;
    try {
      msg = JSON.parse(ev.data);
    } catch {
      return;
    }
    onFrame(msg);
  });

  ws.addEventListener("close", () => {
    if (state.ws !== ws) return;
    state.ws = null;
    setConn("closed");
    if (state.turn) {
      // The answer in flight died with the socket; the session itself
      // survives on the server, the next turn resumes it by session_id.
      finishTurn({ interrupted: "connection lost" });
    }
    updateButtons();
    state.reconnectTimer = setTimeout(connect, state.retryMs);
    state.retryMs = Math.min(state.retryMs * 2, 8000);
  });
}

function isOpen() {
  return state.ws !== null && state.ws.readyState === WebSocket.OPEN;
}

function sendFrame(frame) {
  if (isOpen()) {
    state.ws.send(JSON.stringify(frame));
    return true;
  }
  return false;
}

// -------------------------------------------------------------- session --

function setSession(id) {
  if (id === state.sessionId) return;
  state.sessionId = id;
  window.streamkvSessionId = id;
  els.sessionLabel.textContent = id ? `session ${id}` : "no session";
  els.sessionLabel.title = id ? `this browser's chat session: ${id}` : "no chat session yet";
  window.dispatchEvent(new CustomEvent("streamkv:session", { detail: { sessionId: id } }));
}

// --------------------------------------------------------------- frames --

function onFrame(msg) {
  switch (msg.type) {
    case "session":
      if (typeof msg.session_id === "string") setSession(msg.session_id);
      break;
    case "delta":
      onDelta(msg);
      break;
    case "done":
      finishTurn({ done: msg });
      break;
    case "error":
      onError(msg);
      break;
    default:
      break;
  }
}

function onDelta(msg) {
  const turn = state.turn;
  if (!turn || typeof msg.text !== "string") return;
  const sample = sampleFor(turn, Number.isInteger(msg.index) ? msg.index : 0);
  const stick = nearBottom();
  sample.text.textContent += msg.text;
  if (stick) scrollToBottom();
}

function onError(msg) {
  const code = msg.code || "error";
  const message = msg.message || "";
  const turn = state.turn;

  // A resumed session the server no longer knows (expired, server restart, or
  // under Ray Serve its replica died: session_lost): start a fresh session and
  // send the same turn once more (the server starts it under the socket's id).
  const gone = code === "unknown_session" || code === "session_lost";
  if (gone && turn && !turn.retried && turn.frame.session_id) {
    setSession(null);
    addNotice("Previous session is gone from the server (expired, or its replica stopped); continuing in a new session.");
    const frame = buildFrame(turn.frame.content);
    turn.frame = frame;
    turn.retried = true;
    sendFrame(frame);
    return;
  }
  if (gone) setSession(null);

  if (turn) {
    finishTurn({ error: { code, message } });
  } else {
    addNotice(`${code}: ${message}`, true);
  }
}

// ----------------------------------------------------------------- turns --

function buildParams() {
  const num = (el, parse, fallback) => {
    const raw = el.value.trim();
    if (raw === "") return fallback;
    const v = parse(raw);
    return Number.isFinite(v) ? v : fallback;
  };
  const stop = els.stopStrings.value
    .split("\n")
    .map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
    .filter((s) => s.length > 0);
  return {
    max_tokens: num(els.maxTokens, (s) => parseInt(s, 10), 256),
    // greedy by default: the default 135M model rambles at 0.7, and answers well at 0
    temperature: num(els.temperature, parseFloat, 0),
    top_p: num(els.topP, parseFloat, 1.0),
    top_k: num(els.topK, (s) => parseInt(s, 10), -1),
    seed: num(els.seed, (s) => parseInt(s, 10), null),
    stop,
    n: num(els.n, (s) => parseInt(s, 10), 1),
  };
}

function buildFrame(content) {
  const frame = {
    type: "chat",
    content,
    // Keep the session (and its pinned blocks) across a dropped socket so
    // the reconnect can resume it; idle sessions still expire server-side.
    resumable: true,
    params: buildParams(),
  };
  if (state.sessionId) {
    frame.session_id = state.sessionId;
  } else {
    const system = els.system.value.trim();
    if (system) frame.system = system;
  }
  return frame;
}

function submit() {
  const content = els.input.value;
  if (!content.trim() || state.turn) return;
  els.empty?.remove();

  addUserMessage(content);
  const frame = buildFrame(content);
  state.turn = { el: addAssistantMessage(), samples: new Map(), frame, retried: false };
  els.input.value = "";
  autoGrow();

  if (!sendFrame(frame)) {
    state.pending = frame;
    if (!state.ws) connect();
  }
  updateButtons();
  scrollToBottom();
}

function cancel() {
  if (!state.turn) return;
  if (state.pending) {
    state.pending = null;
    finishTurn({ interrupted: "cancelled before sending" });
    return;
  }
  sendFrame({ type: "cancel" });
  els.stop.disabled = true; // the server answers with done(cancelled)
}

function reset() {
  if (state.turn) {
    sendFrame({ type: "cancel" });
    state.pending = null;
    finishTurn({ interrupted: "reset" });
  }
  sendFrame({ type: "reset" });
  setSession(null);
  els.messages.replaceChildren();
  addNotice("New conversation.");
  updateButtons();
  els.input.focus();
}

/** End the turn in flight: done frame, error, or local interruption. */
function finishTurn({ done, error, interrupted }) {
  const turn = state.turn;
  if (!turn) return;
  state.turn = null;
  const el = turn.el;
  if (turn.samples.size === 0 && !error) sampleFor(turn, 0); // keep an empty bubble visible

  if (done) {
    el.querySelector(".usage").replaceChildren(...usageParts(done));
    el.dataset.finishReason = done.finish_reason || "";
  }
  if (error) {
    el.classList.add("error");
    const p = document.createElement("div");
    p.className = "err";
    p.textContent = `${error.code}: ${error.message}`;
    el.querySelector(".body").append(p);
    if (turn.samples.size === 0) el.querySelector(".body").classList.add("only-error");
  }
  if (interrupted) {
    el.classList.add("interrupted");
    const u = el.querySelector(".usage");
    const s = document.createElement("span");
    s.className = "reason-cancelled";
    s.textContent = interrupted;
    u.append(s);
  }
  el.classList.add("done");
  updateButtons();
  if (nearBottom(160)) scrollToBottom();
}

function usageParts(done) {
  const u = done.usage || {};
  const t = done.timings || {};
  const parts = [];
  const item = (label, value, cls) => {
    const s = document.createElement("span");
    if (cls) s.className = cls;
    const b = document.createElement("b");
    b.textContent = value;
    s.append(`${label} `, b);
    parts.push(s);
  };
  const fmtInt = (v) => (Number.isFinite(v) ? String(v) : "–");
  item("prompt", fmtInt(u.prompt_tokens));
  item("cached", fmtInt(u.cached_tokens), "cached");
  item("completion", fmtInt(u.completion_tokens));
  if (Number.isFinite(t.ttft_ms)) item("TTFT", `${t.ttft_ms.toFixed(0)} ms`);
  if (Number.isFinite(t.total_ms)) item("total", `${t.total_ms.toFixed(0)} ms`);
  const decodeMs = (t.total_ms ?? NaN) - (t.ttft_ms ?? NaN);
  if (Number.isFinite(decodeMs) && decodeMs > 0 && u.completion_tokens > 1) {
    item("", `${(((u.completion_tokens - 1) * 1000) / decodeMs).toFixed(1)} tok/s`);
  }
  if (done.finish_reason && done.finish_reason !== "stop") {
    const s = document.createElement("span");
    s.className = `reason-${done.finish_reason}`;
    s.textContent = done.finish_reason;
    parts.push(s);
  }
  return parts;
}

// -------------------------------------------------------------- render --

function addUserMessage(text) {
  const el = document.createElement("div");
  el.className = "msg user";
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  el.append(body);
  els.messages.append(el);
  return el;
}

function addAssistantMessage() {
  const el = document.createElement("div");
  el.className = "msg assistant";
  const body = document.createElement("div");
  body.className = "body";
  const usage = document.createElement("div");
  usage.className = "usage";
  el.append(body, usage);
  els.messages.append(el);
  return el;
}

function sampleFor(turn, index) {
  let s = turn.samples.get(index);
  if (s) return s;
  const wrap = document.createElement("div");
  wrap.className = "sample";
  wrap.dataset.index = String(index);
  const text = document.createElement("span");
  text.className = "text";
  wrap.append(text);
  s = { wrap, text };
  turn.samples.set(index, s);

  // Keep samples ordered by index; label them once there is more than one.
  const body = turn.el.querySelector(".body");
  const after = [...turn.samples.entries()]
    .filter(([i]) => i > index)
    .sort(([a], [b]) => a - b)[0];
  body.insertBefore(wrap, after ? after[1].wrap : body.querySelector(".err"));
  if (turn.samples.size > 1 || (turn.frame.params && turn.frame.params.n > 1)) {
    for (const [i, smp] of turn.samples) {
      if (!smp.wrap.querySelector(".sample-label")) {
        const lab = document.createElement("span");
        lab.className = "sample-label";
        lab.textContent = `sample ${i + 1}`;
        smp.wrap.prepend(lab);
      }
    }
  }
  return s;
}

function addNotice(text, isError = false) {
  const el = document.createElement("div");
  el.className = isError ? "notice error" : "notice";
  el.textContent = text;
  els.messages.append(el);
  scrollToBottom();
}

function nearBottom(slack = 48) {
  const m = els.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < slack;
}

function scrollToBottom() {
  els.messages.scrollTop = els.messages.scrollHeight;
}

function updateButtons() {
  const busy = state.turn !== null;
  els.send.disabled = busy;
  els.stop.disabled = !busy;
}

function autoGrow() {
  const t = els.input;
  t.style.height = "auto";
  t.style.height = `${Math.min(t.scrollHeight + 2, 180)}px`;
}

// ---------------------------------------------------------------- wiring --

els.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  submit();
});
els.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    submit();
  }
});
els.input.addEventListener("input", autoGrow);
els.stop.addEventListener("click", cancel);
els.reset.addEventListener("click", reset);
els.settingsToggle.addEventListener("click", () => {
  const open = els.settings.hidden;
  const stick = nearBottom(160);
  els.settings.hidden = !open;
  if (stick) scrollToBottom();
  els.settingsToggle.setAttribute("aria-expanded", String(open));
});
els.settings.addEventListener("submit", (e) => e.preventDefault());

window.streamkvSessionId = null;
window.streamkvChat = {
  get sessionId() { return state.sessionId; },
  get connected() { return isOpen(); },
  get busy() { return state.turn !== null; },
};

updateButtons();
connect();
els.input.focus();
