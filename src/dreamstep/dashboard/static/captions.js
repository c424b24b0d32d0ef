// The captions page: every image of the dataset check with its caption file, editable, and a button that
// captions the images without one (a `dreamstep caption` process on the server). Changes carry the token of
// the address the dashboard printed (kept for this tab in sessionStorage). DOM built from text, never innerHTML.
"use strict";

async function call(method, path, body) {
  const response = await fetch(path, {
    method, credentials: "same-origin",
    headers: body ? { "Content-Type": "application/json", "X-Dreamstep-Token": TOKEN } : {},
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await response.text();
  const data = text.startsWith("{") ? JSON.parse(text) : { error: text };
  if (!response.ok) { throw new Error(data.error || `${response.status}`); }
  return data;
}

function imageCard(im) {
  // Without its own caption file an image trains with another text (e.g. the instance prompt): shown, not filled in.
  const own = !im.file || im.has_file;
  const box = el("textarea", { "aria-label": `caption of ${im.name}`,
    placeholder: im.caption && !own ? `no caption file; trains as "${im.caption}"` : "no caption yet" });
  box.value = own ? im.caption || "" : "";
  const note = el("span", { class: "muted" });
  const save = el("button", { type: "button", disabled: im.file ? null : "disabled" }, "Save");
  save.addEventListener("click", async () => {
    note.className = "muted"; note.textContent = "saving…";
    try {
      const done = await call("POST", "/api/dataset/captions", { path: im.path, caption: box.value });
      box.value = done.caption; note.className = "saved"; note.textContent = "saved";
    } catch (e) { note.className = "error"; note.textContent = String(e.message || e); }
  });
  return el("figure", { class: `caption-edit${im.caption && own ? "" : " missing"}`, "data-path": im.path },
    el("img", { src: `/api/dataset/image/${im.number}`, loading: "lazy", alt: im.name }),
    el("figcaption", {}, el("b", { text: im.name }),
      im.file ? box : el("div", { class: "warn", text: im.not_editable }),
      el("div", { class: "row" }, im.file ? save : null, note)));
}

let polling = null;

function showJob(job) {
  const status = document.getElementById("caption-status");
  const log = document.getElementById("caption-log");
  document.getElementById("caption-start").disabled = job.running;
  if (!job.command.length) { status.textContent = ""; log.hidden = true; return; }
  status.textContent = job.running ? "captioning…" : `finished (exit code ${job.returncode})`;
  log.hidden = false; log.textContent = job.log.join("\n");
  log.scrollTop = log.scrollHeight;  // the newest lines, as a terminal shows them
  if (job.running && !polling) {
    polling = setInterval(async () => {
      const { job: now } = await call("GET", "/api/dataset/captions/job");
      showJob(now);
      if (!now.running) { clearInterval(polling); polling = null; await load(); }
    }, 2000);
  }
}

async function load() {
  const data = await call("GET", "/api/dataset/captions");
  const missing = data.images.filter((im) => (im.file && !im.has_file) || !im.caption).length;
  document.getElementById("caption-count").textContent =
    `Images: ${data.images.length}, ${missing} without a caption file`;
  document.getElementById("caption-grid").replaceChildren(...data.images.map(imageCard));
  const select = document.getElementById("captioner");
  if (!select.options.length) { select.replaceChildren(...data.captioners.map((c) => el("option", { value: c, text: c }))); }
  showJob(data.job);
}

window.addEventListener("DOMContentLoaded", async () => {
  document.getElementById("caption-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const status = document.getElementById("caption-status");
    try {
      const { job } = await call("POST", "/api/dataset/captions/missing", {
        captioner: document.getElementById("captioner").value, model: document.getElementById("model").value,
        prefix: document.getElementById("prefix").value });
      showJob(job);
    } catch (e) { status.className = "error"; status.textContent = String(e.message || e); }
  });
  try { await load(); } catch (e) { document.querySelector("main").prepend(el("p", { class: "error", text: String(e.message || e) })); }
});
