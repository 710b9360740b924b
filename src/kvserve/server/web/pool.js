// The KV pool: every block a cell coloured by its state (the frame's code string), the totals, the live
// requests and a tok/s chart, redrawn from each frame of /v1/kvserve/cache/stream; above them every model
// the server holds. The model chosen in the header is the chat's and the pool's; a model that is not
// loaded has no pool until a message loads it.

const MAX_CELLS = 16384; // a larger pool draws several blocks per cell, each cell its busiest block
const RATE_WINDOW_S = 60; // the tok/s chart's span
const STATE_RANK = { free: 0, cached: 1, used: 2, shared: 3 };

// model: the chosen one ("" until the first frame says the server's); watching: the open stream's AbortController
const pool = { cells: [], group: 1, codes: "", mine: new Set(), samples: [], model: "", watching: null, wake: null };

function blockState(code) {
  if (code === ".") return ["free", 0];
  if (code === "c") return ["cached", 0];
  const n = code === "+" ? 10 : Number(code);
  return [n > 1 ? "shared" : "used", n];
}

const STATE_WORDS = { free: "free", cached: "cached, free", used: "in use", shared: "shared" };

function layoutCells(numBlocks) {
  const group = Math.max(1, Math.ceil(numBlocks / MAX_CELLS));
  const numCells = Math.ceil(numBlocks / group);
  if (pool.cells.length === numCells && pool.group === group) return;
  const grid = $("blocks");
  const size = numCells > 4096 ? 4 : numCells > 1024 ? 7 : numCells > 256 ? 10 : 14;
  grid.style.setProperty("--cell", `${size}px`);
  const cells = [];
  for (let i = 0; i < numCells; i++) {
    const cell = document.createElement("i");
    cell.dataset.block = String(i * group);
    cells.push(cell);
  }
  grid.replaceChildren(...cells);
  Object.assign(pool, { cells, group, codes: "", mine: new Set() });
}

function drawBlocks(frame) {
  layoutCells(frame.num_blocks);
  const { cells, group } = pool;
  const codes = frame.blocks;
  for (let c = 0; c < cells.length; c++) {
    const start = c * group;
    const end = Math.min(start + group, codes.length);
    if (pool.codes.length === codes.length && pool.codes.slice(start, end) === codes.slice(start, end)) continue;
    let [state, n] = blockState(codes[start]);
    for (let b = start + 1; b < end; b++) {
      const [s, m] = blockState(codes[b]);
      if (STATE_RANK[s] > STATE_RANK[state]) state = s;
      n = Math.max(n, m);
    }
    const cell = cells[c];
    cell.dataset.state = state;
    if (n > 1) cell.dataset.n = String(n); else delete cell.dataset.n;
    const which = group > 1 ? `blocks ${start}-${end - 1}` : `block ${start}`;
    cell.title = `${which}: ${STATE_WORDS[state]}${n > 1 ? ` by ${n === 10 ? "10+" : n} requests` : ""}`;
  }
  pool.codes = codes;
}

function markMine(blockIds) {
  const mine = new Set(blockIds.map((b) => Math.floor(b / pool.group)));
  for (const c of pool.mine) if (!mine.has(c)) pool.cells[c]?.classList.remove("mine");
  for (const c of mine) pool.cells[c]?.classList.add("mine");
  pool.mine = mine;
}

function setTotal(id, value, detail) {
  const small = document.createElement("small");
  small.textContent = detail;
  $(id).replaceChildren(value, small);
}

function drawTotals(frame) {
  const el = $("pool").dataset;
  el.model = frame.model;
  el.blocks = frame.num_blocks;
  el.free = frame.num_free_blocks - frame.num_cached_free_blocks;
  el.cached = frame.num_cached_free_blocks;
  el.used = frame.num_used_blocks;
  el.shared = frame.num_shared_blocks;
  setTotal("t-usage", `${frame.num_used_blocks} / ${frame.num_blocks}`,
    `${(100 * frame.usage).toFixed(0)}% · ${frame.num_shared_blocks} shared · ${frame.num_cached_free_blocks} cached`);
  const q = frame.prefix_cache_queries;
  setTotal("t-hits", q ? `${((100 * frame.prefix_cache_hits) / q).toFixed(1)}%` : "–",
    `${frame.prefix_cache_hits} of ${q} prompt tokens`);
  // a running request needs a new block when its last one fills: then a free one, or a preemption
  let room = frame.num_free_blocks * frame.block_size;
  for (const r of frame.requests) {
    if (r.status === "running") room += r.blocks.length * frame.block_size - r.num_tokens;
  }
  setTotal("t-room", `${room} tokens`, `${frame.num_free_blocks} blocks free`);
  setTotal("t-preempt", String(frame.num_preemptions), "since the start");
  setTotal("t-requests", `${frame.num_running} running`, `${frame.num_waiting} waiting`);
  const type = frame.cache_type_k === frame.cache_type_v ? frame.cache_type_k : `${frame.cache_type_k}/${frame.cache_type_v}`;
  // sliding-window layers in a pool of their own: how much of it the windows hold
  const win = frame.window_blocks || "";
  const windowNote = win ? ` · window pool ${win.length - (win.match(/[.c]/g) || []).length} / ${win.length} held`
    + ` (${frame.window_size} tokens)` : "";
  setTotal("t-kv", type, `${bytes(frame.kv_bytes_per_token)}/token · pool ${bytes(frame.kv_pool_bytes)}${windowNote}`);
  $("requests").tHead.rows[0].cells[4].textContent = `KV ${type}`; // every request's blocks hold this type
}

function drawRequests(frame, activeId) {
  const rows = frame.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.requestId = r.id;
    if (r.id === activeId) tr.className = "mine";
    const bar = document.createElement("span");
    bar.className = "bar";
    const fill = document.createElement("b");
    fill.style.width = `${(100 * r.num_tokens) / frame.max_model_len}%`;
    bar.append(fill);
    const context = document.createElement("span");
    context.append(bar, `${r.num_tokens} / ${frame.max_model_len}`);
    context.title = `limit ${r.max_tokens} tokens; ${r.num_cached_tokens} of ${r.num_prompt_tokens} prompt tokens from the prefix cache`;
    const cells = [r.id.length > 14 ? `…${r.id.slice(-12)}` : r.id, r.status, context, String(r.blocks.length), bytes(r.kv_bytes)];
    for (const value of cells) {
      const td = document.createElement("td");
      td.append(value);
      tr.append(td);
    }
    tr.cells[0].title = r.id;
    tr.cells[3].title = `blocks ${r.blocks.join(", ")}`;
    return tr;
  });
  $("requests").tBodies[0].replaceChildren(...rows);
}

function drawRate(frame) {
  const samples = pool.samples;
  samples.push([frame.time, frame.num_generated_tokens]);
  while (samples.length && samples[0][0] < frame.time - RATE_WINDOW_S - 1) samples.shift();
  // tok/s over the second before each sample: steadier than frame to frame
  const rates = [];
  let j = 0;
  for (let i = 1; i < samples.length; i++) {
    while (samples[j][0] < samples[i][0] - 1) j++;
    const k = j < i ? j : i - 1;
    const dt = samples[i][0] - samples[k][0];
    rates.push([samples[i][0], dt > 0 ? (samples[i][1] - samples[k][1]) / dt : 0]);
  }
  const current = rates.length ? rates[rates.length - 1][1] : 0;
  $("t-rate").textContent = current.toFixed(0);
  const canvas = $("rate");
  const ratio = window.devicePixelRatio || 1;
  const width = Math.round(canvas.clientWidth * ratio);
  const height = Math.round(canvas.clientHeight * ratio);
  if (!width || !height) return;
  if (canvas.width !== width || canvas.height !== height) Object.assign(canvas, { width, height });
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, width, height);
  const top = Math.max(10, ...rates.map((r) => r[1])) * 1.1;
  const style = getComputedStyle(document.documentElement);
  ctx.fillStyle = style.getPropertyValue("--muted").trim();
  ctx.font = `${11 * ratio}px system-ui, sans-serif`;
  ctx.fillText(`${top.toFixed(0)} tok/s`, 4 * ratio, 12 * ratio);
  ctx.strokeStyle = style.getPropertyValue("--used").trim();
  ctx.lineWidth = 2 * ratio;
  ctx.beginPath();
  rates.forEach(([t, rate], i) => {
    const x = width - ((frame.time - t) / RATE_WINDOW_S) * width;
    const y = height - (rate / top) * (height - 2 * ratio) - ratio;
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  ctx.stroke();
}

const MIB = 1 << 20;

function drawModels(frame) {
  const models = frame.models.length ? frame.models : [{ name: frame.model, state: "loaded", planned_bytes: 0 }];
  const select = $("model");
  const names = models.map((m) => m.name).join("\n");
  if (select.dataset.names !== names) {
    select.replaceChildren(...models.map((m) => new Option(m.name, m.name)));
    select.dataset.names = names;
  }
  models.forEach((m, i) => { select.options[i].dataset.state = m.state; });
  select.value = pool.model;
  const items = models.map((m) => {
    const li = document.createElement("li");
    li.dataset.state = m.state;
    li.dataset.model = m.name;
    const size = m.planned_bytes ? `, ${(m.planned_bytes / MIB).toFixed(0)} MiB` : "";
    const expiry = m.expires_at ? `, unloads in ${Math.max(0, m.expires_at - frame.time).toFixed(0)} s` : "";
    li.textContent = `${m.name} (${m.state}${size}${expiry})`;
    return li;
  });
  for (const e of frame.model_events.slice(-3)) {
    const li = document.createElement("li");
    li.className = "event";
    li.textContent = `${new Date(e.time * 1000).toLocaleTimeString()} ${e.model} ${e.event} ${e.detail}`;
    items.push(li);
  }
  $("models").replaceChildren(...items);
}

function render(frame) {
  if (pool.model && frame.model !== pool.model) return; // the stream of a model no longer chosen
  pool.model = frame.model;
  drawModels(frame);
  drawBlocks(frame);
  drawTotals(frame);
  const active = chat.active;
  const mine = active && frame.requests.find((r) => r.id === active.requestId);
  if (mine) {
    active.element.dataset.blocks = mine.blocks.join(",");
    active.kv = { blocks: mine.blocks.length, bytes: mine.kv_bytes, tokens: mine.num_tokens, limit: frame.max_model_len };
    showStats(active);
  }
  const last = chat.last?.element.dataset.blocks;
  markMine(mine ? mine.blocks : last ? last.split(",").map(Number) : []);
  drawRequests(frame, active?.requestId);
  drawRate(frame);
}

function setConnection(state, text) {
  const el = $("conn");
  el.dataset.state = state;
  el.textContent = text;
}

// the chosen model's pool; another choice (choose()) aborts the stream and opens that model's
async function watchPool() {
  for (;;) {
    const watching = (pool.watching = new AbortController());
    try {
      const query = pool.model ? `?model=${encodeURIComponent(pool.model)}` : "";
      const response = await api(`/v1/kvserve/cache/stream${query}`, { signal: watching.signal });
      if (response.status === 409) {
        setConnection("idle", pool.model ? `${pool.model} is not loaded: a message loads it`
          : "no model is loaded: a message loads one");
        await listModels(); // no frame draws the menu meanwhile
      } else {
        if (!response.ok) throw new Error(await errorMessage(response));
        setConnection("live", "live");
        for await (const data of events(response)) render(JSON.parse(data));
        setConnection("error", "the stream ended (the model unloaded?); reconnecting");
      }
    } catch (error) {
      if (!watching.signal.aborted) setConnection("error", `${error.message}; reconnecting`);
    }
    if (!watching.signal.aborted) await Promise.race([sleep(1000), new Promise((wake) => { pool.wake = wake; })]);
  }
}

// the models and their last events without a frame (no model loaded, or not the chosen one)
async function listModels() {
  const response = await api("/v1/kvserve/models");
  if (!response.ok) return;
  const { models, events } = await response.json();
  drawModels({ model: pool.model, models, model_events: events, time: Date.now() / 1000 });
}

function choose(model) {
  pool.model = model;
  pool.samples = [];
  pool.watching?.abort();
  pool.wake?.(); // a wait between two tries ends now
}
