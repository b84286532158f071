// Batches (docs/batches.md): the caller's batches from GET /v1/batches?limit=100 (newest first), each
// with its progress — answered and failed lines of the total, as a two-colour bar and a sentence —,
// where it runs (darkbloom_route), what its lines cost so far, Cancel while it is validating or in
// progress (POST /v1/batches/{id}/cancel, after a confirmation), and its result and error files
// (GET /v1/files/{id}/content, fetched with the session's Authorization header — a plain link could
// not send it — and saved from a Blob). While any batch is open the list is asked for again every
// 2 s (only while the tab is visible, never two at once); once every batch has ended it stops. The
// page does not create batches: that is the API's (the OpenAI SDK's files.create, batches.create).
import { api, errorFrom, send } from "./api.js";
import { errorBlock, withCode } from "./errors.js";
import { count, usd, when } from "./format.js";
import { h, poll, requireSession, setStatus } from "./layout.js";

const REFRESH_MS = 2_000;
const OPEN = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const CANCELLABLE = new Set(["validating", "in_progress"]);
const STATUS = {
  validating: "Validating", in_progress: "In progress", finalizing: "Finalizing", completed: "Completed",
  failed: "Failed", expired: "Expired", cancelling: "Cancelling", cancelled: "Cancelled",
};
// where its lines run (docs/batches.md "What runs where")
const ROUTES = {
  self: "My machines (free)",
  shared: "Shared machines",
  prefer: "My machines, then the network",
  fleet: "The network (batch price)",
};
// what a status means for the person looking at it, when the bar alone does not say
const NOTES = {
  validating: "Waiting for its first lines to start.",
  finalizing: "Every line has ended: its result files are being written.",
  cancelling: "Lines already running on a machine finish; the others will not run.",
  cancelled: "Cancelled: the lines that never ran are counted as failed, with the code `batch_cancelled` in its error file.",
  expired: "Its 24 hours ended first: the lines that never ran are counted as failed, with the code `batch_expired` in its error file.",
};
const ENDED = { completed: ["Completed", "completed_at"], failed: ["Failed", "failed_at"],
  expired: ["Expired", "expired_at"], cancelled: ["Cancelled", "cancelled_at"] };

const list = document.getElementById("batch-list");
const status = document.getElementById("batches-status");
const updated = document.getElementById("batches-updated");
const dialog = document.getElementById("cancel-dialog");

let poller = null;
let lastJson = null;
let listingFailed = false;          // the status line holds the listing's error (cleared once it reads again)
const busy = new Set();             // "cancel:<batch id>" or "file:<file id>" while its request runs

if (requireSession()) poller = poll(refresh, REFRESH_MS);

async function refresh() {
  let listing;
  try {
    listing = await api("/v1/batches?limit=100");
  } catch (error) {
    listingFailed = true;
    setStatus(status, errorBlock(error), "error");
    return;  // tried again at the next refresh
  }
  if (listingFailed) {
    listingFailed = false;
    setStatus(status, "");
  }
  const open = listing.data.some((batch) => OPEN.has(batch.status));
  updated.textContent = "Updated " + new Date().toLocaleTimeString() +
    (open ? " · refreshes every 2 s while a batch runs" : listing.data.length ? " · every batch has ended" : "");
  const json = JSON.stringify(listing.data);
  if (json !== lastJson) {
    lastJson = json;
    render(listing.data);
  }
  if (!open && poller) {
    poller.stop();  // nothing left to change; a cancel (or a reload) asks again
    poller = null;
  }
}

/** The list asked for now (and polled again while a batch is open). */
async function refreshNow() {
  if (poller) await poller.now();
  else poller = poll(refresh, REFRESH_MS);
}

function render(batches) {
  const active = document.activeElement;
  const focused = active && active.dataset && active.dataset.action ? active.dataset.action : null;
  if (!batches.length) {
    list.replaceChildren(h("li", { class: "empty card" },
      h("p", {}, h("strong", {}, "No batches yet.")),
      h("p", {}, withCode("A batch runs many requests from one JSONL file at the lowest priority: free on your own " +
        "machines, or on the network at the batch price. This page doesn't create them — upload the file and " +
        "create the batch from code with any OpenAI SDK (`files.create`, then `batches.create`); " +
        "`docs/batches.md` has a full example."))));
    return;
  }
  list.replaceChildren(...batches.map(batchCard));
  if (focused) {
    const again = list.querySelector(`[data-action="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
}

function batchCard(batch) {
  const metadata = Object.entries(batch.metadata || {});
  const ended = ENDED[batch.status];
  const note = NOTES[batch.status];
  return h("li", { class: "batch card", dataset: { id: batch.id, status: batch.status } },
    h("div", { class: "batch-head" },
      h("h2", { class: "batch-name", tabindex: "-1", dataset: { action: "title:" + batch.id } },
        h("code", {}, batch.id)),
      h("span", { class: "badge batch-status is-" + batch.status }, STATUS[batch.status] || batch.status)),
    metadata.length ? h("ul", { class: "batch-meta", "aria-label": "Metadata" },
      metadata.map(([key, value]) => h("li", {}, `${key}: ${value}`))) : null,
    progress(batch),
    note ? h("p", { class: "batch-note" }, withCode(note)) : null,
    h("dl", { class: "facts" },
      fact("Runs on", h("span", { class: "batch-route" }, ROUTES[batch.darkbloom_route] || batch.darkbloom_route)),
      fact(ended ? "Cost" : "Cost so far", h("span", { class: "batch-cost" }, usd(batch.cost_micro_usd))),
      fact("Endpoint", h("code", {}, batch.endpoint)),
      fact("Created", when(batch.created_at)),
      ended ? fact(ended[0], when(batch[ended[1]])) : fact("Expires", when(batch.expires_at))),
    actions(batch));
}

function progress(batch) {
  const { total, completed, failed } = batch.request_counts;
  const text = `${count(completed)} done · ${count(failed)} failed · ${count(total)} total`;
  const bar = h("div", { class: "batch-bar", role: "progressbar", "aria-label": "Lines ended",
    "aria-valuemin": 0, "aria-valuemax": total, "aria-valuenow": completed + failed, "aria-valuetext": text },
  segment("done", completed, total), segment("failed", failed, total));
  return h("div", { class: "batch-progress" }, bar,
    h("p", { class: "batch-counts" },
      h("span", { class: "swatch s-done", "aria-hidden": "true" }), `${count(completed)} done · `,
      h("span", { class: "swatch s-failed", "aria-hidden": "true" }), `${count(failed)} failed · `,
      `${count(total)} total`));
}

function segment(kind, n, total) {
  const el = h("span", { class: "s-" + kind });
  el.style.width = total ? `${(100 * Math.min(n, total)) / total}%` : "0%";  // CSSOM: allowed by the CSP
  return el;
}

function actions(batch) {
  const buttons = [];
  if (CANCELLABLE.has(batch.status)) {
    buttons.push(h("button", { type: "button", class: "button danger-outline", dataset: { action: "cancel:" + batch.id },
      "aria-label": `Cancel batch ${batch.id}`, disabled: busy.has("cancel:" + batch.id),
      onclick: () => confirmCancel(batch) }, "Cancel"));
  }
  for (const [field, label, words] of [["output_file_id", "Download results", "results"],
    ["error_file_id", "Download errors", "errors"]]) {
    const fileId = batch[field];
    if (!fileId) continue;
    buttons.push(h("button", { type: "button", class: "button", dataset: { action: `${words}:${batch.id}` },
      "aria-label": `Download the ${words} of batch ${batch.id}`, disabled: busy.has("file:" + fileId),
      onclick: (e) => download(fileId, e.currentTarget) }, label));
  }
  return buttons.length ? h("div", { class: "batch-actions" }, buttons) : null;
}

function fact(term, value) {
  return [h("dt", {}, term), h("dd", {}, value)];
}

function focusAction(action) {
  const target = list.querySelector(`[data-action="${CSS.escape(action)}"]`);
  if (target) target.focus();
  return Boolean(target);
}

// Cancel: lines already running finish (and are charged as answered); the rest never run

function confirmCancel(batch) {
  const { total, completed, failed } = batch.request_counts;
  const left = Math.max(0, total - completed - failed);
  document.getElementById("cancel-text").textContent =
    `${batch.id}: lines already running on a machine finish and are charged as answered; the others of its ` +
    `${count(left)} unfinished line${left === 1 ? "" : "s"} never run and go to its error file. A batch can't ` +
    "be restarted.";
  dialog.returnValue = "";
  dialog.onclose = async () => {
    if (dialog.returnValue !== "confirm") {
      focusAction("cancel:" + batch.id) || focusAction("title:" + batch.id);
      return;
    }
    await cancel(batch);
  };
  dialog.showModal();
}

async function cancel(batch) {
  const key = "cancel:" + batch.id;
  busy.add(key);
  const button = list.querySelector(`[data-action="${CSS.escape(key)}"]`);
  if (button) button.disabled = true;
  try {
    await api(`/v1/batches/${encodeURIComponent(batch.id)}/cancel`, { method: "POST" });
    setStatus(status, h("span", {}, "Cancelling ", h("code", {}, batch.id),
      ": lines already running finish, the others won't run."), "ok");
  } catch (error) {
    setStatus(status, errorBlock(error), "error");  // 409: it ended (or began finalizing) meanwhile
  } finally {
    busy.delete(key);
    listingFailed = false;
    lastJson = null;
  }
  await refreshNow();
  focusAction(key) || focusAction("title:" + batch.id);
}

// Downloads: the file's bytes with the session's Authorization header, saved from a Blob

async function download(fileId, button) {
  const key = "file:" + fileId;
  busy.add(key);
  button.disabled = true;
  try {
    const response = await send(`/v1/files/${encodeURIComponent(fileId)}/content`,
      { headers: { Accept: "application/jsonl, application/octet-stream" } });
    if (!response.ok) throw await errorFrom(response);
    const blob = await response.blob();
    const named = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
    const filename = named ? named[1] : `${fileId}.jsonl`;
    const url = URL.createObjectURL(blob);
    const link = h("a", { href: url, download: filename, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
    setStatus(status, h("span", {}, "Saved ", h("code", {}, filename), "."), "ok");  // a long name wraps
  } catch (error) {
    setStatus(status, errorBlock(error), "error");
  } finally {
    busy.delete(key);
    const again = list.querySelector(`[data-action="${CSS.escape(button.dataset.action)}"]`);
    if (again) again.disabled = false;
    button.disabled = false;
  }
}
