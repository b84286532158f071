// API keys: list, create (secret shown once), edit, delete. "My Machine only — free" sets
// self_route_only; with it on, the allowed-models picker offers /v1/me/self-route-models instead
// of the public models, and only ids shown in the current picker are ever submitted.
import { api } from "./api.js";
import { describe, errorBlock } from "./errors.js";
import { usd, when } from "./format.js";
import { h, requireSession, setStatus } from "./layout.js";

const status = document.getElementById("keys-status");
const list = document.getElementById("key-list");
const more = document.getElementById("keys-more");
const form = document.getElementById("key-form");
const formTitle = document.getElementById("key-form-title");
const formStatus = document.getElementById("key-form-status");
const save = document.getElementById("key-save");
const selfRoute = document.getElementById("key-self-route");
const choices = document.getElementById("model-choices");
const modelsHint = document.getElementById("models-hint");
const secretPanel = document.getElementById("secret-panel");
const secretValue = document.getElementById("secret-value");
const copyStatus = document.getElementById("copy-status");
const deleteDialog = document.getElementById("delete-dialog");

const fields = {
  name: document.getElementById("key-name"),
  limit: document.getElementById("key-limit"),
  reset: document.getElementById("key-reset"),
  rpm: document.getElementById("key-rpm"),
  itpm: document.getElementById("key-itpm"),
  otpm: document.getElementById("key-otpm"),
};

const state = {
  keys: [],
  cursor: null,
  editing: null,            // the key being edited, or null when creating
  checked: new Set(),       // model ids ticked in the picker (either list)
  publicModels: null,       // GET /v1/models, fetched once when the form first opens
  ownModels: null,          // GET /v1/me/self-route-models, fetched once when first needed
  opener: null,             // the button that opened the form, to return focus to
};

if (requireSession()) {
  document.getElementById("new-key").addEventListener("click", (e) => openForm(null, e.currentTarget));
  document.getElementById("key-cancel").addEventListener("click", closeForm);
  document.getElementById("secret-done").addEventListener("click", () => {
    secretValue.textContent = "";
    secretPanel.hidden = true;
    document.getElementById("new-key").focus();
  });
  document.getElementById("copy-secret").addEventListener("click", copySecret);
  selfRoute.addEventListener("change", renderChoices);
  choices.addEventListener("change", (event) => {
    const box = event.target;
    if (box.type === "checkbox") box.checked ? state.checked.add(box.value) : state.checked.delete(box.value);
  });
  form.addEventListener("submit", (event) => { event.preventDefault(); submit(); });
  form.addEventListener("keydown", (event) => { if (event.key === "Escape") closeForm(); });
  more.addEventListener("click", () => load(state.cursor));
  load(null);
}

async function load(cursor) {
  try {
    const page = await api("/v1/keys?limit=50" + (cursor ? "&cursor=" + encodeURIComponent(cursor) : ""));
    state.keys = cursor ? [...state.keys, ...page.data] : page.data;
    state.cursor = page.next_cursor;
  } catch (error) {
    setStatus(status, errorBlock(error), "error");
  }
  render();
}

function render() {
  more.hidden = !state.cursor;
  if (!state.keys.length) {
    list.replaceChildren(h("li", { class: "empty" }, "No keys yet. Create one to use Darkbloom from code — it works with any OpenAI SDK."));
    return;
  }
  list.replaceChildren(...state.keys.map(keyCard));
}

function keyCard(key) {
  const limits = [["rpm_limit", "req/min"], ["itpm_limit", "input tok/min"], ["otpm_limit", "output tok/min"]]
    .filter(([f]) => key[f]).map(([f, unit]) => `${key[f].toLocaleString("en-US")} ${unit}`);
  const cap = key.limit_micro_usd === null || key.limit_micro_usd === undefined ? "No spend cap"
    : `Spend cap ${usd(key.limit_micro_usd)}${key.limit_reset && key.limit_reset !== "none" ? " · resets " + key.limit_reset : ""}`;
  return h("li", { class: "key card", dataset: { id: key.id } },
    h("div", { class: "key-head" },
      h("h2", { class: "key-name" }, key.name),
      key.self_route_only ? h("span", { class: "badge free" }, "My Machine only — free") : null),
    h("p", { class: "key-prefix" }, h("code", {}, key.key_prefix + "…")),
    h("dl", { class: "facts" },
      fact("Spend", key.self_route_only ? "Never spends (free on your machine)" : cap),
      fact("Rate limits", limits.length ? limits.join(" · ") : "None"),
      fact("Models", key.allowed_models ? key.allowed_models.join(", ") : "All models"),
      fact("Created", when(key.created_at)),
      fact("Last used", when(key.last_used_at))),
    h("div", { class: "key-actions" },
      h("button", { type: "button", class: "button", "aria-label": `Edit key ${key.name}`,
        onclick: (e) => openForm(key, e.currentTarget) }, "Edit"),
      h("button", { type: "button", class: "button danger-outline", "aria-label": `Delete key ${key.name}`,
        onclick: (e) => confirmDelete(key, e.currentTarget) }, "Delete")));
}

function fact(term, value) {
  return [h("dt", {}, term), h("dd", {}, value)];
}

async function openForm(key, opener) {
  state.editing = key;
  state.opener = opener;
  formTitle.textContent = key ? `Edit key “${key.name}”` : "Create a key";
  save.textContent = key ? "Save changes" : "Create key";
  setStatus(formStatus, "");
  fields.name.value = key ? key.name : "";
  selfRoute.checked = key ? key.self_route_only : false;
  fields.limit.value = key && key.limit_usd !== null ? String(key.limit_usd) : "";
  fields.reset.value = key ? key.limit_reset || "none" : "none";
  fields.rpm.value = key && key.rpm_limit ? key.rpm_limit : "";
  fields.itpm.value = key && key.itpm_limit ? key.itpm_limit : "";
  fields.otpm.value = key && key.otpm_limit ? key.otpm_limit : "";
  for (const input of Object.values(fields)) input.removeAttribute("aria-invalid");
  state.checked = new Set(key && key.allowed_models ? key.allowed_models : []);
  form.hidden = false;
  formTitle.focus();
  await renderChoices();
}

function closeForm() {
  form.hidden = true;
  state.editing = null;
  if (state.opener && document.contains(state.opener)) state.opener.focus();
}

async function renderChoices() {
  const mine = selfRoute.checked;
  modelsHint.textContent = "Loading models…";
  choices.replaceChildren();
  try {
    if (mine && state.ownModels === null) state.ownModels = (await api("/v1/me/self-route-models")).models;
    if (!mine && state.publicModels === null) state.publicModels = (await api("/v1/models")).data.map((m) => m.id);
  } catch (error) {
    modelsHint.textContent = "The model list could not be loaded: " + describe(error).sentence;
    return;
  }
  if (selfRoute.checked !== mine) return; // flipped again while loading
  const source = mine ? state.ownModels : state.publicModels;
  // When editing, the key's saved models of this same kind stay visible even if not served right now.
  const saved = state.editing && state.editing.self_route_only === mine && state.editing.allowed_models
    ? state.editing.allowed_models.filter((id) => !source.includes(id)) : [];
  const ids = [...source, ...saved];
  modelsHint.textContent = (mine
    ? "Models your own online machines serve. "
    : "Models the network serves. ") + "Tick none to allow every model.";
  if (!ids.length) {
    choices.replaceChildren(h("li", { class: "empty" }, mine
      ? "Your machines serve no models right now (start your node to pick some). With none ticked, the key may use any model your machines serve."
      : "No models are being served right now. With none ticked, the key may use any model."));
    return;
  }
  choices.replaceChildren(...ids.map((id, n) => {
    const inputId = `model-choice-${n}`;
    return h("li", {},
      h("input", { type: "checkbox", id: inputId, value: id, checked: state.checked.has(id) }),
      h("label", { for: inputId }, id, saved.includes(id) ? h("span", { class: "hint" }, " (not served right now)") : null));
  }));
}

function numberField(input, { integer, min }) {
  const raw = input.value.trim();
  if (!raw) return null;
  const value = Number(raw);
  if (!Number.isFinite(value) || value < min || (integer && !Number.isInteger(value))) {
    input.setAttribute("aria-invalid", "true");
    throw new Error(integer ? `Enter a whole number of at least ${min}, or leave it empty.`
      : "Enter an amount of at least 0, or leave it empty.");
  }
  input.removeAttribute("aria-invalid");
  return value;
}

function collect() {
  const name = fields.name.value.trim();
  if (!name) {
    fields.name.setAttribute("aria-invalid", "true");
    fields.name.focus();
    throw new Error("Give the key a name.");
  }
  const body = { name, self_route_only: selfRoute.checked, limit_reset: fields.reset.value };
  for (const [field, input, opts] of [
    ["limit_usd", fields.limit, { integer: false, min: 0 }],
    ["rpm_limit", fields.rpm, { integer: true, min: 1 }],
    ["itpm_limit", fields.itpm, { integer: true, min: 1 }],
    ["otpm_limit", fields.otpm, { integer: true, min: 1 }],
  ]) {
    try { body[field] = numberField(input, opts); } catch (error) { input.focus(); throw error; }
  }
  // Only the boxes in the picker on screen: ids of the other list are never submitted.
  const ticked = [...choices.querySelectorAll("input[type=checkbox]:checked")].map((box) => box.value);
  body.allowed_models = ticked.length ? ticked : null;
  return body;
}

async function submit() {
  let body;
  try { body = collect(); } catch (error) { setStatus(formStatus, error.message, "error"); return; }
  save.disabled = true;
  setStatus(formStatus, "");
  try {
    const editing = state.editing;
    const result = await api(editing ? `/v1/keys/${encodeURIComponent(editing.id)}` : "/v1/keys",
      { method: editing ? "PATCH" : "POST", body });
    form.hidden = true;
    state.editing = null;
    if (!editing) showSecret(result.key);
    setStatus(status, editing ? `Saved “${result.name}”.` : `Created “${result.name}”.`, "ok");
    await load(null);
  } catch (error) {
    const fieldInput = { name: fields.name, limit_usd: fields.limit, rpm_limit: fields.rpm, itpm_limit: fields.itpm, otpm_limit: fields.otpm }[error.param];
    if (fieldInput) { fieldInput.setAttribute("aria-invalid", "true"); fieldInput.focus(); }
    setStatus(formStatus, error.code === "invalid_request_error" ? error.message : describe(error).sentence, "error");
  } finally {
    save.disabled = false;
  }
}

function showSecret(secret) {
  secretValue.textContent = secret;
  copyStatus.textContent = "";
  secretPanel.hidden = false;
  secretPanel.focus();
}

async function copySecret() {
  const text = secretValue.textContent;
  try {
    await navigator.clipboard.writeText(text);
    copyStatus.textContent = "Copied to the clipboard.";
  } catch {
    const range = document.createRange();
    range.selectNodeContents(secretValue);
    const selection = getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    const copied = document.execCommand && document.execCommand("copy");
    copyStatus.textContent = copied ? "Copied to the clipboard." : "Selected — press Ctrl+C (⌘C) to copy.";
  }
}

function confirmDelete(key, opener) {
  document.getElementById("delete-text").textContent =
    `“${key.name}” (${key.key_prefix}…) stops working at once. Programs using it will get 401 errors.`;
  deleteDialog.returnValue = "";
  deleteDialog.onclose = async () => {
    if (deleteDialog.returnValue !== "confirm") { opener.focus(); return; }
    try {
      await api(`/v1/keys/${encodeURIComponent(key.id)}`, { method: "DELETE" });
      setStatus(status, `Deleted “${key.name}”.`, "ok");
      await load(null);
      document.getElementById("new-key").focus();
    } catch (error) {
      setStatus(status, errorBlock(error), "error");
    }
  };
  deleteDialog.showModal();
}
