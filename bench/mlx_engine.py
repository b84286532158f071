"""MLX on the CPU beside llama.cpp on the CPU: the node's two in-process backends, same model, same cores,
one run.

Not a race MLX is meant to win here (MLX's CPU build is its fallback; its home is Apple silicon's GPU):
the figure, so the MLX backend's cost off a Mac is known. Both nodes are started one after the other
as bench/node_engine.py starts its node (`darkbloom start --local --port P --max-concurrency C` in
their own DARKBLOOM_HOME, `darkbloom stop` after), and driven by its client:

- `--backend llama-cpp` on the bundled SmolLM2-135M GGUF (Q4_1);
- `--backend mlx --model smollm2-135m-mlx=DIR`, DIR that GGUF converted to MLX and dequantized
  (tests/support/mlx_model.py, cached under ~/.cache/darkbloom-tests; `--dtype` bfloat16, the
  default, or float32).

At each C (`--sizes`): C closed-loop streamed-chat clients for `--duration` s, each request asking
128 tokens that all come (`logit_bias` -100 on the end-of-generation tokens), the node's default
sampling: aggregate completion tokens per second (usage chunks), time to first token p50, VmRSS and
PSS over the node's process tree at the end of the cell, and MLX ÷ llama.cpp. At the first C also
"prefix reuse": `--rounds` conversations with ~1,000-token histories, one after the other, each a
first turn and then its second: the second turn's time to first token and `cached_tokens`.
`--profile DIR` then samples an MLX node at C = 4 with py-spy (bench/profile_summary.py: thread
CPU, a GIL pass and a native pass, and the share of samples in mlx-lm's step, the rest of our engine
thread, and the event loop).

Run: .venv/bin/python bench/mlx_engine.py [--sizes 1,4] [--duration 20] [--dtype bfloat16|float32]
     [--only llama-cpp|mlx] [--json out.json] [--profile DIR]   (or `make bench-mlx BENCH_ARGS=…`)
Everything listens on 127.0.0.1; every phase has a timeout; Ctrl-C stops what it started. Record the
tables in bench/RESULTS.md with the date, machine and commit they print.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.node_engine import (MAX_TOKENS, MODEL, Server, Stream, Vocab, _interrupted, bounded, chat,  # noqa: E402
                               conversation, darkbloom_cmd, profile_node, say, start_node, throughput)
from bench.relay_overhead import machine, tree_state  # noqa: E402
from darkbloom.provider.bundled_model import bundled_gguf_path  # noqa: E402
from tests.support.mlx_model import converted_smollm2  # noqa: E402

MLX_MODEL = f"{MODEL}-mlx"
BACKENDS = ("llama-cpp", "mlx")
PREFIX_TOKENS = 1000  # the conversation's history before its first answer
PROFILE_SECONDS = 10  # per py-spy pass
# Share of py-spy samples whose collapsed stack passes through each (overlapping by design).
PROFILE_BUCKETS = {
    "the engine thread (mlx-<model>)": r"^thread \([^)]*\): mlx-",
    "… in mlx-lm's BatchGenerator step (mlx_lm/generate.py)": r"mlx_lm/generate\.py",
    "… … in the model's forward pass (mlx_lm/models/)": r"mlx_lm/models/",
    "… in our engine's token hand-off (MlxEngine._advance: TextStream, chunks)": r"\b_advance \([^)]*mlx_engine",
    "… in our engine's admission (prompt cache, insert)": r"\b_admit \([^)]*mlx_engine",
    "the event loop thread (MainThread)": r"^thread \([^)]*\): MainThread",
    "the backend's executor threads waiting for work (prompt_N; idle, py-spy counts them)":
        r"^thread \([^)]*\): prompt_[^;]*;.*SimpleQueue_get",
}
NATIVE_NOTE = ("`other threads` are threads py-spy never saw with a Python frame: MLX's CPU stream thread "
               "(where the model's arithmetic runs; the engine thread waits on it inside `mx.eval`) among them.")


def start(name: str, root: Path, model_path: Path, concurrency: int, eog: list[int]) -> Server:
    if name == "mlx":
        return start_node(root, model_path, concurrency, eog, name=name, model=MLX_MODEL, backend="mlx")
    return start_node(root, model_path, concurrency, eog, name=name, backend="llama-cpp")


async def prefix_reuse(client: httpx.AsyncClient, server: Server, vocab: Vocab, rounds: int) -> dict[str, Any]:
    """``rounds`` conversations with ~1,000-token histories, one after the other: a first turn, then its second."""
    first: list[Stream] = []
    second: list[Stream] = []
    for number in range(rounds):
        history = conversation(500 + number, vocab, PREFIX_TOKENS)
        answer = await chat(client, server, history, 32)
        history += [{"role": "assistant", "content": answer.text},
                    {"role": "user", "content": "Thank you. Now which team is busiest, by that list?"}]
        first.append(answer)
        second.append(await chat(client, server, history, 16))
    return {"prefix_first_ttft_ms": statistics.median(s.ttft for s in first) * 1e3,
            "prefix_second_ttft_ms": statistics.median(s.ttft for s in second) * 1e3,
            "prefix_first_prompt_tokens": statistics.median(s.prompt_tokens for s in first),
            "prefix_first_cached_tokens": statistics.median(s.cached_tokens for s in first),
            "prefix_second_prompt_tokens": statistics.median(s.prompt_tokens for s in second),
            "prefix_second_cached_tokens": statistics.median(s.cached_tokens for s in second)}


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits, trust_env=False)


async def session(server: Server, concurrency: int, args: argparse.Namespace, vocab: Vocab,
                  prefix: bool) -> dict[str, Any]:
    async with client() as http:
        cell = await bounded(throughput(http, server, concurrency, args.duration), args.duration + 300,
                             f"{server.name} at C={concurrency}")
        if prefix:
            cell |= await bounded(prefix_reuse(http, server, vocab, args.rounds), 60 + 240 * args.rounds,
                                  f"{server.name}'s prefix reuse")
        return cell


async def profiled(server: Server, out: Path) -> str:
    async with client() as http:
        await bounded(throughput(http, server, 4, 3), 300, "the profile's warm-up")
        profile = await bounded(profile_node(http, server, PROFILE_SECONDS, out, PROFILE_BUCKETS), 300, "the profile")
        return f"{NATIVE_NOTE}\n\n{profile}"


# --- tables ----------------------------------------------------------------------------------------

ROWS = [("completion tokens/s", "tokens_per_s", 1), ("tokens per request (128: all came)", "tokens_per_request", 1),
        ("requests", "requests", 0), ("time to first token p50, ms", "ttft_p50_ms", 0),
        ("VmRSS over the process tree, MiB", "rss_mib", 0), ("PSS over the process tree, MiB", "pss_mib", 0)]
PREFIX_ROWS = [("1st turn: time to first token p50, ms", "prefix_first_ttft_ms", 0),
               ("1st turn: prompt tokens / cached_tokens (median)", ("prefix_first_prompt_tokens",
                                                                      "prefix_first_cached_tokens"), 0),
               ("2nd turn: time to first token p50, ms", "prefix_second_ttft_ms", 0),
               ("2nd turn: prompt tokens / cached_tokens (median)", ("prefix_second_prompt_tokens",
                                                                      "prefix_second_cached_tokens"), 0)]


def table(cells: dict[str, dict[str, Any]], rows: list[tuple[str, Any, int]], head: str, dtype: str) -> str:
    """Rows of metrics: llama.cpp, MLX and MLX ÷ llama.cpp."""
    lines = [f"| {head} | llama.cpp (GGUF Q4_1) | MLX ({dtype}) | MLX ÷ llama.cpp |", "|---|---|---|---|"]
    for label, key, digits in rows:
        values = [cells.get(name) for name in BACKENDS]
        if isinstance(key, tuple):
            shown = ["—" if v is None else " / ".join(f"{v[k]:,.{digits}f}" for k in key) for v in values]
            ratio = "—"
        else:
            numbers = [None if v is None else v.get(key) for v in values]
            shown = ["—" if n is None else f"{n:,.{digits}f}" for n in numbers]
            ratio = f"{numbers[1] / numbers[0]:.2f}" if None not in numbers and numbers[0] else "—"
        lines.append(f"| {label} | {shown[0]} | {shown[1]} | {ratio} |")
    return "\n".join(lines)


def report(results: dict[str, dict[int, dict[str, Any]]], sizes: list[int], dtype: str) -> str:
    out = []
    for c in sizes:
        cells = {name: results[name][c] for name in BACKENDS if c in results.get(name, {})}
        out += [f"C={c}: {c} closed-loop streamed-chat client(s), {MAX_TOKENS} tokens per request:", "",
                table(cells, ROWS, f"C={c}", dtype), ""]
    first = {name: results[name][sizes[0]] for name in BACKENDS if sizes[0] in results.get(name, {})}
    if any("prefix_second_ttft_ms" in cell for cell in first.values()):
        out += [f"Prefix reuse (node at C={sizes[0]}, idle): conversations with ~{PREFIX_TOKENS:,}-token histories, "
                "one after the other; the second turn's prompt is the first's plus its answer and a question:", "",
                table(first, PREFIX_ROWS, "prefix reuse", dtype), ""]
    return "\n".join(out)


def stop_leftovers(root: Path) -> None:
    """`darkbloom stop` in every home under ``root``: a node whose start was interrupted midway."""
    for home in root.iterdir():
        if home.is_dir():
            subprocess.run(darkbloom_cmd("stop"), env={**os.environ, "DARKBLOOM_HOME": str(home)}, timeout=60,
                           capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="concurrencies C, comma-separated")
    parser.add_argument("--duration", type=float, default=20, help="seconds of closed-loop load per cell")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the MLX model's dtype (the GGUF converted and dequantized)")
    parser.add_argument("--only", choices=BACKENDS, help="run one of the two")
    parser.add_argument("--rounds", type=int, default=3, help="conversations of the prefix-reuse row")
    parser.add_argument("--json", type=Path, help="write every number here too")
    parser.add_argument("--profile", type=Path, help="py-spy an MLX node under a C=4 load into this directory")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    signal.signal(signal.SIGTERM, _interrupted)
    gguf = bundled_gguf_path()
    vocab = Vocab(gguf)
    names = [n for n in BACKENDS if args.only in (None, n)]
    say(f"the MLX model: the bundled GGUF converted to {args.dtype} (once; cached)…")
    mlx_dir = converted_smollm2(args.dtype)
    paths = {"llama-cpp": gguf, "mlx": mlx_dir}
    mlx_mib = sum(f.stat().st_size for f in mlx_dir.glob("*.safetensors")) / 2**20
    head = (f"bench/mlx_engine.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}; "
            f"{tree_state()}\ndarkbloom {importlib.metadata.version('darkbloom')}, llama-cpp-python "
            f"{importlib.metadata.version('llama-cpp-python')}, mlx {importlib.metadata.version('mlx')}, mlx-lm "
            f"{importlib.metadata.version('mlx-lm')}\nllama.cpp: {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB); "
            f"MLX: the same converted to {args.dtype} ({mlx_mib:.0f} MiB of weights; {mlx_dir.name}); "
            f"{args.duration:g} s per cell, max_tokens {MAX_TOKENS}, the node's default sampling")
    say(head)
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-mlx-"))
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in names}
    profile = None
    started = time.monotonic()
    try:
        for index, concurrency in enumerate(sizes):
            for name in (names if index % 2 == 0 else names[::-1]):  # alternate who goes first
                say(f"[{time.monotonic() - started:4.0f} s] {name} at C={concurrency}: starting…")
                server = start(name, root, paths[name], concurrency, vocab.eog)
                try:
                    results[name][concurrency] = asyncio.run(session(server, concurrency, args, vocab, index == 0))
                finally:
                    server.stop()
                cell = results[name][concurrency]
                say(f"[{time.monotonic() - started:4.0f} s] {name} at C={concurrency}: "
                    f"{cell['tokens_per_s']:.1f} tokens/s, {cell['tokens_per_request']:.0f} tokens/request, "
                    f"TTFT p50 {cell['ttft_p50_ms']:.0f} ms, {cell['rss_mib']:.0f} MiB")
        if args.profile and "mlx" in names:
            say(f"[{time.monotonic() - started:4.0f} s] mlx at C=4 under py-spy ({2 * PROFILE_SECONDS} s)…")
            server = start("mlx", root / "profile", mlx_dir, 4, vocab.eog)
            try:
                profile = asyncio.run(profiled(server, args.profile))
            finally:
                server.stop()
    except BaseException:
        stop_leftovers(root)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(head)
    print()
    print(report(results, sizes, args.dtype))
    if profile:
        print(f"### py-spy: the MLX node ({args.dtype}) under a C=4 load\n\n{profile}")
    if args.json:
        args.json.write_text(json.dumps({"head": head, "dtype": args.dtype, "results": results, "profile": profile},
                                        indent=1))


if __name__ == "__main__":
    main()
