// Usage & billing: balance and withdrawable, usage rows (free rows your machine or a share served
// marked) and provider earnings — one request each, plus one per "Load more". Spend and tokens per
// day for the last 30 days (GET /v1/payments/usage/daily) as charts with tables, and the rows as a
// CSV file (GET /v1/payments/usage.csv, fetched with the session's Authorization header, saved as a Blob).
import { api, errorFrom, send } from "./api.js";
import { barChart } from "./charts.js";
import { errorBlock } from "./errors.js";
import { count, usd, when } from "./format.js";
import { h, requireSession, setStatus } from "./layout.js";

const PAGE = 25;
const DAYS = 30;  // the charts of usage per day
const status = document.getElementById("usage-status");
const usageRows = document.getElementById("usage-rows");
const earningsRows = document.getElementById("earnings-rows");
const usageMore = document.getElementById("usage-more");
const earningsMore = document.getElementById("earnings-more");
let usageCursor = null;
let earningsCursor = null;

if (requireSession()) {
  usageMore.addEventListener("click", () => loadUsage(usageCursor));
  earningsMore.addEventListener("click", () => loadEarnings(earningsCursor));
  document.getElementById("usage-csv").addEventListener("click", downloadCsv);
  Promise.all([loadBalance(), loadDaily(), loadUsage(null), loadEarnings(null)]);
}

function showError(error) {
  setStatus(status, errorBlock(error), "error");
}

async function loadBalance() {
  try {
    const balance = await api("/v1/payments/balance");
    document.getElementById("balance").textContent = usd(balance.balance_micro_usd);
    document.getElementById("withdrawable").textContent = usd(balance.withdrawable_micro_usd);
  } catch (error) { showError(error); }
}

function query(cursor) {
  return `?limit=${PAGE}` + (cursor ? "&cursor=" + encodeURIComponent(cursor) : "");
}

async function loadUsage(cursor) {
  try {
    const page = await api("/v1/payments/usage" + query(cursor));
    if (!cursor) usageRows.replaceChildren();
    usageRows.append(...page.data.map(usageRow));
    if (!usageRows.children.length) usageRows.append(emptyRow(5, "No requests yet — try the Chat page."));
    usageCursor = page.next_cursor;
    usageMore.hidden = !usageCursor;
  } catch (error) { showError(error); }
}

async function loadEarnings(cursor) {
  try {
    const page = await api("/v1/provider/earnings" + query(cursor));
    document.getElementById("earned").textContent = usd(page.total_micro_usd);
    if (!cursor) earningsRows.replaceChildren();
    earningsRows.append(...page.data.map(earningRow));
    if (!earningsRows.children.length) {
      earningsRows.append(emptyRow(4, "No earnings yet — your machines earn when they serve other people's requests."));
    }
    earningsCursor = page.next_cursor;
    earningsMore.hidden = !earningsCursor;
  } catch (error) { showError(error); }
}

function emptyRow(span, text) {
  return h("tr", { class: "empty" }, h("td", { colspan: span }, text));
}

function cell(label, ...content) {
  return h("td", { "data-label": label }, ...content);
}

function usageRow(r) {
  const free = (r.self_routed || r.routed === "shared") && r.cost_micro_usd === 0;
  const where = { owned: "your machine", shared: "shared machine" }[r.routed];
  const served = where
    ? h("span", { class: "badge " + (free ? "free" : "charged") }, free ? where + " · free" : where)
    : h("span", { class: "badge network" }, "the network");
  return h("tr", { class: free ? "free-row" : null, dataset: { request: r.request_id, selfRouted: String(r.self_routed) } },
    cell("When", h("time", { title: r.request_id }, when(r.created_at))),
    cell("Model", r.model),
    cell("Tokens in / out", `${count(r.prompt_tokens)} / ${count(r.completion_tokens)}`),
    cell("Served by", served),
    h("td", { class: "num", "data-label": "Cost" }, free ? "Free" : usd(r.cost_micro_usd)));
}

function earningRow(r) {
  return h("tr", { dataset: { request: r.request_id } },
    cell("When", h("time", { title: r.request_id }, when(r.created_at))),
    cell("Model", r.model),
    cell("Tokens in / out", `${count(r.prompt_tokens)} / ${count(r.completion_tokens)}`),
    h("td", { class: "num", "data-label": "Payout" }, usd(r.payout_micro_usd)));
}


async function loadDaily() {
  try {
    const daily = await api(`/v1/payments/usage/daily?days=${DAYS}`);
    const rows = daily.data.map((d) => {
      const date = new Date(d.date + "T00:00:00Z");
      return { label: date.toLocaleDateString([], { month: "short", day: "numeric", timeZone: "UTC" }),
        title: date.toLocaleDateString([], { weekday: "short", month: "short", day: "numeric", timeZone: "UTC" }), values: d };
    });
    const spent = daily.data.reduce((sum, d) => sum + d.cost_micro_usd, 0);
    const tokens = daily.data.reduce((sum, d) => sum + d.prompt_tokens + d.completion_tokens, 0);
    const requests = daily.data.reduce((sum, d) => sum + d.requests, 0);
    document.getElementById("usage-charts").replaceChildren(
      barChart({ id: "spend-chart", caption: "Spend per day", columnLabel: "Day (UTC)", rows,
        series: [{ key: "cost_micro_usd", label: "Spend", cls: "s-spend" }], format: usd,
        summary: `${usd(spent)} over ${count(requests)} requests in the last ${DAYS} days.` }),
      barChart({ id: "tokens-chart", caption: "Tokens per day", columnLabel: "Day (UTC)", rows,
        series: [{ key: "prompt_tokens", label: "Tokens in", cls: "s-in" },
          { key: "completion_tokens", label: "Tokens out", cls: "s-out" }],
        format: (n) => count(Math.round(n)),
        summary: `${count(tokens)} tokens in the last ${DAYS} days.` }));
  } catch (error) { showError(error); }
}

async function downloadCsv(event) {
  const button = event.currentTarget;
  button.disabled = true;
  try {
    const response = await send("/v1/payments/usage.csv", { headers: { Accept: "text/csv" } });
    if (!response.ok) throw await errorFrom(response);
    const blob = await response.blob();
    const url = URL.createObjectURL(blob);
    const link = h("a", { href: url, download: `darkbloom-usage-${new Date().toISOString().slice(0, 10)}.csv`, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
    setStatus(status, "Your usage was saved as a CSV file.", "ok");
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}
