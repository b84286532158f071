"""The node's engine beside llama.cpp's own `llama-server`, on the same model and cores, in one run.

Both are driven one after the other through their OpenAI-compatible `/v1/chat/completions` with
streamed chat, on the same GGUF (the bundled SmolLM2-135M):

- the node: `darkbloom start --local --port P --max-concurrency C` in its own DARKBLOOM_HOME
  (`local.json` gives the URL and token; `darkbloom stop` after): one engine per model, a context
  with C slots, llama.cpp on every core;
- llama-server: built on first use from the llama.cpp that llama-cpp-python's source distribution
  of the installed version vendors (`pip download --no-binary :all:`, CMake, only the `llama-server`
  target, GGML_NATIVE as the node's wheel was built), cached in ~/.cache/darkbloom-bench/
  llama-server-<version>/ — bench only, never a dependency of the node. Run as
  `llama-server -m GGUF -np C -c 2048·C -t T`, T the node's threads (every core), with the node's
  engine settings (its flash attention setting, no repacked weights).

At each C (`--sizes`): C closed-loop clients for `--duration` s, each request asking 128 tokens that
all come (llama-server's `ignore_eos`; the node: `logit_bias` -100 on the model's end-of-generation
tokens), both with the node's default sampling (temperature 0.2, top_p 0.95, top_k 40, min_p 0.05);
aggregate completion tokens per second (from the usage chunk), time to first token p50, and the
server's resident memory (VmRSS, and PSS, over its process tree) at the end of the cell. At C = 4
also: four conversations with ~1,400-token histories (a long system prompt and three turns,
distinct per conversation), first turns answered, then all four second turns at once: their time
to first token; and three running streams while a ~1,900-token prompt arrives: their inter-token
gaps from its send to its last token. `--profile DIR` samples the node with py-spy under the C = 4
load after its cells (bench/profile_summary.py).

Run: .venv/bin/python bench/node_engine.py [--sizes 1,2,4,8] [--duration 20] [--only node|server]
     [--json out.json] [--profile DIR]   (or `make bench-node BENCH_ARGS=…`)
Everything listens on 127.0.0.1; every phase has a timeout; Ctrl-C stops what it started. Record the
tables in bench/RESULTS.md with the date, machine and commit they print.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.profile_summary import cpu_table, record, summarise, thread_cpu  # noqa: E402
from bench.relay_overhead import machine, tree_state  # noqa: E402
from darkbloom.provider.backends.llama_engine import FLASH_ATTENTION_NAME as FLASH_ATTENTION  # noqa: E402
from darkbloom.provider.bundled_model import bundled_gguf_path  # noqa: E402
from tests.support.processes import free_port, wait_until  # noqa: E402

MODEL = "smollm2-135m"
MAX_TOKENS = 128
N_CTX = 2048  # per sequence (the node's default) and per llama-server slot
SAMPLING = {"temperature": 0.2, "top_p": 0.95, "top_k": 40, "min_p": 0.05}  # the node's defaults
HISTORY_TOKENS = 1400
LONG_PROMPT_TOKENS = 1850  # aimed at; the content comes to ~1,890 tokens, ~1,920 with the template (< 2,048)
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "darkbloom-bench"
T = TypeVar("T")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- llama-server: built once per llama-cpp-python version ---------------------------------------

def llama_server_binary(cache: Path = CACHE) -> Path:
    """`llama-server` from the llama.cpp in the installed llama-cpp-python's sdist (built when missing)."""
    version = importlib.metadata.version("llama-cpp-python")
    home = cache / f"llama-server-{version}"
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    sdists = cache / "sdist"
    archive = next(sdists.glob(f"llama_cpp_python-{version}.tar.gz"), None)
    if archive is None:
        say(f"downloading llama-cpp-python {version}'s source distribution from PyPI into {sdists}…")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(sdists)], check=True, timeout=900)
        archive = next(sdists.glob(f"llama_cpp_python-{version}.tar.gz"))
    source = home / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory(dir=cache) as unpacked, tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
            shutil.rmtree(source, ignore_errors=True)
            shutil.move(str(Path(unpacked) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"), source)
    build = home / "build"
    say(f"building llama-server from {source} (CMake, -j2: several minutes on 2 cores; cached afterwards)…")
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True, timeout=600, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"], check=True, timeout=5400)
    return binary


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    line = next((l for l in (out.stdout + out.stderr).splitlines() if l.startswith("version")), "version ?")
    return line.removeprefix("version:").strip()


# --- the two servers ------------------------------------------------------------------------------

@dataclass
class Server:
    name: str  # "node" or "server"
    base_url: str
    headers: dict[str, str]
    pid: int
    exact: dict[str, Any]  # body fields that make it generate all max_tokens
    stop: Callable[[], None] = field(repr=False)
    model: str = MODEL  # the request's "model"


def darkbloom_cmd(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("darkbloom")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "darkbloom.cli", *args]


def start_node(root: Path, gguf: Path, concurrency: int, eog: list[int], *, name: str = "node", model: str = MODEL,
               backend: str | None = None) -> Server:
    """`darkbloom start --local` serving ``gguf`` (or any model path its ``backend`` takes) as ``model``,
    in its own DARKBLOOM_HOME under ``root`` named by ``name`` and C."""
    home = root / f"{name}-c{concurrency}"
    home.mkdir(parents=True)
    env = {**os.environ, "DARKBLOOM_HOME": str(home)}
    env.pop("DARKBLOOM_COORDINATOR", None)

    def stop() -> None:
        subprocess.run(darkbloom_cmd("stop"), env=env, timeout=60, capture_output=True)

    started = subprocess.run(darkbloom_cmd("start", "--local", "--port", str(free_port()), "--max-concurrency",
                                           str(concurrency), "--model", f"{model}={gguf}",
                                           *(["--backend", backend] if backend else [])),
                             env=env, timeout=60, capture_output=True, text=True)
    if started.returncode != 0:
        raise RuntimeError(f"darkbloom start failed: {started.stdout}{started.stderr}")
    try:
        local = wait_until(lambda: (home / "local.json").exists() and json.loads((home / "local.json").read_text()),
                           timeout=120, what="the node's local.json")
        wait_until(lambda: _healthy(local["base_url"].removesuffix("/v1") + "/health"), timeout=60,
                   what="the node's /health")
    except BaseException:
        stop()
        raise
    return Server(name, local["base_url"], {"Authorization": f"Bearer {local['api_key']}"}, int(local["pid"]),
                  {"logit_bias": {str(token): -100 for token in eog}}, stop, model)


def start_llama_server(root: Path, binary: Path, gguf: Path, concurrency: int, threads: int,
                       extra: list[str]) -> Server:
    port = free_port()
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30).stdout
    args = [str(binary), "-m", str(gguf), "-np", str(concurrency), "-c", str(N_CTX * concurrency), "-t", str(threads),
            "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "-fa", FLASH_ATTENTION]
    if "--no-repack" in help_text:
        args.append("--no-repack")
    log = (root / f"llama-server-c{concurrency}.log").open("wb")
    process = subprocess.Popen([*args, *extra], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def stop() -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        log.close()

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited ({process.returncode}); see {log.name}")
        return _healthy(f"http://127.0.0.1:{port}/health")

    try:
        wait_until(up, timeout=120, interval=0.2, what="llama-server's /health")
    except BaseException:
        stop()
        raise
    return Server("server", f"http://127.0.0.1:{port}/v1", {}, process.pid, {"ignore_eos": True}, stop)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def tree_memory_mib(pid: int) -> tuple[float, float]:
    """VmRSS and PSS of ``pid`` and its descendants, MiB (PSS counts a page mapped twice once: the node's
    instances each map the same GGUF)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    rss = pss = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = Path(f"/proc/{current}/status").read_text()
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
        except OSError:
            continue
        rss += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        pss += next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return rss / 1024, pss / 1024


# --- prompts ---------------------------------------------------------------------------------------

class Vocab:
    """The model's tokenizer alone (no weights): token counts, and its end-of-generation tokens."""

    def __init__(self, gguf: Path) -> None:
        import llama_cpp
        from llama_cpp import _internals

        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = _internals.LlamaModel(path_model=str(gguf), params=params, verbose=False)
        vocab = self._model.vocab
        self.eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def count(self, text: str) -> int:
        return len(self._model.tokenize(text.encode(), add_bos=False, special=False))


_NOUNS = ("ledger", "harbour", "valve", "archive", "orchard", "compressor", "invoice", "lantern", "bridge",
          "turbine", "library", "courier", "garden", "furnace", "telescope", "warehouse", "kettle", "signal")
_VERBS = ("inspected", "recorded", "repaired", "labelled", "reported", "replaced", "measured", "cleaned", "sealed",
          "counted")
_ADJECTIVES = ("northern", "spare", "copper", "weekly", "damaged", "quiet", "red", "second", "narrow", "old")
_TIMES = ("before noon", "every Monday", "after each storm", "at the end of the shift", "twice a month",
          "before the audit", "when the bell rings", "on the first of the month")


def handbook(rng: random.Random, name: str, tokens: int, vocab: Vocab) -> str:
    """Numbered rules of an invented handbook, about ``tokens`` tokens, different for every seed."""
    lines, count = [f"You are the assistant of {name}. Answer from this handbook only."], 0
    while count < tokens:
        line = (f"Rule {len(lines)}: the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} must be "
                f"{rng.choice(_VERBS)} by the {rng.choice(_NOUNS)} team {rng.choice(_TIMES)}, "
                f"and {rng.randint(2, 99)} copies go to the {rng.choice(_NOUNS)} office.")
        lines.append(line)
        count += vocab.count("\n" + line)
    return "\n".join(lines)


def conversation(number: int, vocab: Vocab, tokens: int = HISTORY_TOKENS) -> list[dict[str, str]]:
    """A ~1,400-token (``tokens``) history: a long system prompt, three turns, and the next question."""
    rng = random.Random(number)
    name = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} company no. {number}"
    turns: list[dict[str, str]] = []
    for _ in range(3):
        noun = rng.choice(_NOUNS)
        turns += [{"role": "user", "content": f"Who handles the {noun}, and how often? Give the rule number."},
                  {"role": "assistant", "content": f"The {noun} is handled by the {rng.choice(_NOUNS)} team "
                   f"{rng.choice(_TIMES)}, as rule {rng.randint(1, 40)} says; {rng.randint(2, 99)} copies of the "
                   f"report go to the {rng.choice(_NOUNS)} office."}]
    question = {"role": "user", "content": f"Which rules mention the {rng.choice(_NOUNS)}? List them briefly."}
    rest = sum(vocab.count(m["content"]) + 4 for m in (*turns, question)) + 10
    return [{"role": "system", "content": handbook(rng, name, tokens - rest, vocab)}, *turns, question]


def long_prompt(vocab: Vocab) -> list[dict[str, str]]:
    text = handbook(random.Random(10_000), "a long document", LONG_PROMPT_TOKENS - 20, vocab)
    return [{"role": "user", "content": f"Summarise this handbook in one sentence.\n\n{text}"}]


# --- the client ------------------------------------------------------------------------------------

@dataclass
class Stream:
    started: float = 0.0
    first: float | None = None  # perf_counter of the first content chunk
    ended: float | None = None
    arrivals: list[float] = field(default_factory=list)  # of every content chunk
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens

    @property
    def ttft(self) -> float:
        assert self.first is not None, "no content"
        return self.first - self.started


async def chat(client: httpx.AsyncClient, server: Server, messages: list[dict[str, str]], max_tokens: int,
               into: Stream | None = None) -> Stream:
    """One streamed chat completion; ``into`` fills as it comes (for a stream cancelled midway)."""
    out = into or Stream()
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING, **server.exact}
    out.started = time.perf_counter()
    async with client.stream("POST", f"{server.base_url}/chat/completions", json=body,
                             headers=server.headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{server.name}: {event['error']}")
            now = time.perf_counter()
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    out.first = out.first or now
                    out.arrivals.append(now)
                    out.text += content
            if event.get("usage"):
                out.completion_tokens = event["usage"].get("completion_tokens", 0)
                out.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                out.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out.ended = time.perf_counter()
    return out


def story(client_number: int, request: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {client_number}-{request}. Write a long story about a "
             "lighthouse keeper who finds a message in a bottle."}]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def closed_loop(client: httpx.AsyncClient, server: Server, concurrency: int, duration: float) -> list[Stream]:
    """``concurrency`` clients, each starting its next request as the last ends, until ``duration`` s."""
    deadline = time.perf_counter() + duration
    done: list[Stream] = []

    async def one_client(number: int) -> None:
        request = 0
        while time.perf_counter() < deadline:
            done.append(await chat(client, server, story(number, request), MAX_TOKENS))
            request += 1

    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    return done


async def throughput(client: httpx.AsyncClient, server: Server, concurrency: int, duration: float) -> dict[str, Any]:
    await asyncio.gather(*(chat(client, server, story(-1, i), 16) for i in range(concurrency)))  # every instance/slot
    started = time.perf_counter()
    streams = await closed_loop(client, server, concurrency, duration)
    if not all(s.completion_tokens for s in streams):
        raise RuntimeError(f"{server.name}: a stream without a usage chunk")
    span = max(s.ended or 0.0 for s in streams) - started
    tokens = sum(s.completion_tokens for s in streams)
    return {"tokens_per_s": tokens / span, "requests": len(streams), "seconds": span,
            "tokens_per_request": tokens / len(streams),
            "ttft_p50_ms": statistics.median(s.ttft for s in streams) * 1e3,
            **dict(zip(("rss_mib", "pss_mib"), tree_memory_mib(server.pid)))}


async def second_turn(client: httpx.AsyncClient, server: Server, vocab: Vocab, rounds: int) -> dict[str, Any]:
    """Four conversations answer their first turn together, then send their second turn together."""
    first: list[Stream] = []
    second: list[Stream] = []
    for round_number in range(rounds):
        histories = [conversation(100 * round_number + k, vocab) for k in range(4)]
        answers = await asyncio.gather(*(chat(client, server, h, 32) for h in histories))
        for history, answer in zip(histories, answers):
            history += [{"role": "assistant", "content": answer.text},
                        {"role": "user", "content": "Thank you. Now which team is busiest, by that list?"}]
        first += answers
        second += await asyncio.gather(*(chat(client, server, h, 16) for h in histories))
    return {"first_ttft_p50_ms": statistics.median(s.ttft for s in first) * 1e3,
            "second_ttft_p50_ms": statistics.median(s.ttft for s in second) * 1e3,
            "second_ttft_max_ms": max(s.ttft for s in second) * 1e3,
            "first_prompt_tokens": statistics.median(s.prompt_tokens for s in first),
            "second_prompt_tokens": statistics.median(s.prompt_tokens for s in second)}


async def interference(client: httpx.AsyncClient, server: Server, vocab: Vocab) -> dict[str, Any]:
    """Three streams running; a long prompt arrives: their inter-token gaps from its send to its end."""
    streams = [Stream() for _ in range(3)]
    tasks = [asyncio.create_task(chat(client, server, story(200 + i, 0), 1500, s)) for i, s in enumerate(streams)]
    try:
        await asyncio.sleep(2)
        while min(len(s.arrivals) for s in streams) < 20:
            if any(t.done() for t in tasks):
                raise RuntimeError(f"{server.name}: a running stream ended early")
            await asyncio.sleep(0.05)
        long = await chat(client, server, long_prompt(vocab), 16)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert long.ended is not None and long.first is not None

    def gaps(low: float, high: float) -> list[float]:
        return [(b - a) * 1e3 for s in streams for a, b in zip(s.arrivals, s.arrivals[1:]) if low < b <= high]

    during, before = gaps(long.started, long.ended), gaps(long.started - 2, long.started)
    return {"itl_p99_ms": percentile(during, 0.99), "itl_p50_ms": statistics.median(during), "itl_max_ms": max(during),
            "gaps": len(during), "before_p99_ms": percentile(before, 0.99), "before_p50_ms": statistics.median(before),
            "long_ttft_ms": long.ttft * 1e3, "long_prompt_tokens": long.prompt_tokens}


async def profile_node(client: httpx.AsyncClient, server: Server, seconds: float, out: Path,
                       buckets: dict[str, str] | None = None) -> str:
    """py-spy on the node under the C = 4 load: thread CPU and a GIL pass, then a native pass
    (``buckets``: bench/profile_summary.py's summarise, for both passes)."""
    out.mkdir(parents=True, exist_ok=True)
    load = asyncio.create_task(closed_loop(client, server, 4, 2 * seconds + 6))
    try:
        await asyncio.sleep(2)
        before, since = thread_cpu(server.pid), time.perf_counter()
        raws: list[str] = []
        for mode in ("gil", "native"):
            spy = record(server.pid, seconds, out / f"{server.name}-c4-{mode}.raw", mode)
            _, err = await asyncio.to_thread(spy.communicate, timeout=seconds + 60)
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')}")
            raws.append((out / f"{server.name}-c4-{mode}.raw").read_text())
            if mode == "gil":
                after, spent = thread_cpu(server.pid), time.perf_counter() - since
        cpu = cpu_table(before, after, spent, raws)  # thread names from both passes: a thread idle in one is named
    finally:
        await asyncio.wait_for(load, timeout=120)
    return (f"CPU per thread over the GIL pass:\n\n{cpu}\nGIL pass:\n\n{summarise(raws[0], buckets=buckets)}\n"
            f"Native pass (C frames):\n\n{summarise(raws[1], top=10, buckets=buckets)}")


async def bounded(phase: Awaitable[T], seconds: float, what: str) -> T:
    try:
        return await asyncio.wait_for(phase, timeout=seconds)
    except asyncio.TimeoutError:
        raise RuntimeError(f"{what} took longer than {seconds:.0f} s") from None


async def session(server: Server, concurrency: int, args: argparse.Namespace, vocab: Vocab) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits, trust_env=False) as client:
        cell = await bounded(throughput(client, server, concurrency, args.duration), args.duration + 300,
                             f"{server.name} at C={concurrency}")
        if concurrency == 4:
            cell |= await bounded(second_turn(client, server, vocab, args.rounds), 600, f"{server.name}'s second turns")
            cell |= await bounded(interference(client, server, vocab), 300, f"{server.name}'s long prompt")
            if args.profile and server.name == "node":
                cell["profile"] = await bounded(profile_node(client, server, 10, args.profile), 300, "the profile")
        return cell


# --- tables ----------------------------------------------------------------------------------------

def table(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int], key: str, head: str, digits: int,
          rows: list[tuple[str, str]] | None = None) -> str:
    """One metric: node, llama-server, node ÷ server, per C (or per ``rows`` of (label, key) at C = 4)."""
    def value(name: str, c: int, k: str) -> float | None:
        return results.get(name, {}).get(c, {}).get(k)

    lines = [f"| {head} | node | llama-server | node ÷ server |", "|---|---|---|---|"]
    for label, c, k in ([(f"C={c}", c, key) for c in sizes] if rows is None else [(l, 4, k) for l, k in rows]):
        node, server = value("node", c, k), value("server", c, k)
        cells = [f"{v:,.{digits}f}" if v is not None else "—" for v in (node, server)]
        ratio = f"{node / server:.2f}" if node is not None and server else "—"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def report(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int]) -> str:
    out = ["Aggregate completion tokens/s (C closed-loop clients, 128 tokens per request):", "",
           table(results, sizes, "tokens_per_s", "C", 1), "",
           "Tokens per request (check: 128 when every request ran to max_tokens):", "",
           table(results, sizes, "tokens_per_request", "C", 1), "",
           "Time to first token, p50, ms:", "", table(results, sizes, "ttft_p50_ms", "C", 0), "",
           "Resident memory at the end of the cell (VmRSS over the process tree), MiB:", "",
           table(results, sizes, "rss_mib", "C", 0), "",
           "The same as PSS (a page mapped twice, as each node instance maps the GGUF, counts once), MiB:", "",
           table(results, sizes, "pss_mib", "C", 0)]
    if 4 in sizes and any(4 in r and "second_ttft_p50_ms" in r[4] for r in results.values()):
        out += ["", "Four conversations, ~1,400-token histories, all four second turns at once (C=4), ms:", "",
                table(results, sizes, "", "C=4", 0, [("2nd turn: time to first token, p50", "second_ttft_p50_ms"),
                                                     ("2nd turn: slowest", "second_ttft_max_ms"),
                                                     ("1st turn: time to first token, p50", "first_ttft_p50_ms"),
                                                     ("2nd turn's prompt, tokens (median)", "second_prompt_tokens")]),
                "", "Three running streams while a long prompt arrives (C=4), ms:", "",
                table(results, sizes, "", "C=4", 1, [("inter-token p99, from its send to its end", "itl_p99_ms"),
                                                     ("inter-token p50, same window", "itl_p50_ms"),
                                                     ("longest gap, same window", "itl_max_ms"),
                                                     ("inter-token p99, the 2 s before", "before_p99_ms"),
                                                     ("inter-token p50, the 2 s before", "before_p50_ms"),
                                                     ("the long prompt's time to first token", "long_ttft_ms"),
                                                     ("the long prompt, tokens", "long_prompt_tokens")])]
    return "\n".join(out)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="concurrencies C, comma-separated")
    parser.add_argument("--duration", type=float, default=20, help="seconds of closed-loop load per cell")
    parser.add_argument("--only", choices=("node", "server"), help="run one of the two")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four conversations (C=4)")
    parser.add_argument("--json", type=Path, help="write every number here too")
    parser.add_argument("--profile", type=Path, help="py-spy the node under the C=4 load into this directory")
    parser.add_argument("--server-arg", action="append", default=[], help="one more llama-server argument")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    signal.signal(signal.SIGTERM, _interrupted)
    gguf = bundled_gguf_path()
    vocab = Vocab(gguf)
    names = [n for n in ("node", "server") if args.only in (None, n)]
    binary = llama_server_binary() if "server" in names else None
    cores = os.cpu_count() or 1
    threads = cores  # LlamaCppBackend's n_threads: every core, one engine
    head = (f"bench/node_engine.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}; "
            f"{tree_state()}\ndarkbloom {importlib.metadata.version('darkbloom')}, llama-cpp-python "
            f"{importlib.metadata.version('llama-cpp-python')}"
            + (f", llama-server from its sdist ({server_version(binary)}; {binary})" if binary else "")
            + f"\n{gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB); {args.duration:g} s per cell, max_tokens "
            f"{MAX_TOKENS}; node and llama-server threads {threads}; llama-server -c 2048·C, -fa "
            f"{FLASH_ATTENTION}, no repack")
    say(head)
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-engine-"))
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    started = time.monotonic()
    for index, concurrency in enumerate(sizes):
        for name in (names if index % 2 == 0 else names[::-1]):  # alternate who goes first
            say(f"[{time.monotonic() - started:4.0f} s] {name} at C={concurrency}: starting…")
            if name == "node":
                server = start_node(root, gguf, concurrency, vocab.eog)
            else:
                assert binary is not None
                server = start_llama_server(root, binary, gguf, concurrency, threads, args.server_arg)
            try:
                results[name][concurrency] = asyncio.run(session(server, concurrency, args, vocab))
            finally:
                server.stop()
            cell = results[name][concurrency]
            say(f"[{time.monotonic() - started:4.0f} s] {name} at C={concurrency}: "
                f"{cell['tokens_per_s']:.1f} tokens/s, TTFT p50 {cell['ttft_p50_ms']:.0f} ms, "
                f"{cell['rss_mib']:.0f} MiB")
    print(head)
    print()
    print(report(results, sizes))
    profile = results.get("node", {}).get(4, {}).pop("profile", None)
    if profile:
        print(f"\n### py-spy: the node under the C=4 load\n\n{profile}")
    if args.json:
        args.json.write_text(json.dumps({"head": head, "results": results}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
