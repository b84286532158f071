"""The `llm` CLI with the coordinator configured as OpenAI-compatible models in
extra-openai-models.yaml (a temporary LLM_USER_PATH): a prompt (streamed and not), usage, `--schema`,
tools (`-T`), a completion model (`completion: true`, the legacy endpoint) and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.clients.support import COLOUR_SCHEMA, MODEL, PROMPT, Stack, cell, errors, valid

pytestmark = pytest.mark.e2e

CLIENT = "llm"
LLM = str(Path(sys.executable).with_name("llm"))


@pytest.fixture(scope="module")
def llm_home(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("llm")
    models = [{"model_id": "darkbloom", "model_name": MODEL, "api_base": stack.api_url, "api_key_name": "darkbloom",
               "supports_schema": True, "supports_tools": True},
              {"model_id": "darkbloom-completion", "model_name": MODEL, "api_base": stack.api_url,
               "api_key_name": "darkbloom", "completion": True}]
    (home / "extra-openai-models.yaml").write_text(yaml.safe_dump(models))
    (home / "keys.json").write_text(json.dumps({"darkbloom": stack.key}))
    return home


def llm(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": ""}  # no installed plugins: llm's own OpenAI models and tools
    return subprocess.run([LLM, *args], env=env, capture_output=True, text=True, timeout=120)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"llm exited {done.returncode}: {done.stderr.strip()[-500:]}"
    return done.stdout


@cell(CLIENT, "chat")
def test_prompt(llm_home: Path) -> None:
    assert isinstance(ok(llm(llm_home, "-m", "darkbloom", "--no-stream", "-o", "max_tokens", "12", PROMPT)), str)


@cell(CLIENT, "stream", "usage")
def test_streamed_prompt_with_usage(llm_home: Path) -> None:
    """`llm` streams by default, asking for `stream_options.include_usage`; `-u` prints the usage it got."""
    done = llm(llm_home, "-m", "darkbloom", "-u", "-o", "max_tokens", "12", PROMPT)
    ok(done)
    assert "Token usage:" in done.stderr and " output" in done.stderr, done.stderr


@cell(CLIENT, "structured")
def test_schema(llm_home: Path) -> None:
    valid(ok(llm(llm_home, "-m", "darkbloom", "--schema", json.dumps(COLOUR_SCHEMA), "-o", "max_tokens", "48",
                 PROMPT)), COLOUR_SCHEMA)


@cell(CLIENT, "tool")
def test_tools(llm_home: Path) -> None:
    """`llm` has no tool_choice option, so the tiny model decides whether to call `llm_version`; the
    request with the tool must be answered, and a call, when made, must run and round-trip."""
    done = llm(llm_home, "-m", "darkbloom", "-T", "llm_version", "--td", "--chain-limit", "2", "-o", "max_tokens", "32",
               "Which version of llm is installed? Use the tool.")
    ok(done)


@cell(CLIENT, "completions")
def test_completion_model(llm_home: Path) -> None:
    assert isinstance(ok(llm(llm_home, "-m", "darkbloom-completion", "-o", "max_tokens", "8", "Once upon a time")), str)


# no 429 cell: `llm` cannot turn off the openai SDK's retries, so it waits out Retry-After (60 s for an
# rpm limit) and then succeeds; docs/compatibility.md says so
@pytest.mark.parametrize("status", errors(CLIENT, ["401", "404", "402"]))
def test_errors(stack: Stack, llm_home: Path, status: str, tmp_path: Path) -> None:
    key = {"401": stack.bad_key, "402": stack.broke.api_key}.get(status, stack.key)
    home = llm_home
    if status == "404":  # a configured model id whose name the coordinator does not know
        home = tmp_path
        (home / "extra-openai-models.yaml").write_text(yaml.safe_dump([{
            "model_id": "darkbloom", "model_name": "no-such-model", "api_base": stack.api_url,
            "api_key_name": "darkbloom"}]))
    done = llm(home, "-m", "darkbloom", "--key", key, "--no-stream", "-o", "max_tokens", "8", PROMPT)
    assert done.returncode == 1 and f"Error code: {status}" in done.stderr, (done.returncode, done.stderr[-500:])
