// Stacked bar charts drawn as SVG by the page itself (no library, works offline). Each chart is a
// <figure>: the SVG (role="img", named by the caption and a one-line summary) and, for screen
// readers and anyone who wants the numbers, a <details> table of the same data.
import { h } from "./layout.js";

const NS = "http://www.w3.org/2000/svg";
const W = 600;
const H = 170;
const PAD = { top: 14, right: 8, bottom: 22, left: 44 };

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  for (const child of children) el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return el;
}

/** A stacked bar chart.
 *  rows: [{label, title?, values: {key: number}}], series: [{key, label, cls}],
 *  format(n) for the axis, tooltips and table; summary: one sentence about the whole chart. */
export function barChart({ id, caption, summary, rows, series, format = String, columnLabel = "" }) {
  const totals = rows.map((r) => series.reduce((sum, s) => sum + (r.values[s.key] || 0), 0));
  const max = Math.max(1, ...totals);
  const plotW = W - PAD.left - PAD.right;
  const plotH = H - PAD.top - PAD.bottom;
  const step = plotW / Math.max(1, rows.length);
  const barW = Math.max(1, step * 0.72);
  const captionId = id + "-caption";
  const summaryId = id + "-summary";
  const chart = svg("svg", { class: "chart-svg", viewBox: `0 0 ${W} ${H}`, role: "img", focusable: "false",
    "aria-labelledby": captionId, "aria-describedby": summaryId });
  for (const fraction of [0, 0.5, 1]) {
    const y = PAD.top + plotH * (1 - fraction);
    chart.append(svg("line", { class: "chart-grid", x1: PAD.left, x2: W - PAD.right, y1: y, y2: y }));
    if (fraction !== 0.5) {
      chart.append(svg("text", { class: "chart-axis", x: PAD.left - 6, y: y + 4, "text-anchor": "end" },
        format(fraction * max)));
    }
  }
  rows.forEach((row, i) => {
    let y = PAD.top + plotH;
    const x = PAD.left + i * step + (step - barW) / 2;
    for (const s of series) {
      const value = row.values[s.key] || 0;
      if (!value) continue;
      const height = (value / max) * plotH;
      y -= height;
      chart.append(svg("rect", { class: "chart-bar " + s.cls, x: x.toFixed(2), y: y.toFixed(2),
        width: barW.toFixed(2), height: height.toFixed(2) },
        svg("title", {}, `${row.title || row.label} · ${s.label}: ${format(value)}`)));
    }
    const tick = i === 0 || i === rows.length - 1 || i === Math.floor(rows.length / 2);
    if (tick) {
      chart.append(svg("text", { class: "chart-axis", x: (x + barW / 2).toFixed(2), y: H - 6,
        "text-anchor": i === 0 ? "start" : i === rows.length - 1 ? "end" : "middle" }, row.label));
    }
  });
  const legend = series.length > 1
    ? h("ul", { class: "chart-legend" }, ...series.map((s) => h("li", {}, h("span", { class: "swatch " + s.cls }), s.label)))
    : null;
  const table = h("table", { class: "chart-table" },
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, columnLabel),
      ...series.map((s) => h("th", { scope: "col", class: "num" }, s.label)))),
    h("tbody", {}, ...rows.filter((_, i) => totals[i] > 0).map((row) => h("tr", {},
      h("th", { scope: "row" }, row.title || row.label),
      ...series.map((s) => h("td", { class: "num" }, format(row.values[s.key] || 0)))))));
  if (!totals.some((t) => t > 0)) {
    table.tBodies[0].append(h("tr", {}, h("td", { colspan: series.length + 1 }, "Nothing yet.")));
  }
  return h("figure", { class: "chart", id },
    h("figcaption", { id: captionId }, caption),
    h("p", { class: "hint chart-summary", id: summaryId }, summary),
    legend, chart,
    h("details", { class: "chart-data" }, h("summary", {}, "Show as a table"), h("div", { class: "table-wrap" }, table)));
}
