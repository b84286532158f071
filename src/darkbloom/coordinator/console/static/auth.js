// Sign up and log in: POST /v1/auth/{signup,login} → a dks- session token kept in sessionStorage.
import { api, session } from "./api.js";
import { describe } from "./errors.js";
import { setStatus } from "./layout.js";

const form = document.getElementById("auth-form");
const mode = form.dataset.mode; // "login" or "signup"
const status = document.getElementById("auth-status");
const submit = document.getElementById("auth-submit");
const email = document.getElementById("email");
const password = document.getElementById("password");

/** Only our own console pages are valid destinations after login (no open redirect). */
function nextPage() {
  const next = new URLSearchParams(location.search).get("next") || "";
  return /^\/console\/[A-Za-z0-9/?=&._%-]*$/.test(next) && !next.startsWith("//") ? next : "/console/";
}

const switchLink = document.getElementById("switch-link");
if (switchLink && location.search) switchLink.href += location.search;

if (session.token) location.replace(nextPage());

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  setStatus(status, "");
  for (const input of [email, password]) input.removeAttribute("aria-invalid");
  if (!email.value.trim() || !email.validity.valid) {
    email.setAttribute("aria-invalid", "true");
    setStatus(status, "Enter a valid email address.", "error");
    email.focus();
    return;
  }
  if (password.value.length < 8) {
    password.setAttribute("aria-invalid", "true");
    setStatus(status, "The password must be at least 8 characters long.", "error");
    password.focus();
    return;
  }
  submit.disabled = true;
  setStatus(status, mode === "signup" ? "Creating your account…" : "Logging in…");
  try {
    const body = await api(`/v1/auth/${mode}`, {
      method: "POST", auth: false, body: { email: email.value.trim(), password: password.value },
    });
    session.save(body.token, email.value.trim().toLowerCase());
    location.assign(nextPage());
  } catch (error) {
    const { sentence } = describe(error);
    setStatus(status, error.code === "invalid_request_error" ? error.message : sentence, "error");
    const field = error.param === "password" ? password : email;
    field.setAttribute("aria-invalid", "true");
    field.focus();
    submit.disabled = false;
  }
});
