// The dashboard page: a hash router (#/, #/run/ID, #/compare/ID,ID, #/dataset) over the JSON API.
// Every view builds its DOM from text (never innerHTML with data) and refreshes itself every 2 s.
"use strict";

const POLL_MS = 2000;
const SAMPLES_SHOWN = 24;
const COLORS = ["#1446aa", "#c2410c", "#15803d", "#7e22ce", "#0e7490", "#be123c", "#4d7c0f", "#a16207"];
let current = null;  // {refresh(): Promise} of the view on screen

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) { throw new Error(`${url}: ${response.status} ${await response.text()}`); }
  return response.json();
}

function fileURL(runId, path) {
  return `/files/${encodeURIComponent(runId)}/${path.split("/").map(encodeURIComponent).join("/")}`;
}

function fmt(v, digits = 4) { return v === null || v === undefined ? "–" : Number(v).toPrecision(digits); }

function duration(seconds) {
  if (seconds === null || seconds === undefined) { return "–"; }
  const s = Math.round(seconds);
  if (s < 60) { return `${s} s`; }
  if (s < 3600) { return `${Math.floor(s / 60)} min ${s % 60} s`; }
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function badge(state) { return el("span", { class: `badge ${state}`, text: state, "data-state": state }); }

function progress(step, total) {
  const bar = el("div", { class: "bar" }, el("div"));
  bar.firstChild.style.width = total ? `${Math.min(100, 100 * (step || 0) / total)}%` : "0";
  return bar;
}

// A section of a page that re-renders only when its data changed (images are not reloaded every poll).
function section(id, title) {
  const body = el("div", { class: "body" });
  const node = el("section", { class: "card", id }, el("h2", { text: title }), body);
  let last = null;
  return {
    node,
    update(data, render) {
      const key = JSON.stringify(data);
      if (key === last) { return; }
      last = key;
      body.replaceChildren();
      if (data && data.error) { body.append(el("p", { class: "error", text: data.error })); return; }
      render(body, data);
    },
  };
}

// ---- runs list ----------------------------------------------------------------------------------------

function runsView() {
  const selected = new Set();
  const compare = el("button", { onclick: () => { location.hash = `#/compare/${[...selected].map(encodeURIComponent).join(",")}`; } },
    "Compare selected");
  const list = section("runs", "Runs");
  const root = el("div", {}, el("h1", { text: "Runs" }), list.node, el("div", { class: "row" }, compare,
    el("span", { class: "muted", text: "tick two or more runs to compare their curves and samples" })));
  return {
    root,
    async refresh() {
      const data = await getJSON("/api/runs");
      list.update(data, (body, { runs }) => {
        if (!runs.length) { body.append(el("p", { class: "muted", text: "No run folders found yet." })); return; }
        const rows = runs.map((r) => {
          if (r.error) { return el("tr", {}, el("td"), el("td", { colspan: 7, class: "error", text: r.error })); }
          const box = el("input", { type: "checkbox", onchange: (e) => { if (e.target.checked) { selected.add(r.id); } else { selected.delete(r.id); } } });
          box.checked = selected.has(r.id);
          return el("tr", { "data-run": r.id },
            el("td", {}, box),
            el("td", {}, el("a", { href: `#/run/${encodeURIComponent(r.id)}`, text: r.name }),
              el("div", { class: "muted", text: r.folder }),
              ...r.errors.map((e) => el("div", { class: "error", text: e }))),
            el("td", {}, badge(r.state), el("div", { class: "muted", text: r.state_detail })),
            el("td", { class: "num" }, `${r.step ?? "–"} / ${r.total ?? "?"}`, progress(r.step, r.total)),
            el("td", { class: "num", text: r.seconds_per_step ? `${fmt(r.seconds_per_step, 3)} s` : "–" }),
            el("td", { class: "num", text: duration(r.eta_s) }),
            el("td", { class: "num", text: fmt(r.last_loss) }));
        });
        body.append(el("table", {}, el("thead", {}, el("tr", {}, ...["", "run", "status", "step / total", "s/step", "ETA", "last loss"].map((h) => el("th", { text: h })))),
          el("tbody", {}, rows)));
      });
    },
  };
}

// ---- one run ------------------------------------------------------------------------------------------

function lossSeries(curves, color, label) {
  const out = [];
  const loss = curves && curves.loss;
  if (loss) {
    if (label === undefined) { out.push({ x: loss.steps, y: loss.values, color: "#b9c6e4", width: 1, label: "loss (raw)" }); }
    out.push({ x: loss.smoothed_steps, y: loss.smoothed, color, width: 2, label: label ?? "loss (smoothed)" });
  }
  return out;
}

function chartCard(id, title) {
  const canvas = el("canvas", { class: "chart", id: `${id}-canvas` });
  const card = section(id, title);
  card.node.insertBefore(canvas, card.node.lastChild);
  return { card, canvas };
}

function samplesGrid(runId, samples, limit) {
  const shown = samples.slice().reverse().slice(0, limit);
  return el("div", { class: "grid" }, shown.map((s) => el("figure", { "data-step": s.step },
    el("a", { href: fileURL(runId, s.path), target: "_blank" }, el("img", { src: fileURL(runId, s.path), loading: "lazy", alt: s.name })),
    el("figcaption", {},
      el("div", {}, el("b", { text: `step ${s.step ?? "?"}` }), s.kind ? `  ·  ${s.kind}` : "", s.seed !== undefined && s.seed !== null ? `  ·  seed ${s.seed}` : ""),
      el("div", { text: s.prompt || "(prompt unknown)" }),
      s.error ? el("div", { class: "error", text: s.error }) : null))));
}

function runView(runId) {
  const title = el("h1", { text: runId });
  const status = el("div", { class: "row" });
  const chart = chartCard("loss", "Loss and learning rate");
  const samples = section("samples", "Samples");
  const metrics = section("metrics", "Evaluation metrics");
  let metricCharts = [];
  const config = section("config", "Resolved config.toml");
  const loras = section("loras", "Output LoRA files");
  const log = section("log", "Log (train.log, last lines)");
  let showAll = false;  // all samples (fetched once) instead of the latest ones
  let lastDetail = null;
  const root = el("div", {}, title, status, chart.card.node, samples.node, metrics.node,
    el("div", { class: "two" }, config.node, loras.node), log.node);

  function drawLoss(curves) {
    if (curves.error) { chart.card.update(curves, () => {}); return; }
    const series = lossSeries(curves, COLORS[0]);
    if (curves.lr) { series.push({ x: curves.lr.steps, y: curves.lr.values, color: "#c2410c", width: 1.2, dash: [5, 4], axis: "right", label: "learning rate (right axis)" }); }
    drawChart(chart.canvas, { series, yLabel: "loss", y2Label: "lr", empty: "no steps logged yet" });
    const count = curves.loss ? curves.loss.count : 0;
    chart.card.update({ count, source: curves.source, tags: Object.keys(curves) }, (body) => {
      body.append(chartLegend(series), el("p", { class: "muted", text: `${count} steps, read from ${curves.source || "–"}` }));
    });
  }

  function drawMetrics(data) {
    metrics.node.hidden = data === null;
    if (data === null) { return; }
    metrics.update(data, (body) => {
      const names = Object.keys(data.metrics);
      // One chart per metric, on its own axis in its own units: val_loss and an image score differ by orders of
      // magnitude, and one shared scale (or each squeezed to 0-1) would hide the values.
      metricCharts = names.map((name, i) => ({
        canvas: el("canvas", { class: "chart metric", id: `metric-${i}-canvas`, "data-metric": name }),
        series: [{ x: data.steps, y: data.metrics[name], color: COLORS[i % COLORS.length], label: name }],
      }));
      body.append(el("div", { class: "metric-charts" }, metricCharts.map((c) => el("figure", {}, c.canvas,
        el("figcaption", { text: c.series[0].label })))), el("p", { class: "muted", text: `from ${data.source}` }));
      const rows = data.steps.map((step, i) => el("tr", {}, el("td", { class: "num", text: step }), names.map((n) => el("td", { class: "num", text: fmt(data.metrics[n][i]) }))));
      body.append(el("table", {}, el("thead", {}, el("tr", {}, el("th", { text: "step" }), names.map((n) => el("th", { text: n })))), el("tbody", {}, rows)));
      if (data.png) { body.append(el("p", {}, el("a", { href: fileURL(runId, "metrics.png"), target: "_blank", text: "metrics.png" }))); }
    });
    for (const c of metricCharts) { drawChart(c.canvas, { series: c.series }); }
  }

  function renderSamples() {
    const total = lastDetail.samples_total;
    samples.update({ list: lastDetail.samples, total, all: showAll }, (body, { list }) => {
      if (!list.length) { body.append(el("p", { class: "muted", text: "No sample images yet." })); return; }
      if (!showAll) {
        body.append(samplesGrid(runId, list, SAMPLES_SHOWN));
        if (total > SAMPLES_SHOWN) {
          body.append(el("p", {}, el("button", { onclick: () => { showAll = true; renderSamples(); } }, `Show all ${total}`)));
        }
        return;
      }
      body.append(el("p", { class: "muted", text: `loading ${total} samples…` }));
      getJSON(`/api/runs/${encodeURIComponent(runId)}/samples`).then(({ samples: all }) => {
        body.replaceChildren(all.error ? el("p", { class: "error", text: all.error }) : samplesGrid(runId, all, all.length));
      }).catch((e) => body.replaceChildren(el("p", { class: "error", text: String(e) })));
    });
  }

  return {
    root,
    async refresh() {
      const d = await getJSON(`/api/runs/${encodeURIComponent(runId)}`);
      lastDetail = d;
      const s = d.summary;
      title.textContent = s.name || runId;
      status.replaceChildren(badge(s.state || "unknown"), el("span", { class: "muted", text: s.state_detail || "" }),
        el("span", { text: `step ${s.step ?? "–"} / ${s.total ?? "?"}` }), progress(s.step, s.total),
        el("span", { text: `${s.seconds_per_step ? fmt(s.seconds_per_step, 3) + " s/step" : ""}` }),
        el("span", { text: s.eta_s ? `ETA ${duration(s.eta_s)}` : "" }),
        el("span", { text: `last loss ${fmt(s.last_loss)}` }),
        ...(s.errors || []).map((e) => el("div", { class: "error", text: e })));
      drawLoss(d.curves);
      if (d.samples.error) { samples.update(d.samples, () => {}); } else { renderSamples(); }
      drawMetrics(d.metrics);
      config.update(d.config, (body, text) => body.append(text === null ? el("p", { class: "muted", text: "no config.toml" }) : el("pre", { text })));
      loras.update(d.lora_files, (body, files) => {
        if (!files.length) { body.append(el("p", { class: "muted", text: "No LoRA files yet." })); return; }
        body.append(el("p", { class: "muted", text: "reading the files (dreamstep lora info)…" }));
        getJSON(`/api/runs/${encodeURIComponent(runId)}/loras`).then(({ loras: reports }) => {
          body.replaceChildren();
          if (reports.error) { body.append(el("p", { class: "error", text: reports.error })); return; }
          for (const f of reports) {
            body.append(el("h3", {}, el("a", { href: fileURL(runId, f.name), text: f.name }), el("span", { class: "muted", text: `  ${(f.size / 1e6).toFixed(2)} MB` })),
              f.error ? el("p", { class: "error", text: f.error }) : el("pre", { text: f.info }));
          }
        }).catch((e) => body.replaceChildren(el("p", { class: "error", text: String(e) })));
      });
      log.update(d.log, (body, lines) => {
        if (lines === null) { body.append(el("p", { class: "muted", text: "no train.log" })); return; }
        const pre = el("pre", { class: "log", text: lines.join("\n") });
        body.append(pre);
        pre.scrollTop = pre.scrollHeight;  // the newest lines, as a terminal shows them
      });
    },
  };
}

// ---- compare ------------------------------------------------------------------------------------------

function compareView(ids) {
  const chart = chartCard("compare-loss", "Smoothed loss");
  const table = section("compare-table", "Runs");
  const samples = section("compare-samples", "Latest samples");
  const root = el("div", {}, el("h1", { text: "Compare runs" }), table.node, chart.card.node, samples.node);
  return {
    root,
    async refresh() {
      if (ids.length < 2) {
        table.update({ need: true }, (body) => body.append(el("p", { class: "muted", text: "Tick two or more runs on the Runs page, then press Compare selected." })));
        return;
      }
      const details = await Promise.all(ids.map((id) => getJSON(`/api/runs/${encodeURIComponent(id)}`).catch((e) => ({ error: String(e) }))));
      const series = [];
      details.forEach((d, i) => { if (!d.error && !d.curves.error) { series.push(...lossSeries(d.curves, COLORS[i % COLORS.length], d.summary.name)); } });
      drawChart(chart.canvas, { series, yLabel: "loss" });
      chart.card.update(series.map((s) => s.label), (body) => body.append(chartLegend(series)));
      table.update(details.map((d) => d.summary || d), (body, summaries) => {
        body.append(el("table", {}, el("thead", {}, el("tr", {}, ["run", "status", "step / total", "s/step", "last loss"].map((h) => el("th", { text: h })))),
          el("tbody", {}, summaries.map((s, i) => s.error ? el("tr", {}, el("td", { colspan: 5, class: "error", text: s.error })) : el("tr", {},
            el("td", {}, el("a", { href: `#/run/${encodeURIComponent(ids[i])}`, text: s.name })), el("td", {}, badge(s.state)),
            el("td", { class: "num", text: `${s.step ?? "–"} / ${s.total ?? "?"}` }), el("td", { class: "num", text: fmt(s.seconds_per_step, 3) }),
            el("td", { class: "num", text: fmt(s.last_loss) }))))));
      });
      samples.update(details.map((d) => (d.samples && !d.samples.error ? d.samples.slice(-4) : [])), (body, lists) => {
        const cols = el("div", { class: "compare-cols" });
        cols.style.gridTemplateColumns = `repeat(${ids.length}, 1fr)`;
        lists.forEach((list, i) => cols.append(el("div", {}, el("h3", { text: details[i].summary ? details[i].summary.name : ids[i] }),
          list.length ? samplesGrid(ids[i], list, 4) : el("p", { class: "muted", text: "no samples" }))));
        body.append(cols);
      });
    },
  };
}

// ---- dataset check ------------------------------------------------------------------------------------

function datasetView() {
  let epoch = 0;
  const head = el("div", { class: "row" });
  const problems = section("dataset-problems", "Problems");
  const subsets = section("dataset-subsets", "Subsets: training and regularization");
  const buckets = section("dataset-buckets", "Buckets");
  const root = el("div", {}, el("h1", { text: "Dataset check" }), head, problems.node, subsets.node, buckets.node);
  let view;
  async function load(query) {
    const d = await getJSON(`/api/dataset?epoch=${epoch}${query || ""}`);
    head.replaceChildren(el("span", { class: "muted", text: `${d.source}: ${d.images.length} images; captions as training sees them in epoch ${d.epoch} (seed ${d.seed})` }),
      el("button", { id: "reshuffle", onclick: () => { epoch += 1; load(); } }, "Reshuffle (next epoch)"),
      el("button", { onclick: () => load("&rescan=1") }, "Rescan folder"));
    problems.update(d.problems, (body, list) => {
      body.append(list.length ? el("ul", { class: "problems" }, list.map((p) => el("li", { class: p.includes("will be upscaled") ? "warn" : "error", text: p })))
        : el("p", { class: "muted", text: "No problems found." }));
    });
    subsets.update(d.subsets, (body, list) => body.append(el("table", {}, el("thead", {}, el("tr", {}, ["subset", "kind", "images", "used", "samples / epoch", "repeats", "shuffle", "keep_tokens"].map((h) => el("th", { text: h })))),
      el("tbody", {}, list.map((s) => el("tr", {}, el("td", { text: s.where }), el("td", {}, s.is_reg ? el("span", { class: "tag reg", text: "regularization" }) : el("span", { class: "tag", text: "training" })),
        el("td", { class: "num", text: s.images }), el("td", { class: "num", text: s.used }), el("td", { class: "num", text: s.samples }),
        el("td", { class: "num", text: s.num_repeats }), el("td", { text: s.shuffle_caption ? "yes" : "no" }), el("td", { class: "num", text: s.keep_tokens })))))));
    buckets.update({ datasets: d.datasets, images: d.images }, (body, { datasets, images }) => {
      for (const ds of datasets) {
        body.append(el("h3", { text: `${ds.where} (${ds.method}, resolution ${ds.resolution.join("x")}, batch ${ds.batch_size})` }));
        for (const b of ds.buckets) {
          body.append(el("div", { class: "bucket", "data-bucket": b.size.join("x") },
            el("h4", { text: `${b.size[0]} x ${b.size[1]}: ${b.images.length} images, ${b.samples} samples per epoch` }),
            el("div", { class: "grid" }, b.images.map((n) => {
              const im = images[n];
              return el("figure", {}, el("img", { src: `/api/dataset/image/${n}`, loading: "lazy", alt: im.name }),
                im.mask ? el("img", { class: "mask", src: `/api/dataset/mask/${n}`, loading: "lazy", alt: `mask of ${im.name}` }) : null,
                el("figcaption", {}, el("div", {}, el("b", { text: im.name }), im.is_reg ? el("span", { class: "tag reg", text: "reg" }) : null,
                  el("span", { class: "muted", text: `  ${im.size.join("x")} ×${im.repeats}` })),
                  el("div", { class: "caption", text: im.caption ?? "" }),
                  im.problems.map((p) => el("div", { class: "warn", text: p }))));
            }))));
        }
      }
      const left = images.filter((im) => !im.used);
      if (left.length) {
        body.append(el("h3", { text: `Not used in training (${left.length})` }), el("ul", { class: "problems" },
          left.map((im) => el("li", { text: `${im.path}: ${im.problems.join("; ") || "left out by regularization balancing"}` }))));
      }
    });
  }
  view = { root, refresh: async () => {}, load };
  return view;
}

// ---- router -------------------------------------------------------------------------------------------

async function route() {
  const hash = decodeURIComponent(location.hash.slice(1)) || "/";
  const [, page, arg] = hash.match(/^\/([^/]*)\/?(.*)$/) || [];
  let view;
  if (page === "run" && arg) { view = runView(arg); }
  else if (page === "compare") { view = compareView(arg ? arg.split(",").filter(Boolean) : []); }
  else if (page === "dataset") { view = datasetView(); }
  else { view = runsView(); }
  for (const link of document.querySelectorAll("header nav a")) { link.classList.toggle("active", link.getAttribute("href") === `#/${page || ""}`); }
  current = view;
  document.getElementById("view").replaceChildren(view.root);
  try {
    if (view.load) { await view.load(); }
    await view.refresh();
  } catch (e) { view.root.prepend(el("p", { class: "error", text: String(e) })); }
}

let polling = false;  // one refresh at a time: a slow answer must not pile requests up

async function poll() {
  const live = document.getElementById("live");
  if (polling) { return; }
  polling = true;
  try {
    if (current) { await current.refresh(); }
    live.classList.remove("stale"); live.textContent = "live";
  } catch (e) { live.classList.add("stale"); live.textContent = "server unreachable"; }
  polling = false;
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  try {
    const info = await getJSON("/api/info");
    document.getElementById("nav-dataset").hidden = !info.dataset;
    document.getElementById("nav-new").hidden = !info.training;
    if (info.dataset && !location.hash) { location.hash = "#/dataset"; }
  } catch (e) { /* the runs view shows the error */ }
  await route();
  setInterval(poll, POLL_MS);
});
