"""One request at a time through one coordinator + node stack (bench/relay_stack.py), driven by wrk at
c=1: what each process spends per request — user and system CPU, how often it went to sleep (its
threads' voluntary context switches: the wakeups a request costs) — and, with --strace, the system
calls behind it (`strace -c`, which slows the processes: read its counts, not its times).

The relay's latency at c=1 is mostly these CPU figures end to end, so this is where a change to the
request's path shows first; relay_overhead.py gives the full table. Runs the working tree, or a copy of
``src/`` (``--src DIR``); run the two alternately to compare.

Run: .venv/bin/python bench/relay_c1.py [--path paid|self] [--seconds 6] [--src DIR] [--strace]
Everything listens on 127.0.0.1; every wrk run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_stack import one_stack  # noqa: E402
from bench.wrk_load import run_wrk  # noqa: E402

Counters = tuple[int, int, int]  # user ticks, system ticks, voluntary context switches (all threads)


def counters(pid: int) -> Counters:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # CPU of all its threads
    return int(fields[11]), int(fields[12]), sum(map(_sleeps, Path(f"/proc/{pid}/task").iterdir()))


def _sleeps(task: Path) -> int:
    found = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", (task / "status").read_text(), re.M)
    return int(found.group(1)) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("paid", "self"), default="self")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--src", type=Path, default=None, help="a copy of src/ to run instead of the working tree")
    parser.add_argument("--strace", action="store_true", help="then count system calls for 3 s under load")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-c1-"))
    with one_stack(root, "c1", args.src, args.path) as (stack, target, script):
        run_wrk(target, script, 1, 2)  # warm up
        pids = {"coordinator": stack.coord.process.proc.pid, "node": stack.node.proc.pid}
        before = {name: counters(pid) for name, pid in pids.items()}
        result = run_wrk(target, script, 1, args.seconds)
        after = {name: counters(pid) for name, pid in pids.items()}
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        n = max(result.requests, 1)
        print(f"# {args.path}, c=1, {args.seconds:g} s, {'src ' + str(args.src) if args.src else 'working tree'}")
        print(f"{result.requests} requests, p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms\n")
        print("| process | user CPU ms/req | system CPU ms/req | sleeps/req |\n|---|---|---|---|")
        for name in pids:
            user, system, sleeps = (a - b for a, b in zip(after[name], before[name]))
            print(f"| {name} | {user * tick_ms / n:.3f} | {system * tick_ms / n:.3f} | {sleeps / n:.2f} |")
        if args.strace:
            with ThreadPoolExecutor(1 + len(pids)) as pool:
                load = pool.submit(run_wrk, target, script, 1, 5)
                time.sleep(0.5)
                traces = {name: pool.submit(subprocess.run, ["timeout", "-s", "INT", "3", "strace", "-c", "-f",
                                                              "-p", str(pid)], capture_output=True, text=True)
                          for name, pid in pids.items()}
                print(f"\nunder strace: {load.result().requests} requests in 5 s (3 s of them traced)")
                for name, trace in traces.items():
                    table = trace.result().stderr
                    print(f"\n{name}:\n```\n{table[table.find('% time'):].rstrip()}\n```")


if __name__ == "__main__":
    main()
