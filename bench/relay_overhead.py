"""What the coordinator itself costs: the same fixed-response upstream (bench/fixed_upstream.py, a
benchmark fake that answers at once, so the model costs nothing) called directly, through
coordinator + provider node as a paid request, and through them with `X-Darkbloom-Route: self`;
non-streaming and streaming; every path driven by wrk (a Python load generator saturates long
before the relay does), same machine, same run, the paths of one cell right after each other.

Rows: c=1 p50/p99 (and the latency added over direct), c=16 and c=64 throughput, each also as a
ratio to direct, and the CPU time the coordinator and the node spent per request at c=16 and c=64
(from /proc: the figure that moves least when other work shares the machine). ``--rounds N`` repeats the whole table (odd rounds in reverse path order) and ends
with median (min–max) per cell; ``--variant LABEL=DIR`` adds a stack running another copy of src/
(bench/variant.py) beside the working tree's, for A/B in one run; ``--profile DIR`` then samples
the coordinator and the node with py-spy under load (c=16 unless --profile-concurrency).

Run: .venv/bin/python bench/relay_overhead.py [--duration S] [--rounds N] [--variant L=DIR] [--profile DIR]
(or `make bench BENCH_ARGS="--rounds 2"`). Everything listens on 127.0.0.1; every wrk run is bounded
by --duration. Record the table in bench/RESULTS.md with the date, machine and commit it prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_stack import BODY, Stack, check, profile, start_stack  # noqa: E402
from bench.wrk_load import WrkResult, WrkTarget, run_wrk, wrk_binary  # noqa: E402
from tests.support.processes import start_fixed_upstream  # noqa: E402

MODES = ("plain", "stream")
Cells = dict[tuple[str, str, int], WrkResult]  # (path, mode, concurrency)
CpuCells = dict[tuple[str, str, int], tuple[float, float]]  # CPU ms per request: coordinator, node


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_sleeps(pid: int) -> int:
    """How often the main thread of ``pid`` (its event loop) has gone to sleep so far: its voluntary
    context switches. Per request, how many times the loop woke for it (fewer when events batch)."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "?")
    return f"{platform.machine()}, {os.cpu_count()} cores, {model}"


def tree_state() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--", "src", "pyproject.toml").splitlines()
    state = f"{len(changed)} uncommitted file(s) under src/ and pyproject.toml" if changed else "clean"
    return f"commit {git('rev-parse', '--short', 'HEAD')}, working tree {state}"


def label(path: str) -> str:
    kind, _, variant = path.partition("@")
    name = {"direct": "fixed-response upstream, direct", "paid": "coordinator + node, paid",
            "self": "coordinator + node, `X-Darkbloom-Route: self`"}[kind]
    return f"{name} [{variant}]" if variant else name


def run_round(targets: dict[str, dict[str, WrkTarget]], pids: dict[str, tuple[int, int]], scripts: Path,
              concurrencies: list[int], duration: float, warmup: float, reverse: bool,
              cpu: CpuCells) -> Cells:
    cells: Cells = {}
    for mode in MODES:
        paths = list(targets[mode])
        order = paths[:1] + (paths[:0:-1] if reverse else paths[1:])  # direct first in every cell
        for path in order:
            target = targets[mode][path]
            run_wrk(target, target.script(scripts), 16, warmup)
        for conc in concurrencies:
            for path in order:
                target = targets[mode][path]
                before = [process_cpu(pid) for pid in pids.get(path, ())]
                result = run_wrk(target, target.script(scripts), conc, duration)
                cells[(path, mode, conc)] = result
                if before and result.requests:
                    spent = [process_cpu(pid) - b for pid, b in zip(pids[path], before)]
                    cpu[(path, mode, conc)] = (1e3 * spent[0] / result.requests, 1e3 * spent[1] / result.requests)
                print(f"  {mode:6} c={conc:<3} {path:14} {result.rps:9.1f} req/s  p50 {result.p50_ms:8.2f} ms  "
                      f"p99 {result.p99_ms:8.2f} ms  errors {result.errors}", file=sys.stderr, flush=True)
    return cells


def _fmt(values: list[float], digits: int, suffix: str = "") -> str:
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}{suffix}"
    return (f"{statistics.median(values):,.{digits}f}{suffix} "
            f"({min(values):,.{digits}f}–{max(values):,.{digits}f})")


def table(rounds: list[Cells], paths: list[str], concurrencies: list[int], cpus: list[CpuCells]) -> str:
    lat_c, tput = (1 if 1 in concurrencies else concurrencies[0]), [c for c in concurrencies if c != 1]
    cpu_cs = tput or [lat_c]
    head = [f"c={lat_c} p50 ms", "× direct", f"c={lat_c} p99 ms", "added p50 ms", "added p99 ms"]
    for c in tput:
        head += [f"c={c} req/s", "% of direct"]
    for c in cpu_cs:
        head += [f"coordinator CPU ms/req (c={c})", f"node CPU ms/req (c={c})"]
    lines = ["| path | mode | " + " | ".join(head) + " | errors |", "|---" * (len(head) + 3) + "|"]
    for mode in MODES:
        for path in paths:
            def pairs(c: int) -> list[tuple[WrkResult, WrkResult]]:
                return [(r[(path, mode, c)], r[("direct", mode, c)]) for r in rounds]  # noqa: B023
            lat = pairs(lat_c)
            row = [_fmt([x.p50_ms for x, _ in lat], 2), _fmt([x.p50_ms / d.p50_ms for x, d in lat], 1, "×"),
                   _fmt([x.p99_ms for x, _ in lat], 2), _fmt([x.p50_ms - d.p50_ms for x, d in lat], 2),
                   _fmt([x.p99_ms - d.p99_ms for x, d in lat], 2)]
            for c in tput:
                row += [_fmt([x.rps for x, _ in pairs(c)], 0),
                        _fmt([100 * x.rps / d.rps for x, d in pairs(c)], 1, " %")]
            for c in cpu_cs:
                spent = [cpu[(path, mode, c)] for cpu in cpus if (path, mode, c) in cpu]
                row += [_fmt([x[0] for x in spent], 2), _fmt([x[1] for x in spent], 2)] if spent else ["–", "–"]
            errors = sum(r[(path, mode, c)].errors for r in rounds for c in concurrencies)
            lines.append(f"| {label(path)} | {mode} | " + " | ".join(row) + f" | {errors} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of wrk per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of wrk per path before each mode")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole table, then median (min–max)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated; c=1 gives the latency columns")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR",
                        help="another stack running DIR (a copy of src/) beside the working tree's")
    parser.add_argument("--kinds", default="paid,self", help="relayed paths per stack: paid, self or both")
    parser.add_argument("--no-tree", action="store_true", help="only the --variant stacks")
    parser.add_argument("--profile", type=Path, default=None, help="directory for py-spy profiles (c=16, plain)")
    parser.add_argument("--profile-mode", choices=MODES, default="plain", help="the mode the profiles load")
    parser.add_argument("--profile-seconds", type=float, default=10.0, help="seconds per py-spy pass (two passes)")
    parser.add_argument("--profile-paths", default="paid,self", help="relayed paths to profile, e.g. paid,self@base")
    parser.add_argument("--profile-concurrency", type=int, default=16)
    parser.add_argument("--profile-only", action="store_true", help="skip the table")
    args = parser.parse_args()
    wrk_binary()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    variants = [(v.split("=", 1)[0], Path(v.split("=", 1)[1]).resolve()) for v in args.variant]
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-"))
    scripts = root / "wrk"
    scripts.mkdir()
    print(f"starting the fixed-response upstream and {len(variants) + (not args.no_tree)} coordinator + node "
          f"stack(s) under {root}…", file=sys.stderr, flush=True)
    upstream, upstream_url = start_fixed_upstream(root / "upstream")
    stacks: list[Stack] = []
    try:
        for name, src in ([] if args.no_tree else [("", None)]) + variants:
            stacks.append(start_stack(root, name, src, upstream_url))
        targets: dict[str, dict[str, WrkTarget]] = {}
        for mode in MODES:
            body = {**BODY, "stream": True} if mode == "stream" else BODY
            targets[mode] = {"direct": WrkTarget(f"direct-{mode}", upstream_url + "/v1/chat/completions", body, {})}
            for stack in stacks:
                targets[mode].update({path: target for path, target in stack.targets(mode).items()
                                      if path.split("@")[0] in args.kinds.split(",")})
        for mode in MODES:
            for path, target in targets[mode].items():
                check(target, {"paid": "charged", "self": "free"}.get(path.split("@")[0]))
        paths = list(targets["plain"])
        pids = {path: (stack.coord.process.proc.pid, stack.node.proc.pid)
                for stack in stacks for path in stack.targets("plain")}
        print(f"# relay overhead — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()}\n"
              f"# {tree_state()}; variants: {', '.join(f'{n}={s}' for n, s in variants) or 'none'}\n"
              f"# wrk -t1, {args.duration:g} s per cell, {args.rounds} round(s), "
              f"1-min load {os.getloadavg()[0]:.2f} before\n", flush=True)
        if not args.profile_only:
            rounds: list[Cells] = []
            cpus: list[CpuCells] = []
            for n in range(args.rounds):
                print(f"round {n + 1}/{args.rounds}…", file=sys.stderr, flush=True)
                cpus.append({})
                rounds.append(run_round(targets, pids, scripts, concurrencies, args.duration, args.warmup,
                                        n % 2 == 1, cpus[-1]))
                if args.rounds > 1:
                    print(f"round {n + 1}:\n\n{table(rounds[-1:], paths, concurrencies, cpus[-1:])}\n", flush=True)
            title = f"median (min–max) of {args.rounds} rounds" if args.rounds > 1 else "one round"
            print(f"{title}, 1-min load {os.getloadavg()[0]:.2f} after:\n\n{table(rounds, paths, concurrencies, cpus)}\n",
                  flush=True)
        if args.profile is not None:
            by_label = {s.label: s for s in stacks}
            for path in args.profile_paths.split(","):
                if path not in targets[args.profile_mode]:  # e.g. paid under --kinds self
                    print(f"no {path} path in this run: not profiled", file=sys.stderr)
                    continue
                stack = by_label[path.partition("@")[2]]
                print(profile(targets[args.profile_mode][path], scripts, {"coordinator": stack.coord.process,
                                                                "node": stack.node},
                              args.profile_seconds, args.profile / path.replace("@", "-"),
                              args.profile_concurrency), flush=True)
    finally:
        for stack in stacks:
            stack.stop()
        upstream.stop()


if __name__ == "__main__":
    main()
