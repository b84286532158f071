// Chat: model picker (/v1/models, plus your own machine's models with My Machine; with Shared
// machines, /v1/models as that route sees it: your machines' and those shared with you), the machine
// choice (My Machine / Shared machines / Network), streaming answers over fetch + SSE, rendered as
// safe Markdown, each badged from the response headers.
import { api, errorFrom, send } from "./api.js";
import { errorBlock, sentenceFor } from "./errors.js";
import { h, poll, requireSession } from "./layout.js";
import { renderMarkdown } from "./markdown.js";

const ROUTE_KEY = "darkbloom.route";          // "prefer" | "shared" | "network", per browser
const OLD_MY_MACHINE_KEY = "darkbloom.myMachine"; // the former My Machine switch ("true"/"false")
const MODEL_KEY = "darkbloom.chatModel";
const POLL_MS = 10_000;                       // machine state: at most one poll per 10 s
// The X-Darkbloom-Route header each choice sends (none for Network)
const ROUTE_HEADER = { prefer: "prefer", shared: "shared", network: null };

const modelSelect = document.getElementById("model");
const modelHint = document.getElementById("model-hint");
const routeInputs = [...document.querySelectorAll("input[name=route]")];
const machineState = document.getElementById("machine-state");
const transcript = document.getElementById("transcript");
const emptyState = document.getElementById("empty-state");
const form = document.getElementById("composer");
const prompt = document.getElementById("prompt");
const sendButton = document.getElementById("send");
const stopButton = document.getElementById("stop");
const maxTokens = document.getElementById("max-tokens");

const state = {
  history: [],          // completed turns sent with every request
  publicModels: null,   // ids from GET /v1/models
  ownModels: null,      // ids from GET /v1/me/self-route-models
  sharedModels: null,   // ids from GET /v1/models with X-Darkbloom-Route: shared
  machines: null,       // GET /v1/me/providers
  received: null,       // GET /v1/shares "received" (Shared machines)
  controller: null,     // the answer being streamed
  poller: null,
  modelsError: false,
};

if (requireSession()) start();

/** The machine choice: "prefer" (My Machine), "shared" (Shared machines) or "network". */
function route() {
  const checked = routeInputs.find((input) => input.checked);
  return checked ? checked.value : "network";
}

function savedRoute() {
  const saved = localStorage.getItem(ROUTE_KEY);
  if (saved && Object.hasOwn(ROUTE_HEADER, saved)) return saved;
  return localStorage.getItem(OLD_MY_MACHINE_KEY) === "true" ? "prefer" : "network";
}

function start() {
  const saved = savedRoute();
  for (const input of routeInputs) {
    input.checked = input.value === saved;
    input.addEventListener("change", () => {
      localStorage.setItem(ROUTE_KEY, route());
      localStorage.removeItem(OLD_MY_MACHINE_KEY);
      applyRoute();
    });
  }
  form.addEventListener("submit", (event) => { event.preventDefault(); submit(); });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  stopButton.addEventListener("click", () => state.controller && state.controller.abort());
  document.getElementById("clear-chat").addEventListener("click", () => {
    state.history = [];
    transcript.replaceChildren(emptyState);
    prompt.focus();
  });
  modelSelect.addEventListener("change", () => localStorage.setItem(MODEL_KEY, modelSelect.value));
  loadPublicModels();
  applyRoute();
}

async function loadPublicModels() {
  try {
    const listing = await api("/v1/models");
    state.publicModels = listing.data.map((m) => m.id);
  } catch (error) {
    state.publicModels = [];
    state.modelsError = true;
  }
  renderModels();
}

function applyRoute() {
  if (state.poller) state.poller.stop();
  state.poller = route() === "network" ? null : poll(refreshMachine, POLL_MS);
  renderMachineState();
  renderModels();
}

/** Your machines and their models; with Shared machines, the shares you received and the models
 * your machines and those shared with you serve (GET /v1/models as the shared route sees it). */
async function refreshMachine() {
  const shared = route() === "shared";
  try {
    const [machines, models, shares] = await Promise.all([
      api("/v1/me/providers"),
      shared ? api("/v1/models", { headers: { "X-Darkbloom-Route": "shared" } }) : api("/v1/me/self-route-models"),
      shared ? api("/v1/shares") : null]);
    state.machines = machines.data;
    if (shared) {
      state.sharedModels = models.data.map((m) => m.id);
      state.received = shares.received;
    } else {
      state.ownModels = models.models;
    }
  } catch {
    state.machines = state.machines || null;
  }
  renderMachineState();
  renderModels();
}

function renderMachineState() {
  machineState.className = "machine-state";
  const chosen = route();
  if (chosen === "network") {
    machineState.textContent = "Answers come from the network (charged).";
    return;
  }
  if (chosen === "shared") {
    renderSharedState();
    return;
  }
  const machines = state.machines;
  if (machines === null) {
    machineState.textContent = "Checking your machine…";
    return;
  }
  if (!machines.length) {
    machineState.classList.add("warn");
    machineState.replaceChildren("No machine linked — ", h("a", { href: "/console/link" }, "link one"), ".");
    return;
  }
  const online = machines.filter((m) => m.online);
  if (!online.length) {
    machineState.classList.add("warn");
    machineState.textContent = sentenceFor("machine_offline");
    return;
  }
  machineState.classList.add("ok");
  machineState.textContent = online.length === 1 ? "Your machine is online — its answers are free (the cost is held, then refunded)."
    : `${online.length} of your machines are online — their answers are free (the cost is held, then refunded).`;
}

/** Shared machines: who shared with you (their owners run those machines), yours first. */
function renderSharedState() {
  const machines = state.machines;
  const received = state.received && state.received.filter((share) => share.status === "accepted"
    && (!share.expires_at || Date.parse(share.expires_at) > Date.now()));  // accepted, not ended
  if (machines === null || received === null) {
    machineState.textContent = "Checking the machines shared with you…";
    return;
  }
  const ownOnline = machines.filter((m) => m.online).length;
  if (!received.length) {
    machineState.classList.add("warn");
    if (machines.length) {
      machineState.replaceChildren("Nobody has shared a machine with you — only your own machines answer",
        ownOnline ? " (free)." : ", and none is online.");
    } else {
      machineState.replaceChildren("Nobody has shared a machine with you yet — ",
        h("a", { href: "/console/sharing" }, "see Sharing"), ".");
    }
    return;
  }
  const owners = [...new Set(received.map((s) => s.owner_email))];
  const priced = received.some((s) => s.input_price || s.output_price);
  machineState.classList.add("ok");
  machineState.replaceChildren(
    ownOnline ? "Your machines first, then machines " : "Machines ",
    "shared with you by ", owners.join(", "), ", who ", owners.length === 1 ? "runs them" : "run them",
    priced ? " — some at their owner's prices (" : " — free (",
    h("a", { href: "/console/sharing" }, "Sharing"), ").");
}

function renderModels() {
  const chosen = route();
  // Shared machines never reach the network: only what your machines and those shared with you serve
  const publicIds = chosen === "shared" ? state.sharedModels || [] : state.publicModels || [];
  const ownIds = chosen === "prefer" ? (state.ownModels || []) : [];
  const wanted = modelSelect.value || localStorage.getItem(MODEL_KEY);
  const served = [...new Set([...ownIds, ...publicIds])];
  const options = [];
  if (ownIds.length) {
    options.push(h("optgroup", { label: "On your machine (free)" }, ownIds.map((id) => h("option", { value: id }, id))));
    const rest = publicIds.filter((id) => !ownIds.includes(id));
    if (rest.length) options.push(h("optgroup", { label: "The network" }, rest.map((id) => h("option", { value: id }, id))));
  } else {
    options.push(...publicIds.map((id) => h("option", { value: id }, id)));
  }
  // The model in use stays pickable when nothing serves it right now, so sending explains why
  // (for example "Your machine is offline …") instead of the model silently vanishing.
  const loaded = chosen === "shared" ? state.sharedModels !== null
    : state.publicModels !== null && (chosen === "network" || state.ownModels !== null);
  if (wanted && !served.includes(wanted) && loaded) {
    options.push(h("option", { value: wanted }, `${wanted} (unavailable)`));
  }
  if (!options.length) {
    options.push(h("option", { value: "", disabled: true }, loaded ? "No models available" : "Loading models…"));
  }
  modelSelect.replaceChildren(...options);
  const pickable = [...modelSelect.options].filter((o) => !o.disabled).map((o) => o.value);
  if (wanted && pickable.includes(wanted)) modelSelect.value = wanted;
  else if (pickable.length) modelSelect.value = pickable[0];
  if (state.modelsError) {
    modelHint.textContent = "The model list could not be loaded — reload the page to retry.";
  } else if (loaded && !served.length) {
    modelHint.textContent = {
      prefer: "Neither the network nor your machine serves a model right now — start your Darkbloom node.",
      shared: "Neither your machines nor those shared with you serve a model right now — start your Darkbloom " +
        "node, or ask the owner of a shared machine to start theirs.",
      network: "No model is being served right now — start your Darkbloom node and choose My Machine, or try again later.",
    }[chosen];
  } else {
    modelHint.textContent = "";
  }
}

function submit() {
  const text = prompt.value.trim();
  if (!text || state.controller) return;
  if (!modelSelect.value) {
    modelHint.textContent = "Pick a model first.";
    modelSelect.focus();
    return;
  }
  prompt.value = "";
  emptyState.remove();
  transcript.append(h("li", { class: "turn user" }, h("div", { class: "bubble" }, h("p", {}, text))));
  ask(text, modelSelect.value);
}

/** True when the account has linked machines and the last poll saw none of them online. */
function machineOffline() {
  return !!(state.machines && state.machines.length && !state.machines.some((m) => m.online));
}

/** My Machine: every request carries `X-Darkbloom-Route: prefer` (a header, never a body field;
 * docs/self-route.md "Exclusive vs prefer"): your machine first, for free; the paid network when it can't
 * serve. Shared machines: `X-Darkbloom-Route: shared`: your machines, then those shared with you,
 * never the network. Network: no route header. */
async function ask(text, model) {
  const turn = h("li", { class: "turn assistant", "aria-busy": "true" });
  const meta = h("div", { class: "meta" }, h("span", { class: "model-name" }, model));
  const body = h("div", { class: "bubble answer" }, h("p", { class: "thinking" }, "…"));
  turn.append(meta, body);
  transcript.append(turn);
  turn.scrollIntoView({ block: "end" });

  const messages = [...state.history, { role: "user", content: text }];
  const request = { model, messages, stream: true };
  const limit = parseInt(maxTokens.value, 10);
  if (limit > 0) request.max_tokens = limit;
  const chosen = route();
  const shared = chosen === "shared";

  setBusy(new AbortController());
  let content = "";
  try {
    const response = await post(request, chosen, state.controller.signal);
    if (!response.ok) {
      const error = await errorFrom(response);
      // the machine-state line knows your machine is offline: say so with the error
      const extra = chosen === "prefer" && machineOffline() && error.code !== "machine_offline"
        ? sentenceFor("machine_offline") : null;
      body.replaceChildren(errorBlock(error, { extra, shared, onRetry: () => retry(turn, text, model) }));
      turn.classList.add("failed");
      return;
    }
    meta.append(badge(response.headers));
    content = await stream(response, (soFar) => {
      content = soFar;
      renderAnswer(body, soFar);
    });
    renderAnswer(body, content, true);
    state.history = [...messages, { role: "assistant", content }];
  } catch (error) {
    if (error && error.name === "AbortError") {
      renderAnswer(body, content, true);
      body.append(h("p", { class: "stopped" }, "Stopped."));
      if (content) state.history = [...messages, { role: "assistant", content }];
    } else {
      if (content) renderAnswer(body, content, true);
      else body.replaceChildren();
      body.append(errorBlock(error, { shared, onRetry: () => retry(turn, text, model) }));
      turn.classList.add("failed");
    }
  } finally {
    turn.setAttribute("aria-busy", "false");
    setBusy(null);
  }
}

function retry(turn, text, model) {
  if (state.controller) return;
  turn.remove();
  ask(text, model);
}

function post(request, chosen, signal) {
  const headers = { Accept: "text/event-stream" };
  if (ROUTE_HEADER[chosen]) headers["X-Darkbloom-Route"] = ROUTE_HEADER[chosen];
  return send("/v1/chat/completions", { method: "POST", body: request, headers, signal });
}

function badge(headers) {
  const routed = headers.get("X-Darkbloom-Routed");
  const billing = headers.get("X-Darkbloom-Billing");
  const parts = [];
  if (routed) parts.push({ owned: "your machine", shared: "shared machine" }[routed] || "the network");
  if (billing) parts.push(billing === "free" ? "free" : "charged");
  if (!parts.length) return "";
  return h("span", { class: "badge " + (billing === "free" ? "free" : "charged") }, parts.join(" · "));
}

/** Reads an SSE body: content deltas, one error event (after partial output), or [DONE]. */
async function stream(response, onContent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let content = "";
  let done = false;
  while (!done) {
    const { value, done: ended } = await reader.read();
    if (ended) break;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") { done = true; break; }
      let chunk;
      try { chunk = JSON.parse(data); } catch { continue; }
      if (chunk.error) {
        const error = new Error(chunk.error.message || "The answer was cut off.");
        error.status = 502;
        error.code = chunk.error.code || chunk.error.type || "provider_error";
        error.partial = content;
        onContent(content);
        throw error;
      }
      for (const choice of chunk.choices || []) {
        const delta = choice.delta && choice.delta.content;
        if (delta) content += delta;
      }
      onContent(content);
    }
  }
  if (!done) {
    const error = new Error("The answer was cut off before it finished — retry.");
    error.status = 502;
    error.code = "provider_error";
    throw error;
  }
  return content;
}

let frame = null;
/** Repaints the answer; while streaming at most once per animation frame (`now` paints at once). */
function renderAnswer(body, content, now = false) {
  if (frame) cancelAnimationFrame(frame);
  frame = null;
  const paint = () => {
    frame = null;
    body.replaceChildren(content ? renderMarkdown(content) : h("p", { class: "thinking" }, "…"));
  };
  if (now || document.visibilityState !== "visible") paint();
  else frame = requestAnimationFrame(paint);
}

function setBusy(controller) {
  state.controller = controller;
  sendButton.disabled = !!controller;
  stopButton.hidden = !controller;
  if (!controller) prompt.focus();
}
