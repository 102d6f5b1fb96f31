// The RayFactory board. The server does all the work (config parsing, validation, tokenization,
// jobs); this file draws the form from /api/spec and shows what the server answers.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const $ = (id) => document.getElementById(id);
let SPEC = null;          // {sections, fields}
let CONFIG = null;        // the server's last answer for the form
let RUN = null;           // the job id shown in the Run panel
let POLL = null;
let CHECKED = false;      // the server has checked the form as it is now, and found no error
let STARTING = false;     // Start was pressed and the server has not answered yet
let MODELS = {};          // model name -> {name, template, note}: what picking a model fills in
let PICKED = null;        // the model last picked, whose template the form took

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
  form.addEventListener("input", (e) => { if (e.target.id === "f-model_name_or_path") modelPicked(); scheduleRefresh(); });
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
  const name = document.createElement("span");  // "Learning rate (learning_rate)": the YAML's key beside
  name.className = "label-text";
  name.textContent = f.label || f.key;
  const key = document.createElement("code");
  key.className = "key";
  key.textContent = f.key;
  if (f.kind === "check") label.append(input, name, " ", key);
  else label.append(name, " ", key, input);
  if (f.help) label.insertAdjacentHTML("beforeend", `<div class="help">${escapeHtml(f.help)}</div>`);
  if (f.key === "template") label.insertAdjacentHTML("beforeend", '<div class="resolved" id="template-resolved"></div>');
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
let refreshSeq = 0;  // answers to older requests than the newest are dropped
let WANTED = null;   // the form (values and the "more keys" box) the latest check is for
function formKey() { return JSON.stringify([fieldValues(), $("extra").value]); }

function scheduleRefresh() {
  updateVisibility();
  const key = formKey();
  // A change event for what was already checked (an input losing focus, as on a click on Start) is no
  // edit: the check stands, and Start stays as it is.
  if (key === WANTED) return;
  WANTED = key;
  setChecking();
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, 250);
}

// Between an edit and the server's answer for it, the config is unchecked: Start waits for the check.
function setChecking() {
  CHECKED = false;
  $("yaml").dataset.valid = "pending";
  setConfigState("checking", "checking the config ...");
  updateStart();
}

function setConfigState(state, text) {
  const box = $("config-state");
  box.dataset.state = state;
  box.textContent = text;
}

function updateStart() {
  const start = $("run-start");
  start.disabled = !CHECKED || STARTING;
  start.title = STARTING ? "starting the job ..." : CHECKED ? "" : "waiting for the config to be checked";
}

async function refresh() {
  const seq = ++refreshSeq;
  WANTED = formKey();
  setChecking();
  let answer;
  try {
    if ($("f-dataset_dir").value !== DATASET_DIR) await loadDatasets();
    answer = await api("/api/config", { values: fieldValues(), extra_text: $("extra").value });
  } catch (e) {
    if (seq !== refreshSeq) return;
    setConfigState("error", `cannot check the config: ${e.message}`);
    $("yaml").dataset.valid = "false";
    return;
  }
  if (seq !== refreshSeq) return;  // the form changed meanwhile: its own check answers
  CONFIG = answer;
  $("yaml").textContent = answer.yaml;
  $("command").textContent = answer.command;
  if (!$("yaml-path").value) $("yaml-path").placeholder = answer.config_path;
  for (const box of document.querySelectorAll(".field-error")) { box.hidden = true; box.textContent = ""; }
  const error = answer.error;
  showError("config-error", error && !error.key ? error.message : "");
  if (error && error.key) {
    const box = $(`err-${error.key}`);
    box.hidden = false;
    box.textContent = error.message;
  }
  CHECKED = !error;
  setConfigState(error ? "error" : "ok", error ? `the config has an error${error.key ? ` (${error.key})` : ""}: Start waits for a fix`
    : "config checked: Start runs it");
  $("yaml").dataset.valid = error ? "false" : "true";
  updateStart();
  resolveTemplate();
}

// What `template: auto` (or the named template) is for the form's model, as the run will resolve it.
let templateKey = null;
async function resolveTemplate() {
  const model = $("f-model_name_or_path").value.trim(), template = $("f-template").value;
  const key = `${model}\n${template}`;
  if (key === templateKey) return;
  templateKey = key;
  const box = $("template-resolved");
  if (template && template !== "auto") {
    const picked = PICKED && PICKED.name === model && PICKED.template === template;
    box.textContent = picked ? `set from the model: ${template} (${PICKED.note})` : "";
    box.dataset.template = template;
    return;
  }
  box.dataset.template = "";
  box.innerHTML = '<span class="spinner"></span> resolving auto from the tokenizer ...';
  let answer;
  try {
    answer = await api("/api/template", { model_name_or_path: model, template: template || "auto" });
  } catch (e) { answer = { template: null, reason: e.message }; }
  if (key !== templateKey) return;
  box.dataset.template = answer.template || "";
  box.textContent = answer.template ? `auto \u2192 ${answer.template}: ${answer.reason}` : `auto: ${answer.reason}`;
}

// Picking a model the registries know sets the template to its family's (LlamaBoard does the same).
function modelPicked() {
  const model = MODELS[$("f-model_name_or_path").value.trim()];
  if (!model || !model.template) return;
  const select = $("f-template");
  if (![...select.options].some((o) => o.value === model.template)) return;
  PICKED = model;
  if (select.value !== model.template) select.value = model.template;
  templateKey = null;
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
  if (!runs.length) list.add(new Option("no runs started from this UI yet", ""));
  for (const run of runs) list.add(new Option(`${run.job_id}  (${run.output_dir})`, run.job_id));
  if (select) list.value = select;
  return runs;
}

function follow(jobId) {
  if (!jobId) return;
  RUN = jobId;
  $("run-list").value = jobId;
  clearInterval(POLL);
  pollRun();
  POLL = setInterval(pollRun, 2000);
}

// The Run panel's line: what the job is doing, with a spinner while something is under way.
function setRunStatus(text, status, busy) {
  const line = $("run-status");
  line.textContent = text;
  line.dataset.status = status;
  line.classList.toggle("busy", Boolean(busy));
}

async function startRun(resume) {
  showError("run-error", "");
  STARTING = true;
  updateStart();
  $("run-resume").disabled = true;
  setRunStatus("starting job ... (a first run also starts the UI's Ray head, ~15 s)", "STARTING", true);
  $("progress").textContent = "";
  $("console").textContent = "";
  $("console").dataset.placeholder = "the job's console appears here once it starts";
  try {
    const answer = resume ? await api(`/api/runs/${RUN}/resume`, {}) : await api("/api/runs", { values: fieldValues(), extra_text: $("extra").value });
    setRunStatus(`${answer.job_id}: submitted, waiting for the job to report ...`, "SUBMITTED", true);
    await loadRuns();
    follow(answer.job_id);
  } catch (e) {
    setRunStatus("the job did not start", "", false);
    showError("run-error", e.message);
    if (RUN) pollRun();  // the run shown before stays shown (and resumable)
  }
  STARTING = false;
  updateStart();
}

const STATUS_TEXT = {
  PENDING: "pending: Ray is starting the job ...", RUNNING: "running", SUCCEEDED: "finished",
  STOPPED: "stopped", FAILED: "failed (the console says why)",
};

async function pollRun() {
  const polled = RUN;
  let s;
  try { s = await api(`/api/runs/${polled}`); } catch (e) { showError("run-error", e.message); return; }
  if (polled !== RUN) return;  // another run was picked meanwhile
  setRunStatus(`${s.job_id}: ${STATUS_TEXT[s.status] || s.status}`, s.status, !s.ended);
  const eta = s.remaining_s === null || s.remaining_s === undefined ? "" : `, eta ${Math.round(s.remaining_s)} s`;
  $("progress").textContent = s.total ? `step ${s.step}/${s.total}${eta}` : s.ended ? "" : "waiting for the first logged step ...";
  $("console").dataset.placeholder = s.ended ? "the job wrote nothing to its console" : "the job's console appears here once it starts";
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
// tool calls per trajectory; eval_tasks scores); each chart is the <svg id="<id>-chart"> of the page.
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

// LlamaBoard's smoothing (llamafactory/extras/ploting.py): an EMA whose weight grows with the series'
// length, so a short series stays close to its points and a long noisy one reads as a trend.
function smooth(values) {
  if (!values.length) return [];
  const weight = 1.8 * (1 / (1 + Math.exp(-0.05 * values.length)) - 0.5);
  let last = values[0];
  return values.map((v) => (last = last * weight + (1 - weight) * v));
}

// About `count` round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
function ticks(lo, hi, count) {
  const raw = (hi - lo) / Math.max(1, count);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((m) => m >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return { values: out, step };
}

function tickText(value, step) {
  const decimals = Math.max(0, Math.min(8, -Math.floor(Math.log10(step))));
  return value.toFixed(decimals);
}

const MARKERS_UP_TO = 40;  // a series this short also gets a dot per point

// One chart: the y axis spans the data (with a little padding), not 0..max, so a loss going from 6.96
// to 6.94 is a slope and not a flat line; each series is drawn raw (thin, with dots when short) and
// smoothed (bold).
function drawSeries(svg, chart, total, empty) {
  const W = svg.width.baseVal.value, H = svg.height.baseVal.value;
  const left = 52, right = 12, top = 22, bottom = 36;
  const series = chart.series.map((s, i) => ({ ...s, color: COLORS[i % COLORS.length] }));
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = series.length ? String(series[0].points.length) : "0";
  svg.dataset.series = series.map((s) => s.key).join(",");
  if (!all.length) {
    delete svg.dataset.ymin; delete svg.dataset.ymax;
    svg.innerHTML = `<text class="placeholder" x="${W / 2}" y="${H / 2}" text-anchor="middle" fill="#8790a3">${escapeHtml(empty)}</text>`;
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const lowX = Math.min(...xs), x0 = lowX > 0 && lowX <= 1 ? 0 : Math.min(0, lowX), x1 = Math.max(total || 0, ...xs, x0 + 1);
  let lo = Math.min(...ys), hi = Math.max(...ys);
  const span = hi - lo || Math.max(Math.abs(hi) * 0.02, 1e-3);
  lo -= span * 0.08; hi += span * 0.08;  // a little room above and below the data
  const yTicks = ticks(lo, hi, 4);
  const X = (x) => left + (x - x0) / (x1 - x0) * (W - left - right);
  const Y = (y) => H - bottom - (y - lo) / (hi - lo) * (H - top - bottom);
  svg.dataset.ymin = String(lo);
  svg.dataset.ymax = String(hi);
  let out = "";
  for (const v of yTicks.values) {
    out += `<line class="grid" x1="${left}" y1="${Y(v)}" x2="${W - right}" y2="${Y(v)}" stroke="#eef0f5"/>`;
    out += `<text class="tick" x="${left - 6}" y="${Y(v) + 3}" font-size="10" fill="#667" text-anchor="end">${tickText(v, yTicks.step)}</text>`;
  }
  out += `<line x1="${left}" y1="${H - bottom}" x2="${W - right}" y2="${H - bottom}" stroke="#aab"/>`;
  out += `<line x1="${left}" y1="${H - bottom}" x2="${left}" y2="${top - 8}" stroke="#aab"/>`;
  out += `<text x="${left}" y="${H - bottom + 12}" font-size="10" fill="#667">${x0}</text>`;
  out += `<text x="${W - right}" y="${H - bottom + 12}" font-size="10" fill="#667" text-anchor="end">step ${x1}</text>`;
  out += `<text class="title" x="${left}" y="13" font-size="11" font-weight="600" fill="#445">${escapeHtml(chart.title)}</text>`;
  series.forEach((s, i) => {
    const points = s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ");
    const short = s.points.length <= MARKERS_UP_TO;
    out += `<polyline class="series" data-key="${escapeHtml(s.key)}" data-points="${s.points.length}" fill="none" stroke="${s.color}" stroke-width="1.2" stroke-opacity="${s.points.length > 1 ? 0.45 : 1}" points="${points}"/>`;
    if (s.points.length > 1) {
      const smoothed = smooth(s.points.map((p) => p[1]));
      const line = s.points.map((p, j) => `${X(p[0])},${Y(smoothed[j])}`).join(" ");
      out += `<polyline class="smoothed" data-key="${escapeHtml(s.key)}" fill="none" stroke="${s.color}" stroke-width="2.2" points="${line}"/>`;
    }
    if (short || s.points.length === 1) {
      for (const p of s.points) {
        out += `<circle class="marker" data-key="${escapeHtml(s.key)}" cx="${X(p[0])}" cy="${Y(p[1])}" r="2.6" fill="${s.color}"><title>${escapeHtml(s.key)} at step ${p[0]}: ${p[1]}</title></circle>`;
      }
    }
    const last = s.points[s.points.length - 1];
    out += `<text class="legend" x="${left + 40 + i * 160}" y="${H - 5}" font-size="11" fill="${s.color}">\u25cf ${escapeHtml(s.key)}: ${Number(last[1].toPrecision(5))}</text>`;
  });
  if (series.some((s) => s.points.length > 1)) {
    out += `<text x="${W - right}" y="13" font-size="10" fill="#8790a3" text-anchor="end">thin: logged values, bold: smoothed (EMA)</text>`;
  }
  svg.innerHTML = out;
}

// --- data preview -------------------------------------------------------------------------

async function runPreview() {
  showError("preview-error", "");
  $("preview").innerHTML = "";
  $("preview-stats").innerHTML = '<span class="spinner"></span> tokenizing ...';
  $("preview-run").disabled = true;
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
  $("preview-run").disabled = false;
}

function emptyHistogram() {
  const svg = $("length-hist");
  svg.innerHTML = `<text class="placeholder" x="${svg.width.baseVal.value / 2}" y="${svg.height.baseVal.value / 2}" text-anchor="middle" fill="#8790a3">Preview a dataset: its token lengths against cutoff_len appear here</text>`;
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

// The Chat tab, as `rayfactory webchat`'s page: the reply streams as server-sent events ({"text"} pieces,
// then {"done", token counts}); Stop aborts the request, and the server cancels the reply in the engine.
let MESSAGES = [];
let CHATTING = null;  // the AbortController of the reply now streaming
let CLEARED = 0;      // Clear's count: a reply stopped by Clear must not bring its history back

function setChatting(controller) {
  CHATTING = controller;
  $("chat-send").disabled = Boolean(controller);
  $("chat-stop").disabled = !controller;
  $("page-chat").dataset.state = controller ? "streaming" : "idle";
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim() || CHATTING) return;
  showError("chat-error", "");
  const messages = MESSAGES.concat([{ role: "user", content: text }]);
  $("chat-input").value = "";
  const userTurn = addBubble("user", text);
  const bubble = addBubble("assistant pending", "");
  const controller = new AbortController();
  const epoch = CLEARED;
  setChatting(controller);
  $("chat-usage").innerHTML = '<span class="spinner"></span> loading the model and answering ...';
  let outcome = "failed";
  try {
    const response = await fetch("/api/chat", {
      method: "POST", signal: controller.signal,
      headers: { "x-rayfactory-token": TOKEN, "content-type": "application/json" },
      body: JSON.stringify({
        model_name_or_path: $("chat-model").value, adapter_name_or_path: $("chat-adapter").value,
        template: $("chat-template").value, system: $("chat-system").value, messages,
        temperature: $("chat-temperature").value, top_p: $("chat-top-p").value,
        max_new_tokens: $("chat-max-new-tokens").value,
      }),
    });
    if (!response.ok) {
      let message = `HTTP ${response.status}`;
      try { message = (await response.json()).error || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    await readEvents(response, (event) => {
      if (event.text !== undefined) {
        bubble.classList.remove("pending");
        bubble.textContent += event.text;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      } else if (event.done) {
        outcome = "done";
        $("chat-usage").textContent = `${event.prompt_tokens} prompt tokens, ${event.completion_tokens} reply tokens ` +
          `(${event.finish_reason})`;
      } else if (event.error) {
        throw new Error(event.error);
      }
    });
  } catch (e) {
    if (e.name === "AbortError") outcome = "stopped";
    else showError("chat-error", e.message);
  }
  bubble.classList.remove("pending");
  if (CHATTING === controller) setChatting(null);
  if (outcome !== "done") $("chat-usage").textContent = outcome === "stopped" ? "stopped" : "";
  if (epoch !== CLEARED) return;
  if (outcome === "failed") {  // nothing the model said: the message goes back to the box
    userTurn.remove();
    bubble.remove();
    $("chat-input").value = text;
    return;
  }
  if (outcome === "stopped") bubble.classList.add("stopped");
  bubble.dataset.done = "true";
  MESSAGES = messages.concat([{ role: "assistant", content: bubble.textContent }]);
}

function stopChat() {
  if (CHATTING) CHATTING.abort();
}

function clearChat() {
  CLEARED += 1;
  stopChat();
  MESSAGES = [];
  $("chat-log").innerHTML = "";
  $("chat-usage").textContent = "";
  showError("chat-error", "");
}

function addBubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

async function runExport() {
  showError("export-error", "");
  $("export-result").innerHTML = '<span class="spinner"></span> merging ... (loads the model and its adapter)';
  $("export-run").disabled = true;
  try {
    const answer = await api("/api/export", {
      model_name_or_path: $("export-model").value, adapter_name_or_path: $("export-adapter").value,
      export_dir: $("export-dir").value, export_size: $("export-size").value,
    });
    $("export-result").textContent = `wrote to ${answer.export_dir}:\n` + answer.files.join("\n");
  } catch (e) { $("export-result").textContent = ""; showError("export-error", e.message); }
  $("export-run").disabled = false;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

// --- start ------------------------------------------------------------------------------

async function main() {
  setChecking();
  SPEC = await api("/api/spec");
  $("cluster").textContent = `runs on: ${SPEC.job_address}`;
  buildForm();
  $("extra").value = SPEC.extra_text;
  $("extra").addEventListener("input", scheduleRefresh);
  for (const model of SPEC.model_list || SPEC.models.map((name) => ({ name, template: "", note: "" }))) {
    MODELS[model.name] = model;
    const option = new Option(model.name, model.name);
    option.label = model.template ? `${model.note} \u00b7 template ${model.template}` : model.note;
    $("model-suggestions").appendChild(option);
  }
  $("f-model_name_or_path").setAttribute("list", "model-suggestions");
  setValues(Object.fromEntries(SPEC.fields.map((f) => [f.key, f.default])));
  drawCharts([{ id: "loss", title: "loss", series: [] }], 0);
  emptyHistogram();
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
  $("chat-stop").addEventListener("click", stopChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); sendChat(); }  // Shift+Enter: a new line
  });
  $("chat-clear").addEventListener("click", clearChat);
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
  setChatting(null);
  await refresh();
  document.body.dataset.ready = "true";
}

main();
