// The webchat page. The server keeps no conversation: the page sends the whole history with each
// message, and the reply streams back as server-sent events over a fetch (EventSource cannot POST).
// Model text is only ever put in with textContent, never parsed as HTML.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const $ = (id) => document.getElementById(id);
let history = [];      // {role, content} turns the model has seen and answered
let running = null;    // the AbortController of the reply now streaming
let cleared = 0;       // Clear's count: a reply stopped by Clear must not bring its history back

function headers() {
  return { "content-type": "application/json", "x-rayfactory-token": TOKEN };
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  div.textContent = text;
  $("conversation").appendChild(div);
  $("conversation").scrollTop = $("conversation").scrollHeight;
  return div;
}

function setRunning(controller) {
  running = controller;
  $("send").disabled = !!controller;
  $("stop").disabled = !controller;
  document.body.dataset.state = controller ? "streaming" : "idle";
}

async function errorOf(response) {
  try {
    return (await response.json()).error || `HTTP ${response.status}`;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

async function send() {
  const text = $("input").value;
  if (!text.trim() || running) return;
  showError("");
  const messages = history.concat([{ role: "user", content: text }]);
  const userTurn = addTurn("user", text);
  const reply = addTurn("assistant streaming", "");
  reply.dataset.chunks = "0";
  $("input").value = "";
  const controller = new AbortController();
  const epoch = cleared;
  setRunning(controller);
  let outcome = "failed";
  try {
    const response = await fetch("/api/chat", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages, system: $("system").value, temperature: $("temperature").value,
        top_p: $("top_p").value, max_new_tokens: $("max_new_tokens").value,
      }),
    });
    if (!response.ok) throw new Error(await errorOf(response));
    await readEvents(response, (event) => {
      if (event.text !== undefined) {
        reply.textContent += event.text;
        reply.dataset.chunks = String(Number(reply.dataset.chunks) + 1);
        $("conversation").scrollTop = $("conversation").scrollHeight;
      } else if (event.done) {
        outcome = "done";
        $("usage").textContent = `${event.prompt_tokens} prompt tokens, ${event.completion_tokens} reply tokens ` +
          `(${event.finish_reason})`;
      } else if (event.error) {
        throw new Error(event.error);
      }
    });
  } catch (error) {
    if (error.name === "AbortError") {
      outcome = "stopped";
    } else {
      showError(error.message);
    }
  }
  reply.classList.remove("streaming");
  reply.dataset.state = outcome;
  if (running === controller) setRunning(null);
  if (epoch !== cleared) return;
  if (outcome === "failed") {  // nothing the model said: the message goes back to the box
    userTurn.remove();
    reply.remove();
    $("input").value = text;
  } else {  // a stopped reply stays as far as it got: the conversation shown is the one the model sees
    if (outcome === "stopped") reply.classList.add("stopped");
    history = messages.concat([{ role: "assistant", content: reply.textContent }]);
  }
}

function stop() {
  if (running) running.abort();  // the server sees the connection close and stops the engine
}

function clear() {
  cleared += 1;
  stop();
  history = [];
  $("conversation").textContent = "";
  $("usage").textContent = "";
  showError("");
}

async function start() {
  const response = await fetch("/api/info", { headers: headers() });
  if (!response.ok) {
    showError(await errorOf(response));
    return;
  }
  const info = await response.json();
  $("model").textContent = `${info.model} · adapter: ${info.adapter} · template: ${info.template} · ${info.backend}`;
  $("system").value = info.system;
  $("temperature").value = info.temperature;
  $("top_p").value = info.top_p;
  $("max_new_tokens").value = info.max_new_tokens;
  $("max_new_tokens").max = info.max_new_tokens_limit;
  setRunning(null);
  document.body.dataset.ready = "true";
}

$("compose").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", clear);
start();
