// Shared by every signed-in page: require a session, show who is signed in, log out.
import { api, loginUrl, session } from "./api.js";

export function requireSession() {
  if (!session.token) {
    location.replace(loginUrl());
    return false;
  }
  const email = document.getElementById("account-email");
  if (email) email.textContent = session.email;
  const logout = document.getElementById("logout");
  if (logout) {
    logout.addEventListener("click", async () => {
      logout.disabled = true;
      try { await api("/v1/auth/logout", { method: "POST" }); } catch { /* already gone */ }
      session.clear();
      location.assign("/console/login");
    });
  }
  return true;
}

/** Element helper: h("p", {class: "x"}, "text", child). Text is always set as text, never HTML. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function setStatus(el, message, kind = "info") {
  el.replaceChildren();
  el.className = "form-status" + (message ? " " + kind : "");
  if (message instanceof Node) el.append(message);
  else if (message) el.textContent = message;
}

/** Runs `task` now and then every `ms` while the tab is visible; never two at once. */
export function poll(task, ms) {
  let timer = null;
  let running = false;
  let stopped = false;
  const schedule = () => {
    clearTimeout(timer);
    if (!stopped && document.visibilityState === "visible") timer = setTimeout(tick, ms);
  };
  const tick = async () => {
    if (running || stopped) return;
    running = true;
    try { await task(); } finally { running = false; schedule(); }
  };
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && !stopped) tick();
    else clearTimeout(timer);
  });
  tick();
  return { stop() { stopped = true; clearTimeout(timer); }, now: tick };
}
