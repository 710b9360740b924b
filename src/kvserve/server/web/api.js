"use strict";
// kvserve's page, in three scripts inlined in this order into one: api.js (the key, fetch, server-sent
// events), pool.js (the KV pool, live), chat.js (the chat, and the start). Everything the server is
// asked goes through fetch(), not EventSource, so that an API key can travel in the Authorization header.
// State the tests read is kept in data- attributes: a message's data-state, data-request-id and
// data-blocks, a block cell's data-state and data-n, the pool's counts on #pool.

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "kvserve.apiKey";

let apiKey = localStorage.getItem(KEY_STORAGE) || "";
let keyEntered = null; // a promise while the dialog is open, shared by everyone who got a 401

function withKey(headers) {
  return apiKey ? { ...headers, Authorization: `Bearer ${apiKey}` } : { ...headers };
}

function askForKey(message) {
  if (keyEntered) return keyEntered;
  keyEntered = new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").textContent = message;
    $("key").value = "";
    $("key-form").onsubmit = (event) => {
      event.preventDefault();
      apiKey = $("key").value.trim();
      localStorage.setItem(KEY_STORAGE, apiKey);
      dialog.close();
      keyEntered = null;
      resolve();
    };
    dialog.oncancel = (event) => event.preventDefault(); // nothing works without it
    if (!dialog.open) dialog.showModal();
  });
  return keyEntered;
}

// fetch() with the key; a 401 asks for the key and tries again
async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(path, { ...init, headers: withKey(init.headers) });
    if (response.status !== 401) return response;
    await askForKey(apiKey ? "The server refused that key." : "");
  }
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message ?? body.error ?? text;
  } catch {
    return text || `HTTP ${response.status}`;
  }
}

// the data of each server-sent event
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}
