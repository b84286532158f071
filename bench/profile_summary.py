"""Sample a running process with py-spy and say where its time goes.

py-spy's own idle detection misreads this process (a thread blocked in ``SimpleQueue.get`` or in
SQLite's busy-wait sleep counts as busy), so a profile is two passes plus the kernel's books:

- ``record(pid, s, out, "gil")``: only samples whose thread holds the GIL, i.e. Python doing work
  (on the coordinator that is the event loop thread, plus aiosqlite threads between C calls);
- ``record(pid, s, out, "native")``: every thread py-spy calls active, with C frames, so waits
  show as what they are (``clock_nanosleep`` is SQLite's busy handler, ``epoll_pwait`` the loop);
- ``thread_cpu(pid)`` before and after: CPU seconds per OS thread from /proc, the ground truth.

``summarise(raw)`` turns collapsed stacks into markdown: share of samples per thread group, per
module of the innermost frame ("self"), per function ("self"), and the darkbloom and framework
functions the most samples pass through ("inclusive"). With uvloop, a sample whose innermost
Python frame is ``asyncio.runners.Runner.run`` is inside the C event loop (I/O, protocol callbacks).

Run alone on a saved profile: python bench/profile_summary.py FILE.raw [--top N]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")
_INCLUSIVE_PREFIXES = ("darkbloom", "uvicorn", "starlette", "fastapi", "pydantic", "sqlalchemy",
                       "aiosqlite", "websockets", "httpx", "httpcore", "nacl", "json")


def py_spy() -> str:
    local = Path(sys.executable).with_name("py-spy")
    found = str(local) if local.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is missing: `pip install -e '.[bench]'` (make bench) installs it")
    return found


def record(pid: int, seconds: float, out: Path, mode: str = "gil", rate: int = 100) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` for ``seconds`` (mode ``gil`` or ``native``); wait on the returned
    process before reading ``out``."""
    args = [py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
            "--rate", str(rate), "--format", "raw", "--threads", f"--{mode}", "--output", str(out)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each OS thread of ``pid`` so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def cpu_table(before: dict[int, float], after: dict[int, float], seconds: float, raws: list[str]) -> str:
    """Share of one core per thread group over the window; names come from py-spy's thread labels."""
    names = {}
    for raw in raws:
        for label in re.findall(r"^thread \((\d+)\): ([^;]*)", raw, re.M):
            names[int(label[0])] = _group(label[1])
    groups: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for tid, spent in after.items():
        name = names.get(tid, "other threads")
        groups[name] += spent - before.get(tid, 0.0)
        counts[name] += 1
    rows = ["| thread group | threads | CPU, % of one core |", "|---|---|---|"]
    rows += [f"| `{name}` | {counts[name]} | {100 * spent / seconds:.0f} % |" for name, spent in groups.most_common()]
    rows.append(f"| total | {sum(counts.values())} | {100 * sum(groups.values()) / seconds:.0f} % |")
    return "\n".join(rows) + "\n"


def _group(label: str) -> str:
    return re.sub(r"^Thread-\d+ ", "", label.strip()) or "?"


def module_of(file: str) -> str:
    """A dotted module name for a frame's file: darkbloom.wire.protocol, starlette.routing, asyncio.base_events."""
    path = file.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/", "/src/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        path = re.sub(r"^.*/lib/python3\.\d+/", "", path)
    parts = [p for p in path.removesuffix(".py").split("/") if p]
    if parts and parts[-1] == "__init__":
        parts.pop()
    depth = 3 if parts and parts[0] == "darkbloom" else 2
    return ".".join(parts[:depth]) or file


def _native(file: str) -> bool:
    return file.endswith((".c", ".h", ".hpp", ".cpp", ".cc", ".rs")) or ".so" in file


def parse(raw: str) -> list[tuple[str, list[tuple[str, str, bool]], int]]:
    """(thread group, frames outermost first as (function, module, is Python), count) per stack."""
    stacks = []
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        names = stack.split(";")
        thread = _group(names[0].split(": ", 1)[-1]) if names and names[0].startswith("thread") else "?"
        frames = []
        for name in names:
            match = _FRAME.match(name)
            if match:
                func = "?" if match["func"].startswith("0x") else match["func"]
                frames.append((func, module_of(match["file"]), not _native(match["file"])))
        stacks.append((thread, frames, int(count)))
    return stacks


def summarise(raw: str, top: int = 12, buckets: dict[str, str] | None = None) -> str:
    """Markdown tables; ``buckets`` (name → regex on the whole collapsed stack) adds one more:
    the share of samples whose stack matches each, overlapping by design."""
    if buckets:
        lines = [line.rpartition(" ") for line in raw.splitlines()]
        counted = [(stack, int(n)) for stack, _, n in lines if n.isdigit()]
        total = sum(n for _, n in counted) or 1
        shares = Counter({name: sum(n for stack, n in counted if re.search(rx, stack))
                          for name, rx in buckets.items()})
        head = ["| stack passes through (overlapping) | share |", "|---|---|"]
        head += [f"| {name} | {100 * n / total:.1f} % |" for name, n in shares.most_common() if n]
        return summarise(raw, top) + "\n".join(head) + "\n"
    stacks = parse(raw)
    total = sum(count for _, _, count in stacks)
    if not total:
        return "(no samples)\n"
    threads: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    python_leaf: Counter[str] = Counter()
    for thread, frames, count in stacks:
        threads[thread] += count
        if not frames:
            continue
        func, module, _ = frames[-1]
        modules[module] += count
        functions[f"{module}.{func}"] += count
        python = [f"{m}.{f}" for f, m, is_py in frames if is_py]
        if not frames[-1][2]:
            python_leaf[f"{python[-1] if python else '(no Python frame)'} → {module}.{func}"] += count
        for name in {f"{m}.{f}" for f, m, _ in frames if m.startswith(_INCLUSIVE_PREFIXES)}:
            inclusive[name] += count

    def table(title: str, counter: Counter[str]) -> list[str]:
        rows = [f"| {title} | share |", "|---|---|"]
        rows += [f"| `{name}` | {100 * n / total:.1f} % |" for name, n in counter.most_common(top)]
        return rows + [""]

    out = [f"{total} samples.", ""]
    out += table("thread group", threads)
    out += table("module (self)", modules)
    out += table("function (self)", functions)
    if python_leaf:
        out += table("innermost Python frame → native leaf", python_leaf)
    everywhere = {name for name, n in inclusive.items() if n > 0.9 * total}  # entry points: cli, server.run
    ours = Counter({k: n for k, n in inclusive.items() if k.startswith("darkbloom") and k not in everywhere})
    theirs = Counter({k: n for k, n in inclusive.items() if not k.startswith("darkbloom") and k not in everywhere})
    out += table("darkbloom function (inclusive)", ours)
    out += table("library function (inclusive)", theirs)
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print(summarise(args.raw.read_text(), args.top))


if __name__ == "__main__":
    main()
