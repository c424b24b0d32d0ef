// The new-run page: a form generated from the trainer's own options (GET /api/trainers/T/form), checked by
// the server as it changes (POST /api/jobs/check), with the memory plan and the dataset check of the chosen
// options (POST /api/jobs/plan, /api/jobs/dataset), and the job queue with its buttons. Every change is a JSON
// POST carrying the token of the address the dashboard printed (kept for this tab in sessionStorage).
"use strict";

const $ = (id) => document.getElementById(id);
let fields = [];
let checkTimer = null;
let previewAsked = "";  // the options of the last preview (the run's name changes nothing in it)
let previewBusy = false;  // one preview at a time: a full-size plan takes seconds; the latest options go next
let shownLog = null;

async function getJSON(path) {
  const response = await fetch(path, { headers: { "X-Dreamstep-Token": TOKEN } });
  return response.json();
}

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST", body: JSON.stringify(body || {}),
    headers: { "Content-Type": "application/json", "X-Dreamstep-Token": TOKEN },
  });
  const text = await response.text();
  let data;
  try { data = JSON.parse(text); } catch (e) { data = { error: text }; }
  return { ok: response.ok, data };
}

function input(field) {
  const id = `opt-${field.name}`;
  if (field.kind === "bool" || field.kind === "choice") {
    const choices = field.kind === "bool" ? ["true", "false"] : field.choices;
    return el("select", { id, name: field.name }, el("option", { value: "", text: "(default)" }),
      ...choices.map((c) => el("option", { value: c, text: c })));
  }
  const shown = Array.isArray(field.default) ? field.default.join(" ") : field.default;
  return el("input", { id, name: field.name, placeholder: shown === null || shown === undefined ? "" : String(shown),
                       title: field.kind === "list" ? "several values: separate them with spaces" : null });
}

function renderForm(form) {
  fields = form.fields;
  const box = $("groups");
  box.replaceChildren();
  for (const group of form.groups) {
    const members = fields.filter((f) => f.group === group);
    if (!members.length) { continue; }
    box.append(el("fieldset", { "data-group": group }, el("legend", { text: group }), ...members.map((f) => {
      const fallback = f.required ? "required" : `default: ${JSON.stringify(f.default)}`;
      return el("div", { class: "field", "data-name": f.name },
        el("label", { for: `opt-${f.name}`, text: `--${f.name}` }), input(f),
        el("div", {}, el("span", { class: "help", text: `${f.help} (${fallback})` }),
          el("div", { class: "field-error", "data-for": f.name })));
    })));
  }
}

function options() {
  const chosen = {};
  for (const f of fields) {
    const value = $(`opt-${f.name}`).value.trim();
    if (value !== "") { chosen[f.name] = f.kind === "list" ? value.split(/\s+/) : value; }
  }
  return chosen;
}

function setOptions(values) {
  for (const f of fields) {
    const value = values[f.name];
    $(`opt-${f.name}`).value = value === undefined ? "" : Array.isArray(value) ? value.join(" ") : String(value);
  }
  scheduleCheck();
}

function request() {
  return { trainer: $("trainer").value, output_root: Number($("output_root").value), name: $("name").value,
           options: options() };
}

function showError(field, message) {
  document.querySelectorAll(".field-error").forEach((node) => { node.textContent = ""; });
  document.querySelectorAll(".field.invalid").forEach((node) => node.classList.remove("invalid"));
  if (!message) { return; }
  const target = document.querySelector(`.field-error[data-for="${field}"]`) ||
                 document.querySelector('.field-error[data-for="options"]');
  target.textContent = message;
  const row = document.querySelector(`.field[data-name="${field}"]`);
  if (row) { row.classList.add("invalid"); }
}

function scheduleCheck() {
  clearTimeout(checkTimer);
  checkTimer = setTimeout(check, 300);
}

async function check() {
  const { ok, data } = await post("/api/jobs/check", request());
  showError(data.field, ok ? null : data.error);
  $("command").textContent = ok ? data.command.join(" ") : "";
  $("toml").textContent = ok ? data.toml : "";
  $("queue").disabled = !ok;
  if (ok) { preview(); } else { waitForValidOptions(); }
  return ok;
}

const GIB = 2 ** 30;
const size = (bytes) => bytes >= GIB / 10 ? `${(bytes / GIB).toFixed(2)} GiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function preview() {
  const body = request();
  const asked = JSON.stringify({ ...body, name: "" });
  if (previewBusy || asked === previewAsked) { return; }
  previewBusy = true;
  previewAsked = asked;
  for (const id of ["plan", "dataset-check"]) { $(id).dataset.state = "computing"; }
  $("plan-verdict").textContent = "computing the memory plan (on the meta device: no weights are read) ...";
  $("dataset-verdict").textContent = "checking the data ...";
  try {
    const [dataset, plan] = await Promise.all([post("/api/jobs/dataset", body), post("/api/jobs/plan", body)]);
    showDataset(dataset);
    showPlan(plan);
    summarise(dataset, plan);
  } finally {
    previewBusy = false;
  }
  const latest = request();
  if (JSON.stringify({ ...latest, name: "" }) !== previewAsked) { scheduleCheck(); }  // changed meanwhile
}

function summarise(dataset, plan) {
  // One line that stays in view at the bottom of the long form: the plan's verdict and the data's counts.
  const found = plan.ok ? plan.data.plan : null;
  const memory = !found ? "plan: see the error" : found.fits === null ? `peak ${size(found.peak)} (no card to check)`
    : `peak ${size(found.peak)}: ${found.fits ? "fits" : "does NOT fit"} (${found.card})`;
  const data = !dataset.ok ? "data: see the error" : `${dataset.data.dataset.images.length} images, ` +
    `${dataset.data.dataset.problems.length} problems`;
  $("preview-summary").textContent = `${memory} · ${data}`;
}

function waitForValidOptions() {
  $("preview-summary").textContent = "";
  previewAsked = "";
  for (const id of ["plan", "dataset-check"]) { $(id).dataset.state = "idle"; }
  $("plan-verdict").textContent = "the plan follows once the options are valid";
  $("dataset-verdict").textContent = "the dataset check follows once the options are valid";
}

function showPlan({ ok, data }) {
  $("plan").dataset.state = ok ? "ready" : "error";
  $("plan-report").hidden = !ok;
  $("plan-fit").replaceChildren();
  if (!ok) { $("plan-verdict").textContent = data.error; $("plan").dataset.fits = ""; return; }
  const plan = data.plan;
  const verdict = plan.fits === null ? "" : plan.fits ? "fits" : "does NOT fit";
  $("plan").dataset.fits = plan.fits === null ? "unknown" : String(plan.fits);
  $("plan-verdict").className = plan.fits === false ? "error" : "";
  $("plan-verdict").textContent = `peak ${size(plan.peak)} on the device (${plan.peak_phase}), ` +
    `${size(plan.host_peak)} in host memory; base: ${plan.base}; card: ${plan.card}` + (verdict ? `: ${verdict}` : "");
  $("plan-fit").append(...plan.would_fit.map((f) => el("li", { text: `would fit: ${f.flags} (${size(f.peak)})` })));
  if (plan.fits === false && !plan.would_fit.length) {
    $("plan-fit").append(el("li", { text: "nothing among the memory options fits: lower the resolution or batch" }));
  }
  $("plan-report").textContent = plan.report;
}

function showDataset({ ok, data }) {
  const box = $("dataset-check");
  box.dataset.state = ok ? "ready" : "error";
  for (const id of ["dataset-buckets", "dataset-captions", "dataset-problems"]) { $(id).replaceChildren(); }
  if (!ok) { $("dataset-verdict").textContent = data.error; return; }
  const check = data.dataset;
  const used = check.images.filter((i) => i.used);
  const samples = check.subsets.reduce((n, s) => n + s.samples, 0);
  $("dataset-verdict").textContent = `${check.source}: ${check.images.length} images, ${used.length} used, ` +
    `${samples} samples per epoch, ${check.problems.length} problems`;
  $("dataset-buckets").append(...check.datasets.flatMap((d) => d.buckets.map((b) => el("li", {
    text: `${d.enable_bucket ? "bucket" : "crop"} ${b.size[0]}x${b.size[1]}: ${b.images.length} images`,
  }))));
  $("dataset-captions").append(...used.slice(0, 8).map((i) => el("li", { text: `${i.name}: ${i.caption}` })));
  $("dataset-problems").append(...check.problems.slice(0, 20).map((p) => el("li", { text: p })));
}

async function loadTrainer() {
  renderForm(await getJSON(`/api/trainers/${encodeURIComponent($("trainer").value)}/form`));
  scheduleCheck();
}

async function fromToml(text) {
  const { ok, data } = await post("/api/jobs/from_toml", { trainer: $("trainer").value, toml: text });
  if (!ok) { showError(data.field, data.error); return; }
  setOptions(data.options);
}

async function submit(event) {
  event.preventDefault();
  const { ok, data } = await post("/api/jobs", request());
  if (!ok) { showError(data.field, data.error); return; }
  showError(null, null);
  shownLog = data.job.id;
  document.body.dataset.answered = `queued ${data.job.id}`;
  await refreshJobs();
}

const ACTIONS = { running: ["stop", "sample"], queued: ["up", "down", "cancel"], stopped: ["resume"],
                  failed: ["resume"] };
const LABELS = { stop: "Stop", sample: "Sample now", up: "Up", down: "Down", cancel: "Cancel", resume: "Resume" };

async function refreshJobs() {
  const { jobs } = await getJSON("/api/jobs");
  $("jobs").tBodies[0].replaceChildren(...jobs.map((job) => {
    const status = job.status || {};
    const progress = status.total_steps ? `${status.step || 0} / ${status.total_steps}` : "";
    const name = job.output_dir.split("/").pop();
    const buttons = (ACTIONS[job.state] || []).map((action) => el("button", {
      "data-action": action, "data-job": job.id, text: LABELS[action],
      onclick: async () => {
        await post(`/api/jobs/${job.id}/${action}`);
        document.body.dataset.answered = `${action} ${job.id}`;  // the server has the request
        shownLog = job.id;
        await refreshJobs();
      },
    }));
    return el("tr", { "data-job": job.id, "data-state": job.state },
      el("td", { text: String(job.id) }),
      el("td", {}, job.run_id ? el("a", { href: `/#/run/${encodeURIComponent(job.run_id)}`, text: name })
                              : el("span", { text: name })),
      el("td", { text: job.trainer }), el("td", { class: "state", text: job.state }),
      el("td", { class: "progress", text: progress }),
      el("td", {}, ...buttons, el("button", { text: "Log", onclick: () => { shownLog = job.id; refreshLog(); } })));
  }));
  if (shownLog === null && jobs.length) { shownLog = jobs[0].id; }
  await refreshLog();
}

async function refreshLog() {
  if (shownLog === null) { return; }
  const data = await getJSON(`/api/jobs/${shownLog}/log`);
  $("job-log").hidden = !data.log;
  $("job-log").textContent = data.log ? `job ${shownLog}\n${data.log.slice(-200).join("\n")}` : "";
  $("job-log").scrollTop = $("job-log").scrollHeight;  // follow the end, as a terminal does
}

async function start() {
  const info = await getJSON("/api/trainers");
  $("trainer").replaceChildren(...info.trainers.map((t) => el("option", { value: t, text: t })));
  $("output_root").replaceChildren(...info.output_roots.map((r, i) => el("option", { value: String(i), text: r })));
  $("roots").textContent = [...info.output_roots, ...info.data_roots].join(", ");
  const { runs } = await getJSON("/api/runs");
  $("from-run").append(...runs.map((r) => el("option", { value: r.id, text: r.name })));
  $("trainer").onchange = loadTrainer;
  $("new-run").oninput = scheduleCheck;
  $("new-run").onsubmit = submit;
  $("from-run").onchange = async () => {
    if (!$("from-run").value) { setOptions({}); return; }
    const detail = await getJSON(`/api/runs/${encodeURIComponent($("from-run").value)}`);
    await fromToml(detail.config || "");
  };
  $("from-file").onchange = async () => { const file = $("from-file").files[0]; if (file) { await fromToml(await file.text()); } };
  await loadTrainer();
  await refreshJobs();
  setInterval(refreshJobs, 1000);
}

start();
