// The chat: streamed answers through /v1/chat/completions, with the stop button as an AbortController
// (the server aborts a request whose client goes away, and frees its blocks).

const chat = { history: [], active: null, last: null, controller: null };

function addMessage(role, text) {
  const element = document.createElement("li");
  element.className = "msg";
  element.dataset.role = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  element.append(content);
  const list = $("messages");
  list.append(element);
  list.scrollTop = list.scrollHeight;
  return element;
}

function samplingFields() {
  const fields = {};
  const number = (id) => $(id).valueAsNumber;
  if (!Number.isNaN(number("temperature"))) fields.temperature = number("temperature");
  if (!Number.isNaN(number("top-p"))) fields.top_p = number("top-p");
  if (!Number.isNaN(number("max-tokens"))) fields.max_tokens = number("max-tokens");
  if (!Number.isNaN(number("seed"))) fields.seed = number("seed");
  return fields;
}

// TTFT and decode speed are measured here, from sending to the first and last streamed tokens
function showStats(m) {
  const parts = [];
  const data = m.stats.dataset;
  if (m.first !== null) {
    const ttft = m.first - m.start;
    data.ttftMs = ttft.toFixed(0);
    parts.push(`TTFT ${ttft.toFixed(0)} ms`);
  }
  const tokens = m.usage ? m.usage.completion_tokens : m.chunks;
  if (tokens > 1 && m.last > m.first) {
    const rate = ((tokens - 1) * 1000) / (m.last - m.first);
    data.tokS = rate.toFixed(1);
    parts.push(`${rate.toFixed(1)} tok/s`);
  }
  if (tokens) parts.push(`${tokens} tokens`);
  if (m.usage) {
    const cached = m.usage.prompt_tokens_details?.cached_tokens ?? 0;
    data.cachedTokens = cached;
    data.promptTokens = m.usage.prompt_tokens;
    parts.push(`prompt ${m.usage.prompt_tokens} (${cached} cached)`);
  }
  if (m.kv) parts.push(`KV ${m.kv.blocks} blocks, ${bytes(m.kv.bytes)} · context ${m.kv.tokens} / ${m.kv.limit}`);
  m.stats.textContent = parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function modelName() {
  if (!pool.model) {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    choose((await response.json()).data[0].id); // the pool shows the model the chat talks to
  }
  return pool.model;
}

async function send(text) {
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...chat.history, { role: "user", content: text }];
  chat.history.push({ role: "user", content: text });
  addMessage("user", text);
  const element = addMessage("assistant", "");
  element.dataset.state = "waiting";
  const content = element.querySelector(".content");
  const stats = document.createElement("div");
  stats.className = "stats";
  element.append(stats);
  const m = { element, stats, start: performance.now(), first: null, last: null, chunks: 0, usage: null, kv: null, requestId: null };
  const controller = new AbortController();
  Object.assign(chat, { active: m, controller });
  setBusy(true);
  let answer = "";
  try {
    const body = { model: await modelName(), messages, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" }, signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (!m.requestId) {
        m.requestId = `${chunk.id}-0`; // the engine's id of choice 0
        element.dataset.requestId = m.requestId;
        element.dataset.state = "streaming";
      }
      const delta = chunk.choices[0]?.delta?.content;
      if (delta) {
        const now = performance.now();
        if (m.first === null) m.first = now;
        m.last = now;
        m.chunks++;
        answer += delta;
        content.textContent = answer;
        const list = $("messages");
        list.scrollTop = list.scrollHeight;
      }
      if (chunk.usage) m.usage = chunk.usage;
      showStats(m);
    }
    element.dataset.state = "done";
  } catch (error) {
    if (controller.signal.aborted) {
      element.dataset.state = "stopped";
    } else {
      element.dataset.state = "error";
      const note = document.createElement("div");
      note.className = "error";
      note.textContent = error.message;
      element.insertBefore(note, stats);
    }
  } finally {
    if (answer) chat.history.push({ role: "assistant", content: answer });
    Object.assign(chat, { active: null, last: m, controller: null });
    showStats(m);
    setBusy(false);
  }
}

function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || chat.active) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => chat.controller?.abort());
  $("model").addEventListener("change", (event) => choose(event.target.value));
  $("clear").addEventListener("click", () => {
    if (chat.active) return;
    Object.assign(chat, { history: [], last: null });
    $("messages").replaceChildren();
  });
  watchPool();
}

start();
