// Link a machine: approve the user_code `darkbloom login` printed (POST /v1/device/approve).
// /console/link?code=XXXX-XXXX (the verification link the device flow prints) comes prefilled.
import { api } from "./api.js";
import { describe, withCode } from "./errors.js";
import { h, requireSession, setStatus } from "./layout.js";

const form = document.getElementById("link-form");
const input = document.getElementById("user-code");
const status = document.getElementById("link-status");
const approve = document.getElementById("approve");
const CODE = /^[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}-?[ABCDEFGHJKMNPQRSTUVWXYZ23456789]{4}$/;

if (requireSession()) {
  const code = new URLSearchParams(location.search).get("code");
  if (code) input.value = normalise(code);
  input.addEventListener("input", () => {
    const start = input.selectionStart;
    const upper = input.value.toUpperCase();
    if (upper !== input.value) {
      input.value = upper;
      input.setSelectionRange(start, start);
    }
  });
  form.addEventListener("submit", (event) => { event.preventDefault(); submit(); });
  (code ? approve : input).focus();
}

function normalise(value) {
  const raw = value.trim().toUpperCase().replace(/\s+/g, "");
  return /^[A-Z0-9]{8}$/.test(raw) ? raw.slice(0, 4) + "-" + raw.slice(4) : raw;
}

async function submit() {
  const code = normalise(input.value);
  input.value = code;
  input.removeAttribute("aria-invalid");
  if (!CODE.test(code)) {
    input.setAttribute("aria-invalid", "true");
    setStatus(status, "Enter the 8-character code `darkbloom login` printed, like ABCD-EFGH.", "error");
    input.focus();
    return;
  }
  approve.disabled = true;
  setStatus(status, "Approving…");
  try {
    await api("/v1/device/approve", { method: "POST", body: { user_code: code } });
    setStatus(status, h("div", { class: "success-block" },
      h("p", { class: "success-sentence" }, "Machine linked."),
      h("p", {}, ...withCode("Go back to your terminal — `darkbloom login` finishes by itself. Then start the node with `darkbloom serve`.")),
      h("p", {}, h("a", { href: "/console/machines" }, "See your machines"))), "ok");
    input.value = "";
  } catch (error) {
    input.setAttribute("aria-invalid", "true");
    setStatus(status, h("p", { class: "error-sentence", dataset: { code: error.code || "" } },
      ...withCode(describe(error).sentence)), "error");
    input.focus();
  } finally {
    approve.disabled = false;
  }
}
