// The document-QA page: upload and ingest, ask with a streamed answer, compare with full
// prefill, and the cache panel. Plain DOM; every text from the server goes in through
// textContent, never innerHTML, so documents and answers cannot inject markup.
"use strict";

const $ = (id) => document.getElementById(id);

function human(bytes) {
  if (bytes == null) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ms(s) { return `${(s * 1000).toFixed(0)} ms`; }

// ---------------------------------------------------------------- the API key
// A server started with --api-key answers /api only with "Authorization: Bearer KEY". The
// page asks once (on the first 401) and keeps the key in sessionStorage: this tab only,
// gone when it closes. Every call goes through api(), which adds the key.

let keyWaiters = [];

function askForKey() {
  $("key-form").hidden = false;
  $("api-key").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem("pcache-api-key", key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  const waiting = keyWaiters;
  keyWaiters = [];
  for (const w of waiting) w();
});

async function api(path, opts = {}) {
  for (;;) {
    const key = sessionStorage.getItem("pcache-api-key");
    const headers = Object.assign({}, opts.headers || {});
    if (key) headers.Authorization = `Bearer ${key}`;
    const resp = await fetch(path, Object.assign({}, opts, { headers }));
    if (resp.status !== 401) return resp;
    sessionStorage.removeItem("pcache-api-key");
    showError(key ? "The API key was not accepted: enter it again." : "");
    await askForKey();
  }
}

function showError(msg) {
  const e = $("error");
  e.textContent = msg || "";
  e.hidden = !msg;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return `${resp.status} ${resp.statusText}`;
  }
}

// ---------------------------------------------------------------- status and cache panel

let ingestWasRunning = false;

function renderIngest(st) {
  const bar = $("ingest-progress");
  const text = $("ingest-status");
  if (st.running) {
    bar.hidden = false;
    bar.max = Math.max(st.total, 1);
    bar.value = st.done;
    const what = st.stage === "encode" ? "encoding chunks" : "reading files";
    text.textContent = `Ingesting ${st.files.length} file(s): ${what} ${st.done}/${st.total}`;
  } else if (st.error) {
    bar.hidden = true;
    text.textContent = `Ingestion failed: ${st.error}`;
  } else if (st.report) {
    bar.hidden = true;
    const r = st.report;
    let msg = `Ingested ${r.added + r.changed} new or changed file(s), ${r.unchanged} unchanged: ` +
      `${r.chunks_encoded} chunks encoded, ${r.chunks_reused} reused, in ${r.seconds.toFixed(1)} s.`;
    if (r.skipped.length) msg += ` Skipped: ${r.skipped.map((s) => `${s[0]} (${s[1]})`).join("; ")}.`;
    text.textContent = msg;
  }
  $("upload-btn").disabled = $("sample-btn").disabled = st.running;
}

function renderStatus(s) {
  $("model").textContent = `model: ${s.model}`;
  $("n-docs").textContent = s.documents;
  const st = s.states || {};
  $("n-chunks").textContent = st.lazy ? `${s.chunks} (${st.hot} of ${st.lazy} lazy ones hot)` : `${s.chunks}`;
  $("bpt").textContent = `${human(s.bytes_per_token)} per token`;
  $("encoded").textContent = `${s.encoded.units} units, ${s.encoded.tokens} tokens`;
  $("queue").textContent = `${s.queue.waiting} waiting${s.queue.running ? ", 1 answering" : ""} (limit ${s.queue.limit})`;
  $("answered").textContent = `${s.answered} (${s.cancelled} cancelled, ${s.rejected} refused)`;
  const body = $("tiers").querySelector("tbody");
  body.replaceChildren();
  for (const [name, t] of Object.entries(s.tiers)) {
    const tr = document.createElement("tr");
    for (const v of [name, t.entries, human(t.bytes), t.hits, t.misses]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  renderIngest(s.ingest);
  ingestWasRunning = s.ingest.running;
}

async function refresh() {  // one poll; the loop below keeps the panel current
  try {
    const r = await api("/api/status");
    if (r.ok) renderStatus(await r.json());
  } catch (_) { /* the server restarts: the next tick tries again */ }
}

async function pollLoop() {
  await refresh();
  setTimeout(pollLoop, ingestWasRunning ? 500 : 2000);
}

// ---------------------------------------------------------------- documents

async function startIngest(resp) {
  if (!resp.ok) { showError(await errorText(resp)); return; }
  showError("");
  ingestWasRunning = true;
  $("ingest-status").textContent = "Ingestion started.";
  refresh();
}

$("upload-btn").addEventListener("click", async () => {
  const files = $("file-input").files;
  if (!files.length) { showError("Choose one or more files first."); return; }
  const form = new FormData();
  for (const f of files) form.append("files", f, f.name);
  await startIngest(await api("/api/documents", { method: "POST", body: form }));
});

$("sample-btn").addEventListener("click", async () => {
  await startIngest(await api("/api/sample", { method: "POST" }));
});

// ---------------------------------------------------------------- questions

// Server-sent events from a POST (EventSource only does GET): split the body on blank
// lines, read "event:" and "data:" fields.
async function* sse(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
    }
  }
}

function renderSources(sources) {
  const list = $("sources");
  list.replaceChildren();
  for (const s of sources) {
    const li = document.createElement("li");
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = `${s.document} · chunk ${s.chunk} · score ${s.score.toFixed(3)}`;
    const preview = document.createElement("div");
    preview.className = "preview";
    preview.textContent = s.preview;
    li.append(meta, preview);
    list.appendChild(li);
  }
}

$("ask-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const question = $("question").value;
  const compare = $("compare").checked;
  const answer = $("answer");
  showError("");
  answer.textContent = "";
  answer.dataset.state = "waiting";
  for (const id of ["ttft", "full-ttft", "ratio", "notes"]) $(id).textContent = "";
  $("full-answer-box").hidden = true;
  $("full-answer").textContent = "";
  $("sources").replaceChildren();
  $("ask-btn").disabled = true;
  try {
    const t0 = performance.now();
    const resp = await api("/api/ask", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ question, compare }),
    });
    if (!resp.ok) {
      answer.dataset.state = "error";
      showError(await errorText(resp));
      return;
    }
    answer.dataset.state = "streaming";
    for await (const { event, data } of sse(resp)) {
      if (event === "start") {
        renderSources(data.sources);
        if (data.notes.length) $("notes").textContent = data.notes.join(" ");
      } else if (event === "delta") {
        answer.textContent += data;
      } else if (event === "done") {
        answer.dataset.state = "done";
        const wall = (performance.now() - t0) / 1000;
        $("ttft").textContent = `time to first token: ${ms(data.ttft_s)} cached` +
          ` (${data.cached_tokens} tokens read from the cache, ${data.computed_tokens} computed)`;
        $("ttft").title = `as seen by this page, with the network and queue: ${ms(wall)} to the end`;
        if (compare) $("full-ttft").textContent = "running the full prefill...";
      } else if (event === "full") {
        $("full-ttft").textContent = `full prefill: ${ms(data.ttft_s)}`;
        $("ratio").textContent = `${data.speedup.toFixed(1)}x faster`;
        $("full-answer").textContent = data.text;
        $("full-answer-box").hidden = false;
        answer.dataset.compare = "done";
      } else if (event === "error") {
        answer.dataset.state = "error";
        showError(data.message);
      }
    }
    if (answer.dataset.state === "streaming") answer.dataset.state = "done";
  } catch (e) {
    answer.dataset.state = "error";
    showError(`The connection failed: ${e}`);
  } finally {
    $("ask-btn").disabled = false;
    refresh();
  }
});

pollLoop();
