// The RayFactory board. The server does all the work (config parsing, validation, tokenization,
// jobs); this file draws the form from /api/spec and shows what the server answers.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const $ = (id) => document.getElementById(id);
let SPEC = null;          // {sections, fields}
let CONFIG = null;        // the server's last answer for the form
let RUN = null;           // the job id shown in the Run panel
let POLL = null;

async function api(path, body, raw) {
  const options = { headers: { "x-rayfactory-token": TOKEN } };
  if (body !== undefined) {
    options.method = "POST";
    options.headers["content-type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (raw) {
    if (!response.ok) throw new Error((await response.json()).error);
    return response;
  }
  const data = await response.json();
  if (!response.ok) { const err = new Error(data.error); err.key = data.key; throw err; }
  return data;
}

function showError(id, message) {
  const box = $(id);
  box.hidden = !message;
  box.textContent = message || "";
}

// --- the form ------------------------------------------------------------------------

function buildForm() {
  const form = $("train-form");
  for (const section of SPEC.sections) {
    const fieldset = document.createElement("fieldset");
    fieldset.innerHTML = `<legend>${section}</legend>`;
    for (const f of SPEC.fields.filter((x) => x.section === section)) fieldset.appendChild(fieldInput(f));
    form.appendChild(fieldset);
  }
  form.addEventListener("input", scheduleRefresh);
  form.addEventListener("change", scheduleRefresh);
}

function fieldInput(f) {
  const label = document.createElement("label");
  label.id = `field-${f.key}`;
  label.className = f.kind === "check" ? "check" : "";
  let input;
  if (f.kind === "select" || f.kind === "datasets") {
    input = document.createElement("select");
    if (f.kind === "datasets") input.multiple = true;
    for (const choice of f.choices) input.add(new Option(choice, choice));
  } else {
    input = document.createElement("input");
    if (f.kind === "check") input.type = "checkbox";
    if (f.kind === "list") input.placeholder = "comma-separated";
  }
  input.id = `f-${f.key}`;
  input.name = f.key;
  label.append(f.key, input);
  if (f.help) label.insertAdjacentHTML("beforeend", `<div class="help">${escapeHtml(f.help)}</div>`);
  label.insertAdjacentHTML("beforeend", `<div class="field-error" id="err-${f.key}" hidden></div>`);
  return label;  // main() sets the defaults once every field is in the page (setValues)
}

function fieldValues() {
  const values = {};
  for (const f of SPEC.fields) {
    const input = $(`f-${f.key}`);
    if (f.kind === "check") values[f.key] = input.checked;
    else if (f.kind === "datasets") values[f.key] = [...input.selectedOptions].map((o) => o.value);
    else values[f.key] = input.value;
  }
  return values;
}

function setValues(values) {
  for (const f of SPEC.fields) {
    const input = $(`f-${f.key}`);
    const value = values[f.key];
    if (f.kind === "check") input.checked = value === true;
    else if (f.kind === "datasets") {
      const wanted = new Set(value || []);
      for (const name of wanted) if (![...input.options].some((o) => o.value === name)) input.add(new Option(name, name));
      for (const option of input.options) option.selected = wanted.has(option.value);
    } else if (f.kind === "select") {
      const text = value === undefined || value === null ? "" : String(value);
      if (text && ![...input.options].some((o) => o.value === text)) input.add(new Option(text, text));
      input.value = text;
    } else if (Array.isArray(value)) input.value = value.join(", ");  // a list field: its entries
    else input.value = value === undefined || value === null ? "" : String(value);
  }
  updateVisibility();
}

function updateVisibility() {
  const values = fieldValues();
  for (const f of SPEC.fields) {
    if (!f.when || !f.when.length) continue;
    const [controller, ...allowed] = f.when;
    $(`field-${f.key}`).hidden = !allowed.includes(values[controller]);
  }
  for (const fieldset of $("train-form").querySelectorAll("fieldset")) {  // rl: only for an RL stage
    fieldset.hidden = ![...fieldset.querySelectorAll("label")].some((label) => !label.hidden);
  }
}

let refreshTimer = null;
function scheduleRefresh() {
  updateVisibility();
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, 250);
}

async function refresh() {
  if ($("f-dataset_dir").value !== DATASET_DIR) await loadDatasets();
  const answer = await api("/api/config", { values: fieldValues(), extra_text: $("extra").value });
  CONFIG = answer;
  $("yaml").textContent = answer.yaml;
  $("command").textContent = answer.command;
  if (!$("yaml-path").value) $("yaml-path").placeholder = answer.config_path;
  for (const box of document.querySelectorAll(".field-error")) { box.hidden = true; box.textContent = ""; }
  const error = answer.error;
  $("yaml").dataset.valid = error ? "false" : "true";
  showError("config-error", error && !error.key ? error.message : "");
  if (error && error.key) {
    const box = $(`err-${error.key}`);
    box.hidden = false;
    box.textContent = error.message;
  }
  $("run-start").disabled = Boolean(error);
}

let DATASET_DIR = null;  // the folder the dataset lists were read from
async function loadDatasets() {
  DATASET_DIR = $("f-dataset_dir").value;
  const dir = DATASET_DIR || "data";
  let names = [];
  try { names = (await api(`/api/datasets?dataset_dir=${encodeURIComponent(dir)}`)).datasets; } catch (e) { names = []; }
  for (const key of ["dataset", "eval_dataset"]) {
    const input = $(`f-${key}`);
    const selected = new Set([...input.selectedOptions].map((o) => o.value));
    input.innerHTML = "";
    for (const name of names) { const o = new Option(name, name); o.selected = selected.has(name); input.add(o); }
  }
  const preview = $("preview-dataset");
  preview.innerHTML = "";
  for (const name of names) preview.add(new Option(name, name));
}

// --- YAML load / save ---------------------------------------------------------------------

async function loadYaml() {
  try {
    const answer = await api("/api/yaml/load", { path: $("yaml-path").value });
    $("extra").value = answer.extra_text;
    if (answer.values.dataset_dir) { $("f-dataset_dir").value = answer.values.dataset_dir; await loadDatasets(); }
    setValues(answer.values);
    $("yaml-message").textContent = `loaded ${$("yaml-path").value}`;
    await refresh();
  } catch (e) { $("yaml-message").textContent = e.message; }
}

async function saveYaml() {
  try {
    const answer = await api("/api/yaml/save", { values: fieldValues(), extra_text: $("extra").value, path: $("yaml-path").value });
    $("yaml-message").textContent = `saved ${answer.path}`;
  } catch (e) { $("yaml-message").textContent = e.message; }
}

// --- runs ---------------------------------------------------------------------------------

async function loadRuns(select) {
  const runs = (await api("/api/runs")).runs;
  const list = $("run-list");
  list.innerHTML = "";
  for (const run of runs) list.add(new Option(`${run.job_id}  (${run.output_dir})`, run.job_id));
  if (select) list.value = select;
  return runs;
}

function follow(jobId) {
  RUN = jobId;
  $("run-list").value = jobId;
  clearInterval(POLL);
  pollRun();
  POLL = setInterval(pollRun, 2000);
}

async function startRun(resume) {
  showError("run-error", "");
  try {
    const answer = resume ? await api(`/api/runs/${RUN}/resume`, {}) : await api("/api/runs", { values: fieldValues(), extra_text: $("extra").value });
    $("run-status").textContent = `${answer.job_id}: submitted`;
    await loadRuns();
    follow(answer.job_id);
  } catch (e) { showError("run-error", e.message); }
}

async function pollRun() {
  let s;
  try { s = await api(`/api/runs/${RUN}`); } catch (e) { showError("run-error", e.message); return; }
  $("run-status").textContent = `${s.job_id}: ${s.status}`;
  $("run-status").dataset.status = s.status;
  const eta = s.remaining_s === null || s.remaining_s === undefined ? "" : `, eta ${Math.round(s.remaining_s)} s`;
  $("progress").textContent = s.total ? `step ${s.step}/${s.total}${eta}` : "";
  $("console").textContent = s.console;
  $("console").scrollTop = $("console").scrollHeight;
  drawCharts(s.charts, s.total);
  $("run-stop").disabled = s.ended;
  $("run-resume").disabled = !s.ended || s.status === "SUCCEEDED";
  if (s.ended) clearInterval(POLL);
}

async function stopRun() {
  try { await api(`/api/runs/${RUN}/stop`, {}); } catch (e) { showError("run-error", e.message); }
}

// The server picks the series (GET /api/runs/<id> "charts": loss; accuracies and rewards; turns and
// tool calls per trajectory); each chart is the <svg id="<id>-chart"> of the page.
const COLORS = ["#1f5bd8", "#e2561d", "#1a9850", "#7b3294", "#c2a5cf", "#91cf60"];

function drawCharts(charts, total) {
  for (const chart of charts) {
    const svg = $(`${chart.id}-chart`);
    if (!svg) continue;
    const hide = chart.id !== "loss" && !chart.series.length;
    svg.toggleAttribute("hidden", hide);  // an <svg> has no .hidden property, only the attribute
    if (!hide) drawSeries(svg, chart, total, "the loss appears here once the run logs");
  }
}

function drawSeries(svg, chart, total, empty) {
  const W = svg.width.baseVal.value, H = svg.height.baseVal.value, pad = 36;
  const series = chart.series.map((s, i) => ({ ...s, color: COLORS[i % COLORS.length] }));
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = series.length ? String(series[0].points.length) : "0";
  svg.dataset.series = series.map((s) => s.key).join(",");
  if (!all.length) { svg.innerHTML = `<text x="${pad}" y="${H / 2}" fill="#8790a3">${empty}</text>`; return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x1 = Math.max(total || 0, ...xs, 1);
  const y0 = Math.min(...ys, 0), y1 = Math.max(...ys) * 1.05 || 1;
  const X = (x) => pad + x / x1 * (W - pad - 10);
  const Y = (y) => H - pad + 10 - (y - y0) / (y1 - y0) * (H - pad - 10);
  let out = `<line x1="${pad}" y1="${Y(y0)}" x2="${W - 10}" y2="${Y(y0)}" stroke="#aab"/>`;
  out += `<line x1="${pad}" y1="${Y(y0)}" x2="${pad}" y2="10" stroke="#aab"/>`;
  out += `<text x="4" y="16" font-size="10" fill="#667">${y1.toFixed(2)}</text><text x="4" y="${Y(y0)}" font-size="10" fill="#667">${y0.toFixed(2)}</text>`;
  out += `<text x="${W - 150}" y="16" font-size="10" fill="#667" text-anchor="end">${escapeHtml(chart.title)}</text>`;
  out += `<text x="${W - 60}" y="${H - 6}" font-size="10" fill="#667">step ${x1}</text>`;
  series.forEach((s, i) => {
    const points = s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ");
    out += `<polyline class="series" data-key="${escapeHtml(s.key)}" data-points="${s.points.length}" fill="none" stroke="${s.color}" stroke-width="2" points="${points}"/>`;
    if (s.points.length === 1) out += `<circle cx="${X(s.points[0][0])}" cy="${Y(s.points[0][1])}" r="3" fill="${s.color}"/>`;
    out += `<text x="${pad + 8 + i * 130}" y="${H - 6}" font-size="11" fill="${s.color}">${escapeHtml(s.key)}</text>`;
  });
  svg.innerHTML = out;
}

// --- data preview -------------------------------------------------------------------------

async function runPreview() {
  showError("preview-error", "");
  $("preview").innerHTML = "";
  $("preview-stats").textContent = "tokenizing ...";
  try {
    const p = await api("/api/preview", { values: fieldValues(), extra_text: $("extra").value, dataset: $("preview-dataset").value });
    const capped = p.capped ? " (the first ones)" : "";
    $("preview-stats").textContent =
      `${p.dataset}: ${p.count} rows${capped} for stage ${p.stage}, template ${p.template}; ` +
      `${p.truncated} longer than cutoff_len ${p.cutoff_len} (they are truncated)`;
    drawHistogram(p.histogram, p.cutoff_len);
    p.rows.forEach((row, index) => {
      const images = (p.images || [])[index] || [];
      for (const seq of row) {
        const div = document.createElement("div");
        div.className = "preview-row";
        div.innerHTML = `<div class="name">${escapeHtml(seq.name)} (${seq.tokens.length} tokens)</div>`;
        // A row with images: its pictures on the left, its tokens beside them.
        const tokens = images.length ? document.createElement("div") : div;
        if (images.length) {
          const body = document.createElement("div");
          body.className = "preview-body";
          body.append(previewImages(images), tokens);
          div.appendChild(body);
        }
        for (const t of seq.tokens) {
          const span = document.createElement("span");
          span.className = `tok ${t.trained ? "trained" : "prompt"}`;
          span.dataset.id = t.id;
          span.title = `id ${t.id}`;
          span.textContent = t.text.replace(/\n/g, "\u21b5");
          tokens.appendChild(span);
        }
        $("preview").appendChild(div);
      }
    });
  } catch (e) { $("preview-stats").textContent = ""; showError("preview-error", e.message); }
}

// The preview's thumbnails (PNG data URLs made by the server, cluster/webui/preview.py); an image
// the server would not show (outside dataset_dir, too large, unreadable) is named with the reason.
function previewImages(images) {
  const box = document.createElement("div");
  box.className = "preview-images";
  for (const im of images) {
    const figure = document.createElement("figure");
    if (typeof im.data_url === "string" && im.data_url.startsWith("data:image/png;base64,")) {
      const img = document.createElement("img");
      img.src = im.data_url;
      img.alt = img.title = im.name;
      img.width = im.width;
      img.height = im.height;
      figure.appendChild(img);
    }
    const caption = document.createElement("figcaption");
    caption.textContent = im.error ? `${im.name}: ${im.error}` : im.name;
    figure.appendChild(caption);
    box.appendChild(figure);
  }
  return box;
}

function drawHistogram(h, cutoff) {
  const svg = $("length-hist");
  const W = svg.width.baseVal.value, H = svg.height.baseVal.value, pad = 24;
  const top = Math.max(...h.counts, 1), n = h.counts.length, bw = (W - 2 * pad) / n;
  let out = "";
  h.counts.forEach((c, i) => {
    const height = c / top * (H - 2 * pad);
    const over = (i + 1) * h.width > cutoff;
    out += `<rect class="bin" data-count="${c}" x="${pad + i * bw + 1}" y="${H - pad - height}" width="${bw - 2}" height="${height}" fill="${over ? "#f4a582" : "#92c5de"}"><title>${i * h.width}-${(i + 1) * h.width} tokens: ${c}</title></rect>`;
  });
  const cx = pad + cutoff / (h.width * n) * (W - 2 * pad);
  out += `<line x1="${cx}" y1="8" x2="${cx}" y2="${H - pad}" stroke="#b42318" stroke-dasharray="4 3"/>`;
  out += `<text x="${cx + 4}" y="16" font-size="10" fill="#b42318">cutoff_len ${cutoff}</text>`;
  out += `<text x="${pad}" y="${H - 6}" font-size="10" fill="#667">0</text><text x="${W - pad - 40}" y="${H - 6}" font-size="10" fill="#667">${h.width * n} tokens</text>`;
  svg.innerHTML = out;
}

// --- chat and export ----------------------------------------------------------------------

function trainedOutput() {
  const values = fieldValues();
  const lora = values.finetuning_type === "lora";
  return { model: lora ? values.model_name_or_path : values.output_dir, adapter: lora ? values.output_dir : "" };
}

let MESSAGES = [];
async function sendChat() {
  const text = $("chat-input").value;
  if (!text) return;
  showError("chat-error", "");
  MESSAGES.push({ role: "user", content: text });
  $("chat-input").value = "";
  addBubble("user", text);
  const bubble = addBubble("assistant", "");
  $("chat-send").disabled = true;
  try {
    const response = await api("/api/chat", {
      model_name_or_path: $("chat-model").value, adapter_name_or_path: $("chat-adapter").value,
      template: $("chat-template").value, system: $("chat-system").value, messages: MESSAGES,
      temperature: $("chat-temperature").value, max_new_tokens: $("chat-max-new-tokens").value,
    }, true);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      bubble.textContent += decoder.decode(value, { stream: true });
    }
    bubble.dataset.done = "true";
    MESSAGES.push({ role: "assistant", content: bubble.textContent });
  } catch (e) { MESSAGES.pop(); bubble.remove(); showError("chat-error", e.message); }
  $("chat-send").disabled = false;
}

function addBubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  return div;
}

async function runExport() {
  showError("export-error", "");
  $("export-result").textContent = "merging ...";
  try {
    const answer = await api("/api/export", {
      model_name_or_path: $("export-model").value, adapter_name_or_path: $("export-adapter").value,
      export_dir: $("export-dir").value, export_size: $("export-size").value,
    });
    $("export-result").textContent = `wrote to ${answer.export_dir}:\n` + answer.files.join("\n");
  } catch (e) { $("export-result").textContent = ""; showError("export-error", e.message); }
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// --- start ------------------------------------------------------------------------------

async function main() {
  SPEC = await api("/api/spec");
  $("cluster").textContent = `runs on: ${SPEC.job_address}`;
  buildForm();
  $("extra").value = SPEC.extra_text;
  $("extra").addEventListener("input", scheduleRefresh);
  for (const name of SPEC.models) $("model-suggestions").appendChild(new Option(name, name));
  $("f-model_name_or_path").setAttribute("list", "model-suggestions");
  setValues(Object.fromEntries(SPEC.fields.map((f) => [f.key, f.default])));
  await loadDatasets();
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => {
      for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
      for (const page of document.querySelectorAll(".page")) page.hidden = page.id !== `page-${tab.dataset.tab}`;
    });
  }
  $("yaml-load").addEventListener("click", loadYaml);
  $("yaml-save").addEventListener("click", saveYaml);
  $("run-start").addEventListener("click", () => startRun(false));
  $("run-resume").addEventListener("click", () => startRun(true));
  $("run-stop").addEventListener("click", stopRun);
  $("run-list").addEventListener("change", () => follow($("run-list").value));
  const runs = await loadRuns();
  if (runs.length) follow(runs[0].job_id);  // a run started before this page was opened goes on showing
  $("preview-run").addEventListener("click", runPreview);
  $("chat-send").addEventListener("click", sendChat);
  $("chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter") sendChat(); });
  $("chat-clear").addEventListener("click", () => { MESSAGES = []; $("chat-log").innerHTML = ""; });
  $("chat-use-run").addEventListener("click", () => {
    const out = trainedOutput();
    $("chat-model").value = out.model;
    $("chat-adapter").value = out.adapter;
  });
  $("export-use-run").addEventListener("click", () => {
    const out = trainedOutput();
    $("export-model").value = out.model;
    $("export-adapter").value = out.adapter;
  });
  $("export-run").addEventListener("click", runExport);
  await refresh();
  document.body.dataset.ready = "true";
}

main();
