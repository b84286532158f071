// Linked machines from GET /v1/me/providers (one request per refresh, at most every 10 s while the
// tab is visible), and unlink (DELETE /v1/me/providers/{id}). A machine serving other weights than the
// catalog pins says so per model, with the network's hash from GET /v1/models/catalog (asked once,
// only when some machine needs it).
import { api } from "./api.js";
import { errorBlock } from "./errors.js";
import { ago, when } from "./format.js";
import { h, poll, requireSession, setStatus } from "./layout.js";

const POLL_MS = 10_000;
const list = document.getElementById("machine-list");
const status = document.getElementById("machines-status");
const updated = document.getElementById("machines-updated");
const dialog = document.getElementById("unlink-dialog");

let lastJson = null;
let poller = null;
let pinned = null;  // model id → the catalog's weight_hash, once asked

const TRUST = {
  hardware: "Hardware-verified",
  self_signed: "Self-signed",
  none: "Not verified",
  untrusted: "Failed a check",
};

if (requireSession()) poller = poll(refresh, POLL_MS);

async function refresh() {
  try {
    const listing = await api("/v1/me/providers");
    updated.textContent = "Updated " + new Date().toLocaleTimeString() + " · refreshes every 10 s";
    const json = JSON.stringify(listing.data);
    if (json !== lastJson) {
      if (!pinned && listing.data.some((m) => m.unverified_models && m.unverified_models.length)) {
        pinned = await pinnedHashes();
      }
      lastJson = json;
      render(listing.data);
    }
    setStatus(status, "");
  } catch (error) {
    setStatus(status, errorBlock(error), "error");
  }
}

function render(machines) {
  const focused = document.activeElement && document.activeElement.dataset.machine;
  if (!machines.length) {
    list.replaceChildren(h("li", { class: "empty card" },
      h("p", {}, h("strong", {}, "No machines linked yet.")),
      h("p", {}, "Link your own computer and chat on it for free — follow the steps below.")));
    return;
  }
  list.replaceChildren(...machines.map(machineCard));
  if (focused) {
    const again = list.querySelector(`[data-machine="${CSS.escape(focused)}"]`);
    if (again) again.focus();
  }
}

function machineCard(m) {
  return h("li", { class: "machine card", dataset: { id: m.id, online: String(m.online) } },
    h("div", { class: "machine-head" },
      h("h2", { class: "machine-name" }, m.name || m.id),
      h("span", { class: "pill " + (m.online ? "online" : "offline") }, m.online ? "Online" : "Offline")),
    h("p", { class: "machine-id" }, h("code", {}, m.id)),
    h("dl", { class: "facts" },
      fact("Models", m.models && m.models.length ? m.models.join(", ") : "none advertised"),
      fact("Trust", TRUST[m.trust_level] || m.trust_level || "unknown"),
      fact("Serves", m.private_only ? "Only you (private)" : "You first, and the network"),
      fact("Last seen", m.online ? "now" : h("time", { title: when(m.last_seen) }, ago(m.last_seen)))),
    ...(m.unverified_models || []).map((id) => h("p", { class: "machine-note unverified", dataset: { model: id } },
      unverifiedSentence(id))),
    h("div", { class: "machine-actions" },
      h("button", { type: "button", class: "button danger-outline", dataset: { machine: m.id },
        "aria-label": `Unlink ${m.name || m.id}`, onclick: (e) => confirmUnlink(m, e.currentTarget) }, "Unlink")));
}

function unverifiedSentence(id) {
  const hash = pinned && pinned[id];
  const network = hash ? ` (${hash.replace(":", " ").slice(0, 19)}…)` : "";
  return `${id}: this machine's weights differ from the network's${network}, so it serves only your own ` +
    "requests for it and earns nothing.";
}

async function pinnedHashes() {
  try {
    const catalog = await api("/v1/models/catalog");
    const found = {};
    for (const model of catalog.data) {
      if (!model.weight_hash) continue;
      for (const name of [model.id, ...(model.aliases || [])]) found[name] = model.weight_hash;
    }
    return found;
  } catch {
    return null;  // the sentence without the hash
  }
}

function fact(term, value) {
  return [h("dt", {}, term), h("dd", {}, value)];
}

function confirmUnlink(machine, opener) {
  document.getElementById("unlink-text").textContent =
    `${machine.name || machine.id} will no longer be yours: its device token is revoked and it disconnects once ` +
    "its current requests finish. Run `darkbloom login` on it to link it again.";
  dialog.returnValue = "";
  dialog.onclose = async () => {
    if (dialog.returnValue !== "confirm") { opener.focus(); return; }
    try {
      await api(`/v1/me/providers/${encodeURIComponent(machine.id)}`, { method: "DELETE" });
      setStatus(status, `Unlinked ${machine.name || machine.id}.`, "ok");
      lastJson = null;
      await poller.now();
      document.querySelector(".page-head .button").focus();
    } catch (error) {
      setStatus(status, errorBlock(error), "error");
    }
  };
  dialog.showModal();
}
