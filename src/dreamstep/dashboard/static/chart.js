// Line charts on a plain <canvas>: any number of series on a left axis and an optional right axis.
// drawChart(canvas, {series: [{x, y, color, width, axis: "left"|"right", dash, label}], yLabel, y2Label})
"use strict";

function niceTicks(lo, hi, count, integer) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count;
  const magnitude = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => s >= raw) || raw;
  if (integer) { step = Math.max(1, Math.round(step)); }
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) { ticks.push(t); }
  return ticks;
}

function formatNumber(v) {
  if (v === 0) { return "0"; }
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) { return v.toExponential(1); }
  return String(Number(v.toPrecision(4)));
}

// Labels for evenly spaced ticks: the fewest digits that write every tick exactly, in one notation on the whole
// axis, so neighbouring ticks never read alike (0.1234 and 0.1235, not 0.123 twice).
function tickLabels(ticks) {
  if (ticks.length < 2) { return ticks.map(formatNumber); }
  const step = Math.abs(ticks[1] - ticks[0]);
  const largest = Math.max(...ticks.map(Math.abs));
  const write = largest >= 1e5 || largest < 1e-3 ? (t, d) => (t === 0 ? "0" : t.toExponential(d)) : (t, d) => t.toFixed(d);
  for (let digits = 0; digits < 12; digits++) {
    const labels = ticks.map((t) => write(t, digits));
    if (labels.every((label, i) => Math.abs(Number(label) - ticks[i]) <= step * 1e-6)) { return labels; }
  }
  return ticks.map((t) => write(t, 12));
}

function range(series) {
  let lo = Infinity, hi = -Infinity;
  for (const s of series) {
    for (const v of s.y) { if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }
  }
  if (lo === Infinity) { return null; }
  // A constant (a fixed learning rate) is drawn against zero, not zoomed into a band around itself.
  if (hi - lo <= Math.abs(hi) * 1e-9) { return lo > 0 ? [0, hi * 1.5] : lo < 0 ? [lo * 1.5, 0] : [-1, 1]; }
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

function drawChart(canvas, spec) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600, height = canvas.clientHeight || 300;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  const series = spec.series.filter((s) => s.x.length > 0);
  const left = series.filter((s) => s.axis !== "right"), right = series.filter((s) => s.axis === "right");
  const m = { left: 58, right: right.length ? 62 : 16, top: 12, bottom: 30 };
  const pw = width - m.left - m.right, ph = height - m.top - m.bottom;
  let points = 0;
  if (!series.length) {
    ctx.fillStyle = "#6b7280";
    ctx.fillText(spec.empty || "no data yet", m.left + 8, m.top + 20);
    canvas.dataset.points = "0";
    return 0;
  }
  let xlo = Infinity, xhi = -Infinity;
  for (const s of series) { xlo = Math.min(xlo, s.x[0]); xhi = Math.max(xhi, s.x[s.x.length - 1]); }
  if (xhi <= xlo) { xhi = xlo + 1; }
  const px = (x) => m.left + (x - xlo) / (xhi - xlo) * pw;
  const yl = range(left), yr = range(right);
  const py = (y, r) => m.top + (1 - (y - r[0]) / (r[1] - r[0])) * ph;
  // grid and axes
  ctx.strokeStyle = "#e3e6ec"; ctx.fillStyle = "#6b7280"; ctx.lineWidth = 1;
  ctx.textAlign = "center";
  const xTicks = niceTicks(xlo, xhi, 6, true);  // steps are whole numbers
  tickLabels(xTicks).forEach((label, i) => {
    const x = px(xTicks[i]);
    ctx.beginPath(); ctx.moveTo(x, m.top); ctx.lineTo(x, m.top + ph); ctx.stroke();
    ctx.fillText(label, x, height - 12);
  });
  if (yl) {
    ctx.textAlign = "right";
    const ticks = niceTicks(yl[0], yl[1], 5);
    tickLabels(ticks).forEach((label, i) => {
      const y = py(ticks[i], yl);
      ctx.beginPath(); ctx.moveTo(m.left, y); ctx.lineTo(m.left + pw, y); ctx.stroke();
      ctx.fillText(label, m.left - 6, y + 4);
    });
  }
  if (yr) {
    ctx.textAlign = "left";
    const ticks = niceTicks(yr[0], yr[1], 5);
    tickLabels(ticks).forEach((label, i) => ctx.fillText(label, m.left + pw + 6, py(ticks[i], yr) + 4));
  }
  ctx.strokeStyle = "#9aa3b2";
  ctx.strokeRect(m.left, m.top, pw, ph);
  ctx.textAlign = "left";
  if (spec.yLabel) { ctx.fillText(spec.yLabel, 4, m.top + 8); }
  if (spec.y2Label && yr) { ctx.textAlign = "right"; ctx.fillText(spec.y2Label, width - 4, m.top + 8); }
  ctx.textAlign = "right"; ctx.fillText("step", m.left + pw, height - 1);
  // series
  ctx.save();
  ctx.beginPath(); ctx.rect(m.left, m.top, pw, ph); ctx.clip();
  for (const s of series) {
    const r = s.axis === "right" ? yr : yl;
    ctx.strokeStyle = s.color; ctx.lineWidth = s.width || 1.5;
    ctx.setLineDash(s.dash || []);
    ctx.beginPath();
    let started = false;
    for (let i = 0; i < s.x.length; i++) {
      if (!Number.isFinite(s.y[i])) { started = false; continue; }
      const x = px(s.x[i]), y = py(s.y[i], r);
      if (started) { ctx.lineTo(x, y); } else { ctx.moveTo(x, y); started = true; }
      points++;
    }
    if (s.x.length === 1) { ctx.arc(px(s.x[0]), py(s.y[0], r), 2.5, 0, 2 * Math.PI); }
    ctx.stroke();
  }
  ctx.restore();
  canvas.dataset.points = String(points);
  return points;
}

function legend(items) {
  const div = document.createElement("div");
  div.className = "legend";
  for (const item of items) {
    const span = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = item.color;
    span.append(swatch, item.label);
    div.append(span);
  }
  return div;
}

window.drawChart = drawChart;
window.tickLabels = tickLabels;
window.niceTicks = niceTicks;
window.chartLegend = legend;
