"""docs/compatibility.md from the last run of tests/clients (its conftest writes tests/clients/.results.json).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/clients
    .venv/bin/python scripts/compatibility_table.py            # writes docs/compatibility.md
    .venv/bin/python scripts/compatibility_table.py --check    # exit 1 when the file is out of date

A cell is ✅ when every test that decides it passed, ❌ (with a numbered one-line reason under the
table) when one failed, ⏭ when one was skipped, "not run" when its tests were collected but never
run, and — when no test decides it (not applicable to that client, or a note says why it cannot work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tests" / "clients" / ".results.json"
OUTPUT = ROOT / "docs" / "compatibility.md"

FEATURES = [
    ("chat", "chat"), ("stream", "stream"), ("usage", "usage on request"), ("structured", "structured output"),
    ("tool", "forced tool call"), ("responses", "Responses"), ("responses-stream", "Responses streamed"),
    ("responses-tool", "Responses + tool"), ("completions", "legacy completions"), ("embeddings", "embeddings"),
    ("messages", "Anthropic messages"), ("messages-stream", "messages streamed"),
    ("401", "401"), ("404", "404"), ("402", "402"), ("429", "429"),
]
# row id → (label, the package whose version it names)
CLIENTS = [
    ("openai-python", "openai-python, sync", "openai"),
    ("openai-python-async", "openai-python, async", "openai"),
    ("openai-agents", "openai-agents", "openai-agents"),
    ("langchain", "LangChain `ChatOpenAI`", "langchain-openai"),
    ("instructor", "instructor (TOOLS mode)", "instructor"),
    ("pydantic-ai", "pydantic-ai", "pydantic-ai-slim"),
    ("llm", "`llm` CLI", "llm"),
    ("litellm", "litellm", "litellm"),
    ("anthropic", "anthropic SDK", "anthropic"),
    ("openai-node", "openai-node", "npm:openai"),
    ("ai-sdk", "Vercel AI SDK (`ai` + `@ai-sdk/openai`)", "npm:ai+npm:@ai-sdk/openai"),
]
# cells no test decides on purpose, and why (shown as "— n" with the note under the table)
NOTES = {
    ("llm", "429"): "`llm` has no way to turn off the openai SDK's retries: on a 429 it waits out `Retry-After` "
                    "(60 s for an rpm limit) and then succeeds — right, but too slow for the suite.",
}
CELL_NOTES = {
    ("llm", "tool"): "`llm` has no `tool_choice` option, so the call cannot be forced: the test checks that a prompt "
                     "with a tool (`-T llm_version`) is answered, and that a call, when the model makes one, runs.",
    ("open-responses", "tool-calling"): "Under the case's `tool_choice: \"auto\"` the tiny model may answer in text: "
                                        "the answer is checked against the schema, and a `tool_choice: \"required\"` "
                                        "twin checks the `function_call` output item.",
    ("open-responses", "tool-calling-streaming"): "As above, streamed: every event is checked, and the `required` twin "
                                                  "checks `output_item.added`/`.done` with a `function_call` item and "
                                                  "`function_call_arguments.delta`/`.done`.",
    ("open-responses", "image-input"): "The bundled model reads no images: the case checks the refusal, 400 "
                                       "`model_capability_unsupported` (a vision model's node would answer it).",
}
# the Open Responses specification's compliance cases (tests/clients/test_open_responses.py): id → its name there
OPEN_RESPONSES = [("basic-response", "Basic Text Response"), ("streaming-response", "Streaming Response"),
                  ("system-prompt", "System Prompt"), ("tool-calling", "Tool Calling"),
                  ("tool-calling-streaming", "Tool Calling (Streaming)"), ("image-input", "Image Input"),
                  ("multi-turn", "Multi-turn Conversation")]
SELF_ROUTE = [("chat", "chat completion"), ("stream", "chat, streamed"), ("tool", "forced tool call"),
              ("responses", "Responses"), ("completions", "legacy completions"), ("embeddings", "embeddings"),
              ("messages", "Anthropic messages")]

# -- llama.cpp's server tests, ported (tests/clients/test_llamacpp_server_suite.py) ----------------
LLAMACPP_CLIENT = "llamacpp-server"
LLAMACPP_FILES = [("anthropic", "`test_compat_anthropic.py`"), ("chat", "`test_chat_completion.py`"),
                  ("completions", "`test_completion.py` (its OpenAI-library cases)")]
LLAMACPP_INTRO = ("The cases of llama.cpp's own server tests (`tools/server/tests/unit/` in ggml-org/llama.cpp) that "
                  "concern the OpenAI- and Anthropic-compatible APIs, ported to run against the coordinator and "
                  "the node (`tests/clients/test_llamacpp_server_suite.py`; its header lists the cases left out — "
                  "llama-server's own endpoints and settings such as `/completion`, `/slots`, `/props`, `n_probs` — "
                  "and why).\n")


def section(title: str, intro: str, columns: list[str], rows: Callable[[Notes], list[list[str]]]) -> list[str]:
    """A table of its own under ``title``: ``rows(notes)`` gives each row's cells, its notes follow."""
    notes = Notes()
    out = [f"## {title}\n", intro, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cells) + " |" for cells in rows(notes)]
    return out + ([""] + notes.lines + [""] if notes.lines else [""])


def llamacpp_section(found: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    return section("llama.cpp's server test suite", LLAMACPP_INTRO, ["llama.cpp test file", "cases", "result"],
                   lambda notes: [[label, str(len(found.get((LLAMACPP_CLIENT, feature)) or [])),
                                   notes.mark(found.get((LLAMACPP_CLIENT, feature)))]
                                  for feature, label in LLAMACPP_FILES])


INTRO = """# Compatibility with real clients

Generated by `scripts/compatibility_table.py` from the last run of `tests/clients` (do not edit by
hand): each cell is decided by tests that drive the client itself — its own request building,
parsing and error classes — against a real coordinator and a real node on the bundled SmolLM2-135M.
The tiny model's wording is never judged; the tests check the protocol: shapes and types, a tool
call forced by `tool_choice` whose arguments validate against the tool's schema, JSON that validates
against the requested schema, usage numbers, and the client's own exception type and status for
each error.

✅ works · ❌ fails (the numbered reason is under the table) · — not applicable to the client (with
a number: see that note) · "not run": its tests were collected but not part of the last runs
"""

WHAT = """## What each column runs

- **chat / stream**: the client's plain call, not streamed and streamed.
- **usage on request**: `stream_options.include_usage: true` gives one final usage chunk (the
  client's usage object); without it, every chunk has a choice, so the classic loop
  `for c in stream: print(c.choices[0].delta.content or "")` works.
- **structured output**: `response_format` / `text.format` `json_schema`, parsed by the client's
  own helper (`.parse()`, `with_structured_output`, `--schema`, `generateObject`, …).
- **forced tool call**: `tool_choice` naming the function (or `required`), answered with a call whose
  arguments the client parses and which validate against the schema. instructor and pydantic-ai
  force their own output tool.
- **Responses**: `POST /v1/responses` plain, streamed (the event types through `response.completed`),
  and with a function tool (a `function_call` output item).
- **legacy completions / embeddings**: `POST /v1/completions`, `POST /v1/embeddings` (the openai SDKs
  ask for base64 by default; `encoding_format: "float"` too).
- **Anthropic messages**: `POST /v1/messages`, plain and streamed with Anthropic's event types.
- **401 / 404 / 402 / 429**: a bad key, an unknown model (`model_not_found`), an account without
  balance on the paid path (`insufficient_funds`), a key with `rpm_limit: 1` already spent — each
  raised as the client's own error type with that status, retries off.
"""


def cells(results: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for nodeid, test in sorted(results.get("tests", {}).items()):
        for client, feature in test["cells"]:
            found.setdefault((client, feature), []).append({**test, "nodeid": nodeid})
    return found


class Notes:
    """The numbered failure reasons under a table."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> str:
        self.lines.append(f"{len(self.lines) + 1}. {text}")
        return str(len(self.lines))

    def mark(self, tests: list[dict[str, Any]] | None, cell: tuple[str, str] | None = None) -> str:
        if not tests:
            return f"— {self.note(NOTES[cell])}" if cell in NOTES and NOTES[cell] else "—"
        if cell in CELL_NOTES:
            return f"{self.mark(tests)} {self.note(CELL_NOTES[cell])}"
        if all(t["outcome"] == "not run" for t in tests):
            return "not run"
        bad = [t for t in tests if t["outcome"] not in ("passed", "not run")]
        if not bad:
            return "✅"
        for test in bad:
            self.lines.append(f"{len(self.lines) + 1}. `{test['nodeid'].split('::')[-1]}`: {test['reason']}")
        symbol = "❌" if any(t["outcome"] == "failed" for t in bad) else "⏭"
        first = len(self.lines) - len(bad) + 1
        return f"{symbol} {first}" if len(bad) == 1 else f"{symbol} {first}–{len(self.lines)}"


def render(results: dict[str, Any]) -> str:
    found = cells(results)
    versions = results.get("versions", {})
    notes = Notes()
    out = [INTRO]
    out.append("| client | version | " + " | ".join(label for _, label in FEATURES) + " |")
    out.append("|---" * (len(FEATURES) + 2) + "|")
    for client, label, package in CLIENTS:
        marks = [notes.mark(found.get((client, feature)), (client, feature)) for feature, _ in FEATURES]
        version = " + ".join(versions.get(name, "?") for name in package.split("+"))
        out.append(f"| {label} | {version} | " + " | ".join(marks) + " |")
    matrix_notes = notes.lines
    out += [""] + matrix_notes + [""] if matrix_notes else [""]
    out += section("The same requests through `X-Darkbloom-Route: self`",
                   "Sent by the node's owner (openai-python, and the anthropic SDK for messages): the response "
                   "says `X-Darkbloom-Billing: free` and `X-Darkbloom-Routed: owned`, the owner's balance does not "
                   "move, and the request's usage row has `cost_micro_usd: 0`, `self_routed: true`.\n",
                   ["request", "free and owned"],
                   lambda notes: [[label, notes.mark(found.get(("self-route", feature)))]
                                  for feature, label in SELF_ROUTE])
    out += section("Open Responses compliance suite",
                   "The seven cases of the Open Responses specification's compliance runner, sent as it sends "
                   "them (raw HTTP, the same bodies) to `POST /v1/responses`: every response object and every "
                   "streamed event is validated against the specification's JSON schemas (version 2026-04-24, "
                   "vendored in `tests/support/open_responses_spec/`), then the case's own checks run.\n",
                   ["case", "result"],
                   lambda notes: [[f"{label} (`{case}`)", notes.mark(found.get(("open-responses", case)),
                                                                     ("open-responses", case))]
                                  for case, label in OPEN_RESPONSES])
    out += llamacpp_section(found)
    out.append(WHAT)
    run = results.get("full_run", {})
    out.append(f"Last updated {results.get('updated', '?')}; the last full run of `tests/clients` ({run.get('at', '?')}) "
               f"took {run.get('seconds', '?')} s for {run.get('tests', '?')} tests (one coordinator and one node for "
               f"the package; Python {versions.get('python', '?')}, Node.js {versions.get('node', '?')}). "
               "openai-node and the Vercel AI SDK are the newest releases that run on Node 18 (Debian 12's nodejs); "
               "`make install` installs them with `npm ci` from `tests/clients/node/package-lock.json`, and the "
               "Python clients are pinned in the `test` extra of pyproject.toml.")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="exit 1 if the output is out of date")
    args = parser.parse_args()
    if not args.results.exists():
        print(f"{args.results} does not exist: run tests/clients first", file=sys.stderr)
        return 1
    text = render(json.loads(args.results.read_text()))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run scripts/compatibility_table.py", file=sys.stderr)
            return 1
        return 0
    current = args.output.read_text() if args.output.exists() else ""
    if _table(current) == _table(text):
        print(f"{args.output}: every cell as before, left as it is (only the run's date and time differ)")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


def _table(text: str) -> list[str]:
    """The document without its "Last updated" line: what a run that changed no cell leaves alone."""
    return [line for line in text.splitlines() if not line.startswith("Last updated ")]


if __name__ == "__main__":
    sys.exit(main())
