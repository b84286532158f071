// Sharing: share your machines with another account by email (POST /v1/shares) — all of them or
// some, free or at your prices (typed in USD per 1M tokens, sent as integer µUSD), with daily limits
// and a last day — and hand over the invite code it answers once; the shares you gave and received
// (GET /v1/shares), each with its status and what it used today (GET /v1/shares/{id}/usage: the API
// has one per share); a received share is accepted or declined (with the terms shown, so changed
// terms are never accepted unseen), by invite code, or once your address is verified (a mailed code);
// revoked or left with DELETE /v1/shares/{id}.
import { api, session } from "./api.js";
import { describe, errorBlock } from "./errors.js";
import { count, usd, when } from "./format.js";
import { h, requireSession, setStatus } from "./layout.js";

const MAX_PRICE_USD = 1_000_000;  // the API's ceiling: 10^12 µUSD per 1M tokens

const status = document.getElementById("sharing-status");
const givenList = document.getElementById("given-list");
const receivedList = document.getElementById("received-list");
const newShare = document.getElementById("new-share");
const form = document.getElementById("share-form");
const formTitle = document.getElementById("share-form-title");
const formStatus = document.getElementById("share-form-status");
const save = document.getElementById("share-save");
const scopeAll = document.getElementById("share-all");
const scopeSome = document.getElementById("share-some");
const machineChoices = document.getElementById("machine-choices");
const priceSummary = document.getElementById("share-price-summary");
const endDialog = document.getElementById("end-dialog");
const invitePanel = document.getElementById("invite-panel");
const inviteCode = document.getElementById("invite-code");
const inviteForm = document.getElementById("invite-form");
const inviteInput = document.getElementById("invite-input");
const inviteError = document.getElementById("invite-input-error");
const consentStatus = document.getElementById("consent-status");
const verifyPanel = document.getElementById("verify-panel");
const verifyCode = document.getElementById("verify-code");
const verifyError = document.getElementById("verify-code-error");

// Each field the API can name in `param`, with the input to mark and the line under it
const FIELDS = Object.fromEntries([
  ["email", "share-email"],
  ["machines", "share-some", "share-machines-error"],
  ["daily_request_limit", "share-requests"],
  ["daily_token_limit", "share-tokens"],
  ["input_price", "share-input-price"],
  ["output_price", "share-output-price"],
  ["expires_at", "share-expires"],
].map(([param, input, error]) => [param, {
  input: document.getElementById(input),
  error: document.getElementById(error || input + "-error"),
}]));

// What to do about each field, in our words (the API's sentence for anything else)
const FIELD_SENTENCES = {
  email: "Enter the email address of the person you're sharing with, like name@example.com.",
  machines: "Tick at least one machine, or share all of them.",
  daily_request_limit: "Enter a whole number of at least 1, or leave it empty for no limit.",
  daily_token_limit: "Enter a whole number of at least 1, or leave it empty for no limit.",
  input_price: "Enter a price in dollars from 0 to 1,000,000 (at most 6 decimals), or leave it empty for free.",
  output_price: "Enter a price in dollars from 0 to 1,000,000 (at most 6 decimals), or leave it empty for free.",
  expires_at: "Pick a day from today on, or leave it empty to keep the share until you revoke it.",
};
const SELF_SENTENCE = "That's your own email — your machines already serve you: choose My Machine in Chat.";

class FieldError extends Error {
  constructor(param, message) {
    super(message || FIELD_SENTENCES[param]);
    this.param = param;
  }
}

const state = {
  given: [],
  received: [],
  machines: null,   // GET /v1/me/providers: the boxes to tick, and the names of the machines shared
  account: null,    // GET /v1/me: whether the address is verified
  today: new Map(), // share id → today's use (null when it could not be read)
  opener: null,
};

if (requireSession()) {
  newShare.addEventListener("click", (e) => openForm(e.currentTarget));
  document.getElementById("share-cancel").addEventListener("click", closeForm);
  form.addEventListener("submit", (event) => { event.preventDefault(); submit(); });
  form.addEventListener("keydown", (event) => { if (event.key === "Escape") closeForm(); });
  for (const radio of [scopeAll, scopeSome]) radio.addEventListener("change", showScope);
  for (const param of ["input_price", "output_price"]) FIELDS[param].input.addEventListener("input", renderPrice);
  for (const { input } of Object.values(FIELDS)) {
    input.addEventListener("input", () => clearField(input));
  }
  machineChoices.addEventListener("change", () => clearField(FIELDS.machines.input));
  document.getElementById("invite-copy").addEventListener("click", copyInvite);
  inviteForm.addEventListener("submit", (event) => { event.preventDefault(); redeemInvite(); });
  inviteInput.addEventListener("input", () => clearInline(inviteInput, inviteError));
  document.getElementById("verify-send").addEventListener("click", sendCode);
  document.getElementById("verify-form").addEventListener("submit", (event) => { event.preventDefault(); verify(); });
  verifyCode.addEventListener("input", () => clearInline(verifyCode, verifyError));
  load();
}

async function load() {
  try {
    const [shares, machines, account] = await Promise.all([api("/v1/shares"), api("/v1/me/providers"),
      api("/v1/me")]);
    state.given = shares.given;
    state.received = shares.received;
    state.machines = machines.data;
    state.account = account;
    if (!form.hidden) renderMachineChoices();  // the form was opened before the list arrived
  } catch (error) {
    setStatus(status, errorBlock(error), "error");
    return;
  }
  const all = [...state.given, ...state.received];
  const used = await Promise.all(all.map((share) => api(`/v1/shares/${encodeURIComponent(share.id)}/usage?limit=1`)
    .then((usage) => usage.today, () => null)));
  state.today = new Map(all.map((share, n) => [share.id, used[n]]));
  render();
}

function render() {
  const noMachines = ["You have no machines to share yet — ", h("a", { href: "/console/link" }, "link one"),
    ". You can also share all your machines now, and the ones you link later are included."];
  givenList.replaceChildren(...(state.given.length ? state.given.map(givenCard) : [h("li", { class: "empty" },
    state.machines.length
      ? "You haven't shared your machines with anyone. Share them to let someone in your household or team use them."
      : noMachines)]));
  receivedList.replaceChildren(...(state.received.length ? state.received.map(receivedCard) : [h("li", { class: "empty" },
    "Nobody has shared a machine with you. To use someone's, ask them to share it with " +
    `${session.email || "your email"} and to give you its invite code.`)]));
  verifyPanel.hidden = !state.account || state.account.email_verified || !state.account.email;
  document.getElementById("verify-email").textContent = state.account ? state.account.email || "" : "";
}

function fact(term, value) {
  return [h("dt", {}, term), h("dd", {}, value)];
}

function expirySeconds(share) {
  return share.expires_at ? Math.floor(Date.parse(share.expires_at) / 1000) : null;
}

function expired(share) {
  const ends = expirySeconds(share);
  return ends !== null && ends * 1000 <= Date.now();
}

function priced(share) {
  return Boolean(share.input_price || share.output_price);
}

function priceText(share) {
  return priced(share) ? `${usd(share.input_price)} in · ${usd(share.output_price)} out per 1M tokens` : "Free";
}

function plural(n, word) {
  return `${count(n)} ${word}${n === 1 ? "" : "s"}`;
}

function limitsText(share) {
  const limits = [];
  if (share.daily_request_limit) limits.push(plural(share.daily_request_limit, "request"));
  if (share.daily_token_limit) limits.push(plural(share.daily_token_limit, "token"));
  return limits.length ? limits.join(" · ") + " a day" : "None";
}

function usedText(share) {
  const today = state.today.get(share.id);
  if (!today) return "Couldn't be read — reload the page to retry.";
  const tokens = today.prompt_tokens + today.completion_tokens;
  const requests = plural(today.requests, "request") +
    (share.daily_request_limit ? ` of ${count(share.daily_request_limit)}` : "");
  const split = tokens ? ` (${count(today.prompt_tokens)} in, ${count(today.completion_tokens)} out)` : "";
  const tokenText = plural(tokens, "token") +
    (share.daily_token_limit ? ` of ${count(share.daily_token_limit)}` : "") + split;
  return `${requests} · ${tokenText}`;
}

/** "At the end of Jan 31, 2027" when the share ends at a local midnight (a last day picked here). */
function endsText(share, whoRevokes) {
  const ends = expirySeconds(share);
  if (ends === null) return `When ${whoRevokes}`;
  const moment = new Date(ends * 1000);
  let text = when(ends);
  if (!moment.getHours() && !moment.getMinutes() && !moment.getSeconds()) {
    const lastDay = new Date(moment.getFullYear(), moment.getMonth(), moment.getDate() - 1);
    text = "the end of " + lastDay.toLocaleDateString(undefined, { year: "numeric", month: "short", day: "numeric" });
  }
  return expired(share) ? `Ended at ${text}` : `At ${text}`;
}

const STATUS_BADGES = {
  given: { pending: "Waiting for them to accept", declined: "Declined" },
  received: { pending: "Waiting for your answer", declined: "You declined" },
};

function badges(share, pricedLabel, side) {
  const status = STATUS_BADGES[side][share.status];
  return [
    h("span", { class: "badge " + (priced(share) ? "charged" : "free") }, priced(share) ? pricedLabel : "Free"),
    status ? h("span", { class: "badge status " + share.status }, status) : null,
    expired(share) ? h("span", { class: "badge network" }, "Ended") : null,
  ];
}

function givenCard(share) {
  const names = new Map(state.machines.map((m) => [m.id, m.name || m.id]));
  const machines = share.machines === "all" ? "All your machines, and any you link later"
    : share.machines.map((id) => names.get(id) || "a machine no longer linked").join(", ");
  return h("li", { class: "share card", dataset: { id: share.id } },
    h("div", { class: "share-head" },
      h("h3", { class: "share-name" }, share.grantee_email),
      badges(share, "At your prices", "given")),
    h("dl", { class: "facts" },
      fact("Machines", machines),
      fact("Used today", h("span", { class: "share-today" }, usedText(share))),
      fact("Daily limits", limitsText(share)),
      fact("Price", priceText(share)),
      fact("Ends", endsText(share, "you revoke it")),
      fact("Shared", when(share.created_at))),
    h("div", { class: "share-actions" },
      h("button", { type: "button", class: "button danger-outline",
        "aria-label": `Revoke the share with ${share.grantee_email}`,
        onclick: (e) => confirmEnd(share, "revoke", e.currentTarget) }, "Revoke")));
}

/** The grantee is told plainly whose hardware serves them. */
function operatorSentence(owner) {
  return `These machines belong to ${owner}, who runs them. Your requests are encrypted to their node like ` +
    `any provider's, and the node decrypts them to answer — on ${owner}'s hardware, with software they ` +
    "control. Send only what you would trust them with.";
}

/** What a grantee is asked before the share routes anything: whose machines, and at what price. */
function consentSentence(share) {
  return (priced(share)
    ? `Accept to let your requests on Shared machines go to ${share.owner_email}'s machines at the prices above, ` +
      "paid from your credit."
    : `Accept to let your requests on Shared machines go to ${share.owner_email}'s machines, for free.`) +
    " If they change its prices or machines, you'll be asked again.";
}

function receivedCard(share) {
  const named = share.machine_names || {};
  const listed = Object.values(named);
  const machines = share.machines === "all"
    ? (listed.length ? `All their machines: ${listed.join(", ")}` : "All their machines (none linked right now)")
    : share.machines.filter((id) => id in named).map((id) => named[id]).join(", ") || "None of them is linked any more";
  const answer = (verb, label, kind) => h("button", { type: "button", class: "button " + kind,
    "aria-label": `${label} the share from ${share.owner_email}`,
    onclick: (e) => answerShare(share, verb, e.currentTarget) }, label);
  return h("li", { class: "share card", dataset: { id: share.id, status: share.status } },
    h("div", { class: "share-head" },
      h("h3", { class: "share-name" }, `From ${share.owner_email}`),
      badges(share, "At their prices", "received")),
    h("p", { class: "share-note operator" }, operatorSentence(share.owner_email)),
    h("dl", { class: "facts" },
      fact("Machines", machines),
      fact("Used today", h("span", { class: "share-today" }, usedText(share))),
      fact("Daily limits", limitsText(share)),
      fact("Price", priced(share) ? priceText(share) + ", paid from your credit" : "Free"),
      fact("Ends", endsText(share, "you leave it or they revoke it"))),
    share.status === "accepted" ? null : h("p", { class: "share-note consent" }, consentSentence(share)),
    h("div", { class: "share-actions" },
      share.status === "accepted" ? null : answer("accept", "Accept", "primary"),
      share.status === "pending" ? answer("decline", "Decline", "") : null,
      h("button", { type: "button", class: "button danger-outline",
        "aria-label": `Leave the share from ${share.owner_email}`,
        onclick: (e) => confirmEnd(share, "leave", e.currentTarget) }, "Leave")));
}

// Consent: accept or decline a received share, with the terms it was shown

async function answerShare(share, verb, button) {
  button.disabled = true;
  const shown = { machines: share.machines, input_price: share.input_price, output_price: share.output_price };
  try {
    await api(`/v1/shares/${encodeURIComponent(share.id)}/${verb}`, { method: "POST", body: shown });
    setStatus(status, verb === "accept"
      ? `You accepted ${share.owner_email}'s share: choose Shared machines in Chat to use it.`
      : `You declined ${share.owner_email}'s share. Nothing goes to their machines.`, "ok");
  } catch (error) {
    if (error.code === "share_terms_changed") {
      setStatus(status, `${share.owner_email} changed this share's prices or machines a moment ago — ` +
        "read it again below before you answer.", "error");
    } else {
      setStatus(status, errorBlock(error), "error");
    }
  }
  await load();
}

async function redeemInvite() {
  clearInline(inviteInput, inviteError);
  const code = inviteInput.value.trim();
  if (!code) {
    showInline(inviteInput, inviteError, "Paste the invite code the machines' owner gave you.");
    return;
  }
  try {
    const share = await api("/v1/shares/accept", { method: "POST", body: { invite_code: code } });
    inviteForm.reset();
    setStatus(consentStatus, `You accepted ${share.owner_email}'s share: choose Shared machines in Chat to use it.`,
      "ok");
    await load();
  } catch (error) {
    showInline(inviteInput, inviteError, error.code === "share_not_found"
      ? "That code doesn't open any share — it may be mistyped, or already used. Ask the owner for a new share."
      : describe(error).sentence);
  }
}

async function sendCode() {
  clearInline(verifyCode, verifyError);
  try {
    const sent = await api("/v1/me/email/send-code", { method: "POST" });
    setStatus(consentStatus, `We sent a code to ${sent.email}. Type it below.`, "ok");
    verifyCode.focus();
  } catch (error) {
    setStatus(consentStatus, error.code === "mail_unavailable"
      ? "This coordinator can't send mail, so addresses can't be verified here — ask the owner for the share's invite code."
      : errorBlock(error), "error");
  }
}

async function verify() {
  clearInline(verifyCode, verifyError);
  const code = verifyCode.value.trim();
  if (!code) {
    showInline(verifyCode, verifyError, "Type the code from the email we sent you.");
    return;
  }
  try {
    await api("/v1/me/email/verify", { method: "POST", body: { code } });
    setStatus(consentStatus, "Your email address is verified: shares sent to it are listed below.", "ok");
    await load();
  } catch (error) {
    showInline(verifyCode, verifyError, error.code === "invalid_code"
      ? "That isn't the code we sent last (or it was tried too often) — check the email, or send a new code."
      : error.code === "expired_code" ? "That code has expired — send a new one." : describe(error).sentence);
  }
}

function showInline(input, error, message) {
  input.setAttribute("aria-invalid", "true");
  error.textContent = message;
  input.focus();
}

function clearInline(input, error) {
  input.removeAttribute("aria-invalid");
  error.textContent = "";
}

async function copyInvite() {
  try {
    await navigator.clipboard.writeText(inviteCode.textContent);
    setStatus(status, "Invite code copied.", "ok");
  } catch {
    setStatus(status, "Select the code and copy it yourself — this browser didn't let the page do it.", "info");
  }
}

// The form

function openForm(opener) {
  state.opener = opener;
  invitePanel.hidden = true;
  form.reset();
  for (const { input } of Object.values(FIELDS)) clearField(input);
  setStatus(formStatus, "");
  const today = new Date();
  FIELDS.expires_at.input.min = [today.getFullYear(), today.getMonth() + 1, today.getDate()]
    .map((n) => String(n).padStart(2, "0")).join("-");
  renderMachineChoices();
  showScope();
  renderPrice();
  form.hidden = false;
  formTitle.focus();
}

function closeForm() {
  form.hidden = true;
  if (state.opener && document.contains(state.opener)) state.opener.focus();
}

function renderMachineChoices() {
  const ticked = new Set([...machineChoices.querySelectorAll("input:checked")].map((box) => box.value));
  scopeSome.disabled = !state.machines || !state.machines.length;
  if (!state.machines) {
    machineChoices.replaceChildren(h("li", { class: "empty" }, "Loading your machines…"));
    return;
  }
  if (!state.machines.length) {
    machineChoices.replaceChildren(h("li", { class: "empty" }, "You have no machines linked yet."));
    return;
  }
  machineChoices.replaceChildren(...state.machines.map((m, n) => {
    const inputId = `share-machine-${n}`;
    return h("li", {},
      h("input", { type: "checkbox", id: inputId, value: m.id, checked: ticked.has(m.id) }),
      h("label", { for: inputId }, m.name || m.id, " ",
        h("span", { class: "pill " + (m.online ? "online" : "offline") }, m.online ? "Online" : "Offline")));
  }));
}

function showScope() {
  machineChoices.hidden = !scopeSome.checked;
}

function clearField(input) {
  input.removeAttribute("aria-invalid");
  const entry = Object.values(FIELDS).find((f) => f.input === input);
  if (entry) entry.error.textContent = "";
}

function showFieldError(param, message) {
  const { input, error } = FIELDS[param];
  input.setAttribute("aria-invalid", "true");
  error.textContent = message;
  const target = param === "machines" && scopeSome.checked
    ? machineChoices.querySelector("input") || input : input;
  target.focus();
}

function wholeNumber(param) {
  const { input } = FIELDS[param];
  const raw = input.value.trim();
  if (input.validity.badInput) throw new FieldError(param);
  if (!raw) return null;
  const value = Number(raw);
  if (!Number.isInteger(value) || value < 1) throw new FieldError(param);
  return value;
}

/** Dollars per 1M tokens as typed → integer µUSD, read from the digits (no floating point). */
function microUsd(param) {
  const { input } = FIELDS[param];
  const raw = input.value.trim();
  if (input.validity.badInput) throw new FieldError(param);
  if (!raw) return 0;
  const parts = /^(\d+)?(?:\.(\d*))?$/.exec(raw);
  if (!parts || (!parts[1] && !parts[2]) || (parts[2] || "").length > 6) throw new FieldError(param);
  const dollars = Number(parts[1] || "0");
  if (dollars > MAX_PRICE_USD) throw new FieldError(param);
  const micro = dollars * 1_000_000 + Number((parts[2] || "").padEnd(6, "0"));
  if (micro > MAX_PRICE_USD * 1_000_000) throw new FieldError(param);
  return micro;
}

/** The last day (local) → the moment after it ends, as ISO 8601 in UTC. */
function expiry() {
  const { input } = FIELDS.expires_at;
  if (input.validity.badInput) throw new FieldError("expires_at");
  if (!input.value) return null;
  const [year, month, day] = input.value.split("-").map(Number);
  const end = new Date(year, month - 1, day + 1);
  if (Number.isNaN(end.getTime()) || end.getTime() <= Date.now()) throw new FieldError("expires_at");
  return end.toISOString().replace(/\.\d{3}Z$/, "Z");
}

function renderPrice() {
  let input;
  let output;
  try {
    input = microUsd("input_price");
    output = microUsd("output_price");
  } catch {
    priceSummary.textContent = "";
    return;
  }
  priceSummary.textContent = input || output
    ? `They pay ${usd(input)} per 1M input tokens and ${usd(output)} per 1M output tokens from their credit; ` +
      "you earn that, less the platform fee."
    : "Free: they pay nothing and need no credit. Enter a price to charge them; you earn it, less the platform fee.";
}

function collect() {
  const email = FIELDS.email.input.value.trim();
  if (!email) throw new FieldError("email");
  const body = { email };
  if (scopeSome.checked) {
    const ticked = [...machineChoices.querySelectorAll("input[type=checkbox]:checked")].map((box) => box.value);
    if (!ticked.length) throw new FieldError("machines");
    body.machines = ticked;
  }
  const requests = wholeNumber("daily_request_limit");
  const tokens = wholeNumber("daily_token_limit");
  if (requests !== null) body.daily_request_limit = requests;
  if (tokens !== null) body.daily_token_limit = tokens;
  body.input_price = microUsd("input_price");
  body.output_price = microUsd("output_price");
  const ends = expiry();
  if (ends !== null) body.expires_at = ends;
  return body;
}

/** Our sentence for a field the API refused (sharing with yourself has its own). */
function sentenceForField(error, email) {
  if (error.param === "email" && email.toLowerCase() === session.email.trim().toLowerCase()) return SELF_SENTENCE;
  return FIELD_SENTENCES[error.param] || error.message;
}

async function submit() {
  for (const { input } of Object.values(FIELDS)) clearField(input);
  setStatus(formStatus, "");
  let body;
  try {
    body = collect();
  } catch (error) {
    if (!(error instanceof FieldError)) throw error;
    showFieldError(error.param, error.message);
    return;
  }
  save.disabled = true;
  try {
    const share = await api("/v1/shares", { method: "POST", body });
    form.hidden = true;
    setStatus(status, `Shared with ${share.grantee_email}. They can use your machines once they accept.`, "ok");
    inviteCode.textContent = share.invite_code;
    invitePanel.hidden = false;
    await load();
    document.getElementById("invite-copy").focus();
  } catch (error) {
    if (error.param && FIELDS[error.param]) showFieldError(error.param, sentenceForField(error, body.email));
    else if (error.code === "machine_not_found") showFieldError("machines", describe(error).sentence);
    else setStatus(formStatus, errorBlock(error), "error");
  } finally {
    save.disabled = false;
  }
}

// Revoke (the owner) or leave (the grantee): the same DELETE, after a confirmation

function confirmEnd(share, kind, opener) {
  const revoke = kind === "revoke";
  document.getElementById("end-title").textContent = revoke
    ? `Revoke the share with ${share.grantee_email}?` : `Leave ${share.owner_email}'s share?`;
  document.getElementById("end-text").textContent = revoke
    ? `${share.grantee_email} can no longer use your machines: new requests are refused at once, and those ` +
      "already running finish."
    : `You can no longer use ${share.owner_email}'s machines. Only they can share them with you again.`;
  document.getElementById("end-confirm").textContent = revoke ? "Revoke" : "Leave";
  endDialog.returnValue = "";
  endDialog.onclose = async () => {
    if (endDialog.returnValue !== "confirm") { opener.focus(); return; }
    try {
      await api(`/v1/shares/${encodeURIComponent(share.id)}`, { method: "DELETE" });
      setStatus(status, revoke ? `Revoked the share with ${share.grantee_email}.`
        : `You left ${share.owner_email}'s share.`, "ok");
    } catch (error) {
      setStatus(status, errorBlock(error), "error");
    }
    await load();
    newShare.focus();
  };
  endDialog.showModal();
}
