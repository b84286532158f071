"""What splitting the same traffic over k coordinator processes costs per request when nothing of
Darkbloom's is in them: relay_floor.py's bare ASGI coordinator and bare node (no authentication,
billing, placement, encryption, NATS or database) behind the same HAProxy and deploy/haproxy.cfg as
bench/replicas.py, three nodes through it, wrk at the same connection counts.

replicas.py reports the coordinators' CPU per request at k = 3 against k = 1 (issue 21 asks for at
most 1.3×). Part of that ratio is replication's own work; part is only that each of k processes
sees a k-th of the load on a machine with two cores, so its loop wakes for fewer events at a time
and the processes take turns on the cores. This bench measures the second part alone: the same
ratio for processes that share nothing. What the real stack's ratio has above it is what
replication adds.

Run: .venv/bin/python bench/replicas_floor.py [--concurrency 5,16,48] [--rounds 3] [--duration 4]
Everything listens on 127.0.0.1; every wrk run is bounded by --duration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_floor import http_status, spawn_floor_coordinator, spawn_floor_node  # noqa: E402
from bench.relay_overhead import loop_sleeps, machine, process_cpu, tree_state  # noqa: E402
from bench.relay_stack import BODY  # noqa: E402
from bench.replicas import haproxy_binary, start_lb  # noqa: E402
from bench.wrk_load import WrkTarget, run_wrk, wrk_binary  # noqa: E402
from tests.support.processes import Process, free_port, start_fixed_upstream, wait_until  # noqa: E402


@dataclass
class FloorCoordinator:
    """A bare coordinator as start_lb reads a replica: its ``base_url``."""

    process: Process
    base_url: str

    def nodes(self) -> int:
        try:
            return int(httpx.get(self.base_url + "/", timeout=1).text or 0)
        except (httpx.HTTPError, ValueError):
            return 0

    def up(self) -> bool:
        return http_status(self.base_url + "/readyz") == 200


def start_coordinators(root: Path, count: int) -> list[FloorCoordinator]:
    coordinators = []
    for n in range(count):
        port = free_port()
        coordinators.append(FloorCoordinator(spawn_floor_coordinator(root / f"c{n}", port),
                                             f"http://127.0.0.1:{port}"))
    for coordinator in coordinators:
        wait_until(coordinator.up, timeout=60, what="a floor coordinator")
    return coordinators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="5,16,48")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of wrk per cell")
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args()
    wrk_binary()
    haproxy_binary()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp(prefix="darkbloom-replicas-floor-"))
    upstream, upstream_url = start_fixed_upstream(root / "upstream")
    coordinators: list[FloorCoordinator] = []
    running: list[Process] = []
    cells: dict[tuple[int, int], list[tuple[float, float, float]]] = {}  # (k, c) → (req/s, CPU ms/req, wakeups/req)
    try:
        coordinators = start_coordinators(root, 3)
        pids = [c.process.proc.pid for c in coordinators]
        for round_ in range(args.rounds):
            for count in (1, 3):
                lb, url = start_lb(root, coordinators, count)  # type: ignore[arg-type]
                running.append(lb)
                nodes = [spawn_floor_node(root / f"n{round_}-{count}-{n}", url.replace("http", "ws") + "/ws/provider",
                                          upstream_url) for n in range(args.nodes)]
                running.extend(nodes)
                wait_until(lambda: sum(c.nodes() for c in coordinators[:count]) == args.nodes, timeout=60,
                           what="the nodes connected")
                held = " / ".join(str(c.nodes()) for c in coordinators)
                target = WrkTarget(f"floor-lb{count}", url + "/v1/chat/completions", BODY, {})
                script = target.script(root)
                run_wrk(target, script, 16, 1.0)  # warm up
                for conc in concurrencies:
                    before = [(process_cpu(pid), loop_sleeps(pid)) for pid in pids]
                    result = run_wrk(target, script, conc, args.duration)
                    after = [(process_cpu(pid), loop_sleeps(pid)) for pid in pids]
                    if result.errors:
                        raise SystemExit(f"k = {count}, c = {conc}: {result.errors} errors")
                    cpu = 1e3 * sum(a[0] - b[0] for a, b in zip(after, before)) / result.requests
                    wakeups = sum(a[1] - b[1] for a, b in zip(after, before)) / result.requests
                    cells.setdefault((count, conc), []).append((result.rps, cpu, wakeups))
                    print(f"  round {round_ + 1}: k = {count} (nodes {held}), c = {conc}: {result.rps:,.0f} req/s, "
                          f"{cpu:.3f} ms CPU/req", file=sys.stderr, flush=True)
                for process in nodes + [lb]:
                    process.stop()
                    running.remove(process)
                wait_until(lambda: sum(c.nodes() for c in coordinators) == 0, timeout=30, what="the nodes gone")
    finally:
        for process in running + [c.process for c in coordinators]:
            process.stop()
        upstream.stop()
    print(f"# replicas floor — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()} — {tree_state()}")
    print(f"# bare coordinators behind HAProxy, {args.nodes} bare nodes, wrk -t1, {args.duration:g} s per cell, "
          f"{args.rounds} rounds; median (range); a ratio is taken within its round; 1-min load "
          f"{os.getloadavg()[0]:.2f} after\n")
    print("| k | c | req/s | coordinators CPU ms/req | × k = 1 | loop wakeups/req |\n|---|---|---|---|---|---|")
    for (count, conc), runs in sorted(cells.items(), key=lambda item: (item[0][1], item[0][0])):
        ratios = [cpu / cells[(1, conc)][i][1] for i, (_, cpu, _) in enumerate(runs)]
        ratio = "—" if count == 1 else (f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
        print(f"| {count} | {conc} | {statistics.median(r[0] for r in runs):,.0f} | "
              f"{statistics.median(r[1] for r in runs):.3f} | {ratio} | {statistics.median(r[2] for r in runs):.1f} |")


if __name__ == "__main__":
    main()
