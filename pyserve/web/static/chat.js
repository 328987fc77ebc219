// The chat page: conversations kept in this browser (localStorage), answers streamed from
// "v1/chat/completions" and rendered as Markdown as they grow. Stop aborts the fetch; the
// server sees its client go away and aborts the request.
//
// Images (where /server_info's "modalities" names "image"): picked, pasted or dropped, they go
// with the next message as OpenAI's content parts, the text then one image_url part (a data URL)
// per image; a message without images is a plain string, as before.

import { api, errorText, formatNumber, formatSeconds, health, load, save, showStatus } from "./common.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const messagesEl = $("messages");
const NEW_TITLE = "New chat";

let conversations = load("conversations", []);
let currentId = load("current", null);
let model = null;
let streaming = null; // { conversation, answer, element, controller }
let renderQueued = false;
let takesImages = false; // until /server_info says otherwise
let attached = []; // the next message's images: { name, url }

const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function current() {
  return conversations.find((c) => c.id === currentId) || null;
}

function persist() {
  save("current", currentId);
  if (save("conversations", conversations)) return;
  // Too big for localStorage (images are big): keep the words, forget the pictures' bytes.
  save("conversations", conversations.map(withoutImages));
}

function withoutImages(conversation) {
  const forget = (part) => (part.type === "image_url" ? { type: "image_url", image_url: { url: "" } } : part);
  const messages = conversation.messages.map((message) =>
    typeof message.content === "string" ? message : { ...message, content: message.content.map(forget) },
  );
  return { ...conversation, messages };
}

// A user message's content is a string, or a list of parts when it has images.
function textOf(content) {
  if (typeof content === "string") return content;
  return content
    .filter((part) => part.type === "text")
    .map((part) => part.text)
    .join("\n");
}

function imagesOf(content) {
  if (typeof content === "string") return [];
  return content.filter((part) => part.type === "image_url").map((part) => part.image_url.url);
}

// ------------------------------------------------------------------ settings

const SETTINGS = { "system-prompt": "system", temperature: "temperature", "top-p": "top_p", "max-tokens": "max_tokens" };

function restoreSettings() {
  // On a phone the settings would push the conversation off the first screen.
  if (window.matchMedia("(max-width: 760px)").matches) $("settings").open = false;
  const saved = load("settings", {});
  for (const [id, key] of Object.entries(SETTINGS)) {
    if (saved[key] !== undefined) $(id).value = saved[key];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const [id, key] of Object.entries(SETTINGS)) values[key] = $(id).value;
  save("settings", values);
}

function number(id) {
  const value = parseFloat($(id).value);
  return Number.isFinite(value) ? value : undefined;
}

// ------------------------------------------------------------------ views

function statsText(stats) {
  const parts = [];
  if (stats.tokens) parts.push(`${stats.exact ? "" : "~"}${stats.tokens} tokens`);
  if (stats.tokensPerS !== null) parts.push(`${formatNumber(stats.tokensPerS, 1)} tokens/s`);
  if (stats.ttft !== null) parts.push(`TTFT ${formatSeconds(stats.ttft)}`);
  if (stats.finish === "length") parts.push("max_tokens reached");
  return parts.join(" · ");
}

function fillAnswer(view, answer, live) {
  const body = view.querySelector(".body");
  const children = [];
  if (answer.reasoning) {
    const thought = el("details", "reasoning");
    thought.append(el("summary", "", "Thinking"));
    const inner = el("div", "body");
    inner.append(renderMarkdown(answer.reasoning));
    thought.append(inner);
    if (live && !answer.content) thought.open = true;
    children.push(thought);
  }
  body.replaceChildren(...children, renderMarkdown(answer.content));
  body.classList.toggle("streaming", live);
  const stats = view.querySelector(".stats");
  stats.replaceChildren();
  if (answer.stats) {
    stats.append(statsText(answer.stats));
    if (answer.stats.finish === "stopped") {
      if (stats.textContent) stats.append(" · ");
      stats.append(el("span", "stopped", "stopped"));
    }
  }
  if (answer.error) stats.append(el("div", "error", answer.error));
}

function imageStrip(urls) {
  const strip = el("div", "images");
  urls.forEach((url, i) => {
    if (!url) {
      strip.append(el("span", "image-gone", "image not kept"));
      return;
    }
    const open = el("button", "image-open");
    open.type = "button";
    open.setAttribute("aria-label", `Image ${i + 1}, full size`);
    const image = el("img");
    image.src = url;
    image.alt = "";
    open.append(image);
    open.addEventListener("click", () => {
      $("image-full").src = url;
      $("image-dialog").showModal();
    });
    strip.append(open);
  });
  return strip;
}

function messageView(message) {
  const view = el("div", `msg ${message.role}`);
  view.append(el("div", "role", message.role === "user" ? "You" : model || "Assistant"));
  const body = el("div", "body");
  view.append(body);
  if (message.role === "user") {
    const text = textOf(message.content);
    body.textContent = text;
    const urls = imagesOf(message.content);
    if (urls.length) {
      const strip = imageStrip(urls);
      strip.classList.toggle("with-text", Boolean(text));
      body.prepend(strip);
    }
  } else {
    view.append(el("div", "stats"));
    fillAnswer(view, message, streaming !== null && streaming.answer === message);
  }
  return view;
}

function renderConversation() {
  const conversation = current();
  const views = [];
  for (const message of conversation ? conversation.messages : []) {
    const view = messageView(message);
    if (streaming && streaming.answer === message) streaming.element = view;
    views.push(view);
  }
  if (!views.length) {
    views.push(el("p", "hint", "Ask the model something. Answers stream in as they are written."));
  }
  messagesEl.replaceChildren(...views);
  messagesEl.scrollTop = messagesEl.scrollHeight;
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren(
    ...conversations.map((conversation) => {
      const item = el("li", conversation.id === currentId ? "current" : "");
      const open = el("button", "open", conversation.title);
      open.type = "button";
      open.title = conversation.title;
      open.addEventListener("click", () => {
        currentId = conversation.id;
        persist();
        renderAll();
      });
      const remove = el("button", "delete", "×");
      remove.type = "button";
      remove.title = "Delete this conversation";
      remove.setAttribute("aria-label", `Delete ${conversation.title}`);
      remove.addEventListener("click", () => deleteConversation(conversation.id));
      item.append(open, remove);
      return item;
    }),
  );
}

function renderAll() {
  renderList();
  renderConversation();
}

function deleteConversation(id) {
  if (streaming && streaming.conversation.id === id) streaming.controller.abort();
  conversations = conversations.filter((c) => c.id !== id);
  if (currentId === id) currentId = conversations.length ? conversations[0].id : null;
  persist();
  renderAll();
}

// One redraw per frame however many chunks arrive in it.
function queueRender() {
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => {
    renderQueued = false;
    if (!streaming || !streaming.element || !streaming.element.isConnected) return;
    const nearBottom = messagesEl.scrollHeight - messagesEl.scrollTop - messagesEl.clientHeight < 60;
    fillAnswer(streaming.element, streaming.answer, true);
    if (nearBottom) messagesEl.scrollTop = messagesEl.scrollHeight;
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ------------------------------------------------------------------ images for the next message

function note(text) {
  $("attach-note").textContent = text;
  $("attach-note").hidden = !text;
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(
    ...attached.map((image) => {
      const thumb = el("figure", "thumb");
      const preview = el("img");
      preview.src = image.url;
      preview.alt = image.name;
      const remove = el("button", "remove", "×");
      remove.type = "button";
      remove.title = "Remove";
      remove.setAttribute("aria-label", `Remove ${image.name}`);
      remove.addEventListener("click", () => {
        attached = attached.filter((other) => other !== image);
        renderAttachments();
        $("prompt").focus();
      });
      thumb.append(preview, remove);
      return thumb;
    }),
  );
  box.hidden = !attached.length;
}

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// Files picked, pasted or dropped: the images join the next message, in order.
async function attach(fileList) {
  const files = [...fileList];
  if (!files.length) return;
  if (!takesImages) {
    note("This model takes no images.");
    return;
  }
  const refused = [];
  const images = [];
  for (const file of files) {
    const name = file.name || "image";
    if (!IMAGE_TYPES.includes(file.type)) refused.push(`${name} is not a PNG, JPEG, WebP or GIF image`);
    else if (file.size > MAX_IMAGE_BYTES) refused.push(`${name} is over 20 MiB`);
    else images.push(file);
  }
  note(refused.join("; "));
  try {
    const urls = await Promise.all(images.map(dataUrl));
    images.forEach((file, i) => attached.push({ name: file.name || `image ${attached.length + 1}`, url: urls[i] }));
  } catch (error) {
    note(`Could not read the image: ${error.message || error}`);
  }
  renderAttachments();
}

// ------------------------------------------------------------------ streaming

// The data fields of a server-sent event stream, one string per event.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) !== -1) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// Images that storage could not keep (see persist) are gone: their message goes as text.
function sendable(content) {
  if (typeof content === "string" || imagesOf(content).every(Boolean)) return content;
  return textOf(content) || "(an image that this browser did not keep)";
}

function requestBody(conversation) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const message of conversation.messages) {
    if (message === streaming.answer) continue;
    if (message.role === "assistant" && (message.error || !message.content)) continue;
    messages.push({ role: message.role, content: sendable(message.content) });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (model) body.model = model;
  const settings = { temperature: number("temperature"), top_p: number("top-p"), max_tokens: number("max-tokens") };
  for (const [key, value] of Object.entries(settings)) if (value !== undefined) body[key] = value;
  if (body.max_tokens !== undefined) body.max_tokens = Math.max(1, Math.round(body.max_tokens));
  return body;
}

async function send(content) {
  let conversation = current();
  if (!conversation) {
    conversation = { id: newId(), title: NEW_TITLE, messages: [] };
    conversations.unshift(conversation);
    currentId = conversation.id;
  }
  if (conversation.title === NEW_TITLE) {
    conversation.title = textOf(content).replace(/\s+/g, " ").slice(0, 60) || "Image";
  }
  conversation.messages.push({ role: "user", content });
  const answer = { role: "assistant", content: "", reasoning: "", stats: null };
  conversation.messages.push(answer);
  const controller = new AbortController();
  streaming = { conversation, answer, element: null, controller };
  persist();
  renderAll();
  setBusy(true);

  const sent = performance.now();
  let first = null;
  let last = null;
  let chunks = 0;
  let usage = null;
  let finish = null;
  try {
    const response = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conversation)),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const piece = delta.content || "";
      const thought = delta.reasoning_content || "";
      if (piece || thought) {
        last = performance.now();
        if (first === null) first = last;
        chunks += 1;
        answer.content += piece;
        answer.reasoning += thought;
        queueRender();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped";
    else answer.error = error.message || String(error);
  }
  // As `vllm bench serve` counts them: TTFT from sending to the first text, and the decode
  // rate over the tokens after the first one.
  const tokens = usage ? usage.completion_tokens : chunks;
  answer.stats = {
    tokens,
    exact: usage !== null,
    ttft: first === null ? null : (first - sent) / 1000,
    tokensPerS: tokens > 1 && last > first ? (tokens - 1) / ((last - first) / 1000) : null,
    finish,
  };
  const element = streaming.element;
  streaming = null;
  setBusy(false);
  persist();
  if (element && element.isConnected) fillAnswer(element, answer, false);
}

// ------------------------------------------------------------------ start

function wire() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if ((!text && !attached.length) || streaming) return;
    let content = text;
    if (attached.length) {
      content = attached.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
      if (text) content.unshift({ type: "text", text });
    }
    prompt.value = "";
    attached = [];
    renderAttachments();
    note("");
    send(content);
  });
  $("attach").addEventListener("click", () => $("attach-input").click());
  $("attach-input").addEventListener("change", async (event) => {
    await attach(event.target.files);
    event.target.value = ""; // the same file may be picked again
  });
  prompt.addEventListener("paste", (event) => attach(event.clipboardData.files));
  // Dropping a file anywhere on the conversation attaches it (and never opens it in this tab).
  const chat = $("chat");
  const carriesFiles = (event) => event.dataTransfer && event.dataTransfer.types.includes("Files");
  chat.addEventListener("dragover", (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    chat.classList.add("dropping");
  });
  chat.addEventListener("dragleave", (event) => {
    if (!chat.contains(event.relatedTarget)) chat.classList.remove("dropping");
  });
  chat.addEventListener("drop", (event) => {
    if (!carriesFiles(event)) return;
    event.preventDefault();
    chat.classList.remove("dropping");
    attach(event.dataTransfer.files);
  });
  // The full-size image closes on a click anywhere (its × button too) or Escape.
  $("image-dialog").addEventListener("click", () => $("image-dialog").close());
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (streaming) streaming.controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    const empty = conversations.find((c) => c.messages.length === 0);
    if (empty) {
      currentId = empty.id;
    } else {
      const conversation = { id: newId(), title: NEW_TITLE, messages: [] };
      conversations.unshift(conversation);
      currentId = conversation.id;
    }
    persist();
    renderAll();
    prompt.focus();
  });
}

// The served model's name (the server may still be loading it: then try again shortly).
async function connect() {
  showStatus($("server-status"), await health());
  try {
    const response = await api("v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    const models = await response.json();
    model = models.data && models.data.length ? models.data[0].id : null;
    await readModalities();
    $("model-name").textContent = model || "no model";
    document.title = `${model} · pyserve`;
    if (!streaming) renderConversation();
  } catch (error) {
    $("model-name").textContent = String(error.message || error);
    setTimeout(connect, 2000);
  }
}

// Whether the server takes images: /server_info's "modalities" (older servers have none: text).
async function readModalities() {
  try {
    const response = await api("server_info", { cache: "no-store" });
    const info = response.ok ? await response.json() : {};
    takesImages = Array.isArray(info.modalities) && info.modalities.includes("image");
  } catch {
    takesImages = false;
  }
  $("attach").hidden = !takesImages;
}

restoreSettings();
wire();
renderAll();
connect();
setInterval(async () => showStatus($("server-status"), await health()), 5000);
