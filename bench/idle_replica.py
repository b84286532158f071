"""What a coordinator costs with nothing to do: its timers, polls and the fabric's heartbeats.

k `darkbloom coordinator` processes on a fresh Postgres database (with NATS and Redis for k > 1, as
replicas run), no session and no request: each replica's CPU (utime + stime from /proc) and how often
its event loop woke (voluntary context switches: each is a wait that ended), per second over
``--seconds``, after ``--settle`` seconds from start. ``--variant NAME=SRC`` runs a copy of ``src/``
(``bench/variant.py``, or ``git archive``) the same way, alternating rounds with the tree, so the two
are compared in one run.

Run: PYTHONPATH=src:. .venv/bin/python bench/idle_replica.py --replicas 1,3 --rounds 2 [--variant base=/tmp/base/src]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from bench.fleet_probes import cpu_seconds  # noqa: E402
from bench.fleet_scale import fresh_database  # noqa: E402
from bench.relay_overhead import machine, tree_state  # noqa: E402
from tests.support.processes import start_coordinator  # noqa: E402


def wakes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def measure(root: Path, k: int, src: str | None, settle: float, seconds: float) -> list[tuple[float, float]]:
    """(CPU ms/s, wakes/s) of each of k replicas running ``src`` (None: the tree's)."""
    env = {"PYTHONPATH": os.pathsep.join([src, str(Path(__file__).resolve().parent.parent)])} if src else None
    root.mkdir(parents=True)
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [{"id": "idle-model", "input_price": 1, "output_price": 1}]}))
    args = ["--min-trust", "none", "--catalog", str(catalog)]
    if k > 1:
        args += ["--nats-url", "nats://127.0.0.1:4222", "--nats-subject-prefix", "idlebench" + secrets.token_hex(4),
                 "--redis-url", f"redis://127.0.0.1:6379/{secrets.randbelow(15) + 1}"]
    with ExitStack() as stack:
        database_url, _ = stack.enter_context(fresh_database())
        coords = [start_coordinator(root / f"replica-{i}", database_url, *args, env=env) for i in range(k)]
        for coord in coords:
            stack.callback(coord.process.proc.kill)
        pids = [c.process.proc.pid for c in coords]
        time.sleep(settle)
        cpu0, wakes0, t0 = [cpu_seconds(p) for p in pids], [wakes(p) for p in pids], time.monotonic()
        time.sleep(seconds)
        cpu1, wakes1, t1 = [cpu_seconds(p) for p in pids], [wakes(p) for p in pids], time.monotonic()
        return [(1e3 * (c1 - c0) / (t1 - t0), (w1 - w0) / (t1 - t0))
                for c0, c1, w0, w1 in zip(cpu0, cpu1, wakes0, wakes1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,3", help="replica counts k, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start before measuring")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured per round")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SRC",
                        help="another copy of src/ to measure alternately")
    opts = parser.parse_args()
    variants: list[tuple[str, str | None]] = [("tree", None)]
    variants += [(spec.split("=", 1)[0], str(Path(spec.split("=", 1)[1]).resolve())) for spec in opts.variant]
    print(f"# idle_replica — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()}")
    print(f"# {tree_state()}; 1-min load {os.getloadavg()[0]:.2f} before")
    print(f"# `bench/idle_replica.py {' '.join(sys.argv[1:])}`\n")
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with TemporaryDirectory(prefix="darkbloom-idle-") as tmp:
        for k in [int(x) for x in opts.replicas.split(",")]:
            for round_ in range(opts.rounds):
                for name, src in variants:
                    cell = measure(Path(tmp) / f"k{k}-{name}-{round_}", k, src, opts.settle, opts.seconds)
                    results.setdefault((k, name), []).extend(cell)
                    print(f"  k={k} {name} round {round_ + 1}: " + " / ".join(f"{c:.2f} ms/s, {w:.1f} wakes/s"
                                                                             for c, w in cell), flush=True)
    print("\n| k | src | CPU per replica, ms/s: median (min–max) | wakes per replica per second: median (min–max) |")
    print("|---|---|---|---|")
    for (k, name), cells in results.items():
        cpu, woke = [c for c, _ in cells], [w for _, w in cells]
        print(f"| {k} | {name} | {statistics.median(cpu):.2f} ({min(cpu):.2f}–{max(cpu):.2f}) "
              f"| {statistics.median(woke):.1f} ({min(woke):.1f}–{max(woke):.1f}) |")


if __name__ == "__main__":
    main()
