// What both pages share: requests to the server (with its API key, asked for when it answers
// 401), storage scoped to where the app is mounted, and number formatting.
//
// Every URL is relative to the page, so the pages work wherever the app is mounted: at "/" the
// API is "v1/...", and under "/llm/" it is "/llm/v1/...".

// The app's base path: two servers on one origin (say /a/ and /b/) keep separate keys and
// conversations, as localStorage is shared by the whole origin.
const scope = new URL(".", document.baseURI).pathname;

export function storageKey(name) {
  return `pyserve:${scope}:${name}`;
}

export function load(name, fallback) {
  try {
    const raw = localStorage.getItem(storageKey(name));
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // unreadable (or storage refused): start afresh
  }
}

// Whether it was kept: storage full or refused, the page keeps working, it just forgets on reload.
export function save(name, value) {
  try {
    localStorage.setItem(storageKey(name), JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

let apiKey = load("apiKey", "");
let pendingKey = null; // one dialog for all the requests that met a 401 at once

function askForKey(refused) {
  if (pendingKey) return pendingKey;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  const message = document.getElementById("key-message");
  if (refused) message.textContent = "The server refused that key. Enter the key it was started with.";
  pendingKey = new Promise((resolve) => {
    const submitted = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      form.removeEventListener("submit", submitted);
      dialog.close();
      input.value = "";
      pendingKey = null;
      resolve(key);
    };
    form.addEventListener("submit", submitted);
    // Without a key nothing works: Escape must not leave the page unusable behind no dialog.
    dialog.addEventListener("cancel", (event) => event.preventDefault(), { once: true });
    dialog.showModal();
    input.focus();
  });
  return pendingKey;
}

// fetch() with the API key; a 401 asks for the key and tries again with the new one.
export async function api(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    if (apiKey) headers.set("Authorization", `Bearer ${apiKey}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const refused = Boolean(apiKey);
    apiKey = await askForKey(refused);
    save("apiKey", apiKey);
  }
}

// The message of an OpenAI-style error body, or the status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch {
    // not JSON: fall through to the status
  }
  return `${response.status} ${response.statusText}`;
}

export function formatNumber(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return value.toFixed(digits);
}

// Seconds as "850 ms" or "1.25 s".
export function formatSeconds(value) {
  if (value === null || value === undefined) return "–";
  if (value === 0) return "0 s";
  if (value < 1) return `${(value * 1000).toFixed(value < 0.01 ? 1 : 0)} ms`;
  return `${value.toFixed(value < 10 ? 2 : 1)} s`;
}

// The server's state for the status badge: /health needs no key.
export async function health() {
  try {
    const response = await fetch("health", { cache: "no-store" });
    const body = await response.json();
    return body.status || (response.ok ? "ok" : "unavailable");
  } catch {
    return "unreachable";
  }
}

export function showStatus(element, status) {
  element.textContent = status === "ok" ? "ready" : status.replace("_", " ");
  element.className = `status ${status === "ok" ? "ok" : "bad"}`;
}
