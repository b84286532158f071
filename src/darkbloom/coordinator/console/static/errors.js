// Every error a person can hit, as a sentence that says what to do next.
import { h } from "./layout.js";

const SENTENCES = {
  // Self-Route (docs/self-route.md "When your machine can't serve (exclusive only)")
  no_linked_machine: () => "No machine is linked to your account — link one under Link a machine (run `darkbloom login` on it), then start it with `darkbloom serve`.",
  machine_offline: () => "Your machine is offline — start your Darkbloom node and retry.",
  machine_not_found: () => "That machine isn't linked to your account — pick one from Machines.",
  model_not_loaded: () => "Your machine is online but doesn't serve this model — pick a model it serves, or restart your node with `darkbloom serve --model <id>`.",
  model_routing_blocked: () => "Your machine can't take private requests right now — update or restart your Darkbloom node, then retry.",
  model_capability_unsupported: () => "Your machine serves this model, but not for this kind of request (images or tools) — send plain text, or load a model that supports it.",
  machine_busy: () => "Your machine is busy with other requests — retry when the countdown ends, or raise its max_concurrency.",
  // Shares (Sharing page; Shared machines in Chat)
  no_shared_machine: () => "Nobody has shared a machine with you and you have none of your own — ask someone to share theirs with your email, or link a machine of your own under Link a machine.",
  share_quota_exceeded: () => "You've used today's allowance on the machines shared with you — it resets at 00:00 UTC (wait for the countdown), or choose Network.",
  share_not_found: () => "That share no longer exists — its owner revoked it, or the person it was shared with left it.",
  // Money
  insufficient_quota: () => "You're out of credit — add credit to keep chatting. My Machine needs credit too: the cost is held up front and refunded when your machine answers.",
  insufficient_funds: () => "You're out of credit — add credit to keep chatting. My Machine needs credit too: the cost is held up front and refunded when your machine answers.",
  spend_cap_exceeded: () => "This key has reached its spend limit for this period — raise the limit under API keys, or wait for it to reset.",
  // Capacity and limits
  rate_limit_exceeded: () => "You're sending requests faster than your limit allows — wait for the countdown, then retry.",
  service_unavailable: () => "Darkbloom is briefly overloaded — retry in a few seconds.",
  model_unavailable: () => "No machine is serving this model right now — pick another model, or start your Darkbloom node and choose My Machine.",
  model_not_found: () => "That model isn't available — pick another one from the list.",
  model_not_allowed: () => "This key may not use that model — edit the key's allowed models.",
  // The serving machine failed
  provider_timeout: () => "The machine serving this answer stopped responding — retry.",
  provider_error: () => "The machine serving this answer failed — retry.",
  // Accounts and device login
  invalid_credentials: () => "That email and password don't match an account — check them, or create an account.",
  email_taken: () => "An account with this email already exists — log in instead.",
  invalid_api_key: () => "Your session has ended — log in again.",
  permission_denied: () => "You're not allowed to do that with this sign-in.",
  invalid_code: () => "That code isn't valid — check it against the code `darkbloom login` printed (like ABCD-EFGH).",
  expired_code: () => "That code has expired — run `darkbloom login` again on your machine for a new one.",
  already_used: () => "That code was already used — if your machine isn't listed under Machines, run `darkbloom login` again.",
  network_error: () => "Can't reach Darkbloom — check your connection and retry.",
  request_too_large: () => "That message is too large — shorten it and retry.",
  context_length_exceeded: () => "This conversation is too long for the model — clear the conversation, or lower Max answer tokens under Options.",
};

// The same errors on a request sent to Shared machines: the machines may be someone else's.
const SHARED_SENTENCES = {
  machine_offline: () => "None of the machines you can use is online — neither yours nor those shared with you. Ask their owner to start theirs (or start your own Darkbloom node), then retry.",
  model_not_loaded: () => "No machine you can use serves this model — neither yours nor those shared with you. Pick another model, or ask the owner which models their machine serves.",
  model_routing_blocked: () => "The machines you can use can't take private requests right now — ask their owner to update or restart their Darkbloom node, then retry.",
  model_capability_unsupported: () => "The machines you can use serve this model, but not for this kind of request (images or tools) — send plain text.",
  machine_busy: () => "The machines you can use are busy with other requests — retry when the countdown ends.",
  insufficient_quota: () => "You're out of credit — the machines shared with you that could answer are priced by their owner, and the cost is held up front. Add credit, or ask the owner to share for free.",
  insufficient_funds: () => "You're out of credit — the machines shared with you that could answer are priced by their owner, and the cost is held up front. Add credit, or ask the owner to share for free.",
};

/** Text with `backticked` commands shown as code; everything stays text. */
export function withCode(text) {
  return text.split("`").map((part, i) => (i % 2 ? h("code", {}, part) : document.createTextNode(part)));
}

/** The sentence for an error code (for example "machine_offline"). */
export function sentenceFor(code) {
  return SENTENCES[code]();
}

/** {sentence, detail, retryAfter} for an ApiError; `shared`: it answered a request sent to Shared machines. */
export function describe(error, { shared = false } = {}) {
  const code = error.code || error.type;
  const known = (shared && SHARED_SENTENCES[code]) || SENTENCES[code];
  let sentence;
  if (known) sentence = known();
  else if (error.status === 429) sentence = SENTENCES.rate_limit_exceeded();
  else if (error.status === 402) sentence = SENTENCES.insufficient_quota();
  else if (error.status >= 502 && error.status <= 504) sentence = SENTENCES.provider_error();
  else sentence = error.message || "Something went wrong — retry.";
  // The server's own sentence adds specifics (the blocker, the field) when ours is generic.
  const detail = known && error.message && error.message !== sentence && (
    code === "model_routing_blocked" || code === "rate_limit_exceeded") ? error.message : null;
  return { sentence, detail, retryAfter: error.retryAfter };
}

/** "45 s", "3 min 20 s", "11 h 59 min": a wait as a person reads it. */
export function duration(seconds) {
  if (seconds < 60) return `${seconds} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min` + (seconds % 60 ? ` ${seconds % 60} s` : "");
  const minutes = Math.floor((seconds % 3600) / 60);
  return `${Math.floor(seconds / 3600)} h` + (minutes ? ` ${minutes} min` : "");
}

/** Shows "Retry in N s" counting down; calls onDone at zero. Returns a cancel function. */
export function countdown(el, seconds, onDone) {
  let left = seconds;
  const render = () => {
    el.textContent = left > 0 ? `Retry in ${duration(left)}` : "You can retry now.";
  };
  render();
  const timer = setInterval(() => {
    left -= 1;
    render();
    if (left <= 0) {
      clearInterval(timer);
      if (onDone) onDone();
    }
  }, 1000);
  return () => clearInterval(timer);
}

/** An error block: the sentence, optional extra lines, a Retry-After countdown and a Retry button. */
export function errorBlock(error, { onRetry, extra, shared } = {}) {
  const { sentence, detail, retryAfter } = describe(error, { shared });
  const block = h("div", { class: "error-block", role: "alert", dataset: { code: error.code || "" } },
    h("p", { class: "error-sentence" }, withCode(sentence)));
  if (detail) block.append(h("p", { class: "error-detail" }, detail));
  if (extra) block.append(h("p", { class: "error-extra" }, extra));
  if (retryAfter || onRetry) {
    const actions = h("div", { class: "error-actions" });
    const timer = h("span", { class: "countdown", "aria-live": "off" });
    let retry = null;
    if (onRetry) {
      retry = h("button", { type: "button", class: "button", onclick: () => { retry.disabled = true; onRetry(); } }, "Retry");
      actions.append(retry);
    }
    if (retryAfter) {
      actions.append(timer);
      if (retry) retry.disabled = true;
      countdown(timer, retryAfter, () => { if (retry) retry.disabled = false; });
    }
    block.append(actions);
  }
  return block;
}
