// The console's only way to the coordinator: its public HTTP API, authorised with the console
// session token (dks-…) as a Bearer header. The token lives in sessionStorage (this tab only) and
// is never a consumer API key; nothing ambient (no cookie) authorises a request, so there is no CSRF.

const TOKEN_KEY = "darkbloom.session";
const EMAIL_KEY = "darkbloom.email";

export const session = {
  get token() { return sessionStorage.getItem(TOKEN_KEY); },
  get email() { return sessionStorage.getItem(EMAIL_KEY) || ""; },
  save(token, email) {
    sessionStorage.setItem(TOKEN_KEY, token);
    sessionStorage.setItem(EMAIL_KEY, email);
  },
  clear() {
    sessionStorage.removeItem(TOKEN_KEY);
    sessionStorage.removeItem(EMAIL_KEY);
  },
};

export class ApiError extends Error {
  constructor(status, body, headers) {
    const error = (body && typeof body === "object" && body.error) || {};
    super(error.message || (status ? `The server answered ${status}.` : "Network error."));
    this.status = status;
    this.type = error.type || null;
    this.code = error.code || error.type || null;
    this.param = error.param || null;
    this.retryAfter = parseRetryAfter(headers ? headers.get("Retry-After") : null);
  }
}

export function parseRetryAfter(value) {
  if (!value) return null;
  const seconds = Number(value.trim());
  if (Number.isFinite(seconds)) return Math.max(0, Math.ceil(seconds));
  const date = Date.parse(value);
  return Number.isNaN(date) ? null : Math.max(0, Math.ceil((date - Date.now()) / 1000));
}

export function loginUrl() {
  const here = location.pathname + location.search;
  return "/console/login?next=" + encodeURIComponent(here);
}

/** The raw fetch Response (for streams); network failures become ApiError(status 0). */
export async function send(path, { method = "GET", body, headers = {}, signal, auth = true } = {}) {
  const allHeaders = { Accept: "application/json", ...headers };
  if (body !== undefined) allHeaders["Content-Type"] = "application/json";
  if (auth && session.token) allHeaders.Authorization = "Bearer " + session.token;
  try {
    return await fetch(path, {
      method, headers: allHeaders, signal, credentials: "omit", cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    const failure = new ApiError(0, null, null);
    failure.code = "network_error";
    throw failure;
  }
}

/** The ApiError for a non-2xx response; an ended session sends the person to log in. */
export async function errorFrom(response) {
  let body = null;
  try { body = await response.json(); } catch { /* not JSON */ }
  const error = new ApiError(response.status, body, response.headers);
  if (response.status === 401 && session.token) {
    session.clear();
    location.assign(loginUrl());
  }
  return error;
}

/** JSON of a successful call, else throws ApiError. */
export async function api(path, options) {
  const response = await send(path, options);
  if (!response.ok) throw await errorFrom(response);
  if (response.status === 204) return null;
  return response.json();
}
