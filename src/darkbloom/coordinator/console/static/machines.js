// Linked machines from GET /v1/me/providers (one request per refresh, at most every 10 s while the
// tab is visible), and unlink (DELETE /v1/me/providers/{id}). A machine serving other weights than the
// catalog pins says so per model, with the network's hash from GET /v1/models/catalog (asked once,
// only when some machine needs it). Each card shows the machine's last 24 h from
// GET /v1/me/providers/{id}/stats (asked at most once a minute per machine): requests per hour by
// who sent them, its earnings, and in sentences why public requests went to other machines. An online
// machine says where it runs its models ("Runs on: Metal GPU (llama.cpp)").
import { api } from "./api.js";
import { barChart } from "./charts.js";
import { errorBlock } from "./errors.js";
import { ago, count, usd, when } from "./format.js";
import { h, poll, requireSession, setStatus } from "./layout.js";

const POLL_MS = 10_000;
const STATS_MS = 60_000;
const HOURS = 24;
const list = document.getElementById("machine-list");
const status = document.getElementById("machines-status");
const updated = document.getElementById("machines-updated");
const dialog = document.getElementById("unlink-dialog");

let lastJson = null;
let poller = null;
let pinned = null;  // model id → the catalog's weight_hash, once asked
const stats = new Map();  // machine id → {at, data | error}

// where a machine runs its models (its `device` and `backend`), for "Runs on"
const DEVICES = {
  cpu: "CPU", metal: "Metal GPU", cuda: "CUDA GPU", rocm: "ROCm GPU", vulkan: "Vulkan GPU", sycl: "SYCL GPU", gpu: "GPU",
};
const MLX_DEVICES = { metal: "Apple M-series GPU" };  // MLX's GPU is Apple silicon's
const BACKENDS = { "llama-cpp": "llama.cpp", mlx: "MLX" };

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
    await refreshStats(listing.data);
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
      ...(m.online && (m.device || m.backend) ? [fact("Runs on", runsOn(m))] : []),
      fact("Last seen", m.online ? "now" : h("time", { title: when(m.last_seen) }, ago(m.last_seen)))),
    ...(m.unverified_models || []).map((id) => h("p", { class: "machine-note unverified", dataset: { model: id } },
      unverifiedSentence(id))),
    h("div", { class: "machine-insight", dataset: { insight: m.id } }, insight(m.id)),
    h("div", { class: "machine-actions" },
      h("button", { type: "button", class: "button danger-outline", dataset: { machine: m.id },
        "aria-label": `Unlink ${m.name || m.id}`, onclick: (e) => confirmUnlink(m, e.currentTarget) }, "Unlink")));
}

function runsOn(m) {
  if (m.backend === "openai") return "an OpenAI-compatible server";
  const devices = m.backend === "mlx" ? { ...DEVICES, ...MLX_DEVICES } : DEVICES;
  const device = m.device ? named(devices, m.device) : "an unknown device";
  return m.backend ? `${named(BACKENDS, m.backend)} · ${device}` : device;
}

function named(names, key) {
  return Object.hasOwn(names, key) ? names[key] : key;  // a node's own word for what the table lacks
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

// --- the last 24 h of each machine ---

const SERIES = [
  { key: "owned", label: "Your requests", cls: "s-owned" },
  { key: "shared", label: "Shared with you", cls: "s-shared" },
  { key: "fleet", label: "The network", cls: "s-fleet" },
];

// one sentence per reason a public request went elsewhere; n is always more than zero
const REASONS = {
  busy: (n) => `Your machine was busy for ${requests(n)}.`,
  challenge_stale: (n) => `${cap(requests(n))} went to machines with a fresher attestation.`,
  trust_floor: (n) => `${cap(requests(n))} went to other machines because its trust level is below what the network requires.`,
  private_only: (n) => `${cap(requests(n))} went to other machines because it serves only you (private).`,
  runtime_unverified: (n) => `${cap(requests(n))} went to other machines because it does not run a verified Darkbloom release.`,
  unverified_weights: (n) => `${cap(requests(n))} went to other machines because its weights differ from the network's.`,
  capability: (n) => `${cap(requests(n))} needed something it does not offer (tools, structured output or images).`,
  context_length: (n) => `${cap(requests(n))} were longer than its context window.`,
  another_machine_chosen: (n) => `${cap(requests(n))} went to machines ranked ahead of it (model already loaded, less busy or faster).`,
};

function requests(n) {
  return `${count(n)} public request${n === 1 ? "" : "s"}`;
}

function cap(text) {
  return text[0].toUpperCase() + text.slice(1);
}

export function passedOverSentences(passed) {
  return Object.entries(REASONS).filter(([key]) => passed[key] > 0).map(([key, say]) => say(passed[key]));
}

async function refreshStats(machines) {
  const now = Date.now();
  await Promise.all(machines.map(async (m) => {
    const known = stats.get(m.id);
    if (known && now - known.at < STATS_MS) return;
    try {
      stats.set(m.id, { at: now, data: await api(`/v1/me/providers/${encodeURIComponent(m.id)}/stats?hours=${HOURS}`) });
    } catch (error) {
      stats.set(m.id, { at: now, error });
    }
    const box = list.querySelector(`[data-insight="${CSS.escape(m.id)}"]`);
    if (box) box.replaceChildren(...[insight(m.id)].flat());
  }));
}

function insight(id) {
  const known = stats.get(id);
  if (!known) return h("p", { class: "hint" }, "Loading the last 24 hours…");
  if (known.error) return h("p", { class: "hint" }, "The last 24 hours could not be loaded: " + known.error.message);
  const s = known.data;
  const total = s.requests.owned + s.requests.shared + s.requests.fleet;
  const reasons = passedOverSentences(s.passed_over);
  const rows = s.hourly.map((entry) => {
    const start = new Date(entry.hour * 1000);
    const label = start.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return { label, title: start.toLocaleString([], { weekday: "short", hour: "2-digit", minute: "2-digit" }),
      values: entry };
  });
  return [
    h("h3", {}, "Last 24 hours"),
    h("dl", { class: "insight-facts" },
      fact("Requests", `${count(total)} (${count(s.requests.owned)} yours, ${count(s.requests.shared)} shared, ` +
        `${count(s.requests.fleet)} from the network)`),
      fact("Earned", usd(s.earnings_micro_usd)),
      fact("Busy", s.busy_fraction === null ? "not sampled yet" : `${Math.round(s.busy_fraction * 100)} % of its slots`),
      fact("Speed", s.decode_tps_p50 === null ? "not measured yet" : `${s.decode_tps_p50.toFixed(1)} tokens/s`)),
    barChart({ id: "hours-" + id, caption: "Requests per hour", columnLabel: "Hour", rows, series: SERIES,
      format: (n) => count(Math.round(n)),
      summary: `${count(total)} requests in the last 24 hours, ${count(s.requests.fleet)} of them from the network.` }),
    h("div", { class: "passed-over" },
      h("h4", {}, "Public requests it did not get"),
      ...(reasons.length ? reasons.map((text) => h("p", {}, text))
        : [h("p", { class: "hint" }, "None: it was never passed over in the last 24 hours.")])),
  ];
}
