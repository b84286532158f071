"""What running the coordinator as several replicas over NATS costs (docs/replicas.md): three replicas
on one Postgres database, one Redis and the machine's NATS server (a subject prefix of their own),
provider nodes on the `openai` backend in front of the fixed-response upstream (bench/fixed_upstream.py,
a benchmark fake that answers at once), HAProxy from Debian with deploy/haproxy.cfg, wrk driving
every path (a Lua script for the POST body, bench/wrk_load.py). Paid requests, non-streaming and
streaming. Two tables, one run:

(a) **Cross-replica vs same-replica**: one node connected straight to replica A; the consumer calls
    A (same replica: no NATS on the path) or B (cross: B admits, seals and settles; A holds the
    node's socket; claim, request and chunks cross NATS). c=1 latency and c=64 throughput, ratios
    cross / same, and the CPU all the coordinator replicas and the node spent per request.
(b) **1, 2 and 3 replicas behind the load balancer**: for each k, an HAProxy whose backends are the
    first k replicas (deploy/haproxy.cfg with the other `server` lines left out); ``--nodes`` nodes
    connect through it (leastconn: spread over the k replicas) and the consumer calls it (round
    robin). Selection prefers a session the admitting replica holds when it ranks as well as
    another replica's (since issue 21; before, (k-1)/k of the requests crossed NATS). At the same c,
    each of k replicas carries a k-th of the load, and a coordinator's CPU per request falls with its
    load (more events per loop wake, more steps per ledger transaction), so the table also compares
    with one replica at c/k connections ("× 1 replica at c/k", when that c was measured: run
    ``--concurrency 5,16,48``): what replication itself costs a request.

``--profile DIR`` then samples the two replicas of a cross-replica request (B admitting, A holding)
with py-spy while wrk keeps the cross path at c=64, non-streaming, and in (b) replica A at k = 1 and
k = 3 while wrk keeps the load balancer at c=16, non-streaming (bench/profile_summary.py).

``--rounds N`` measures every k of (b) N times, one round after the other, and reports medians (a
ratio to k = 1 is taken within its round: this VM drifts by tens of per cent between minutes).

``--accounts N`` (N > 1) has N consumer accounts take turns, request by request, and gives each node
an owner of its own, as a fleet has many of each; by default one account pays for every request and
owns every node, so every ledger transaction of every replica touches the same rows.

``--upstream-delay S`` paces the fixed upstream like a model (S seconds before each content chunk).

Run: .venv/bin/python bench/replicas.py [--duration S] [--nodes N] [--profile DIR]
(or `make bench-replicas BENCH_ARGS="--profile /tmp/prof"`). Everything listens on 127.0.0.1; every
wrk run is bounded by --duration; the whole run takes about 3–4 minutes with the defaults. Record the
tables in bench/RESULTS.md with the date, machine and commit they print.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relay_overhead import loop_sleeps, machine, process_cpu, tree_state  # noqa: E402
from bench.relay_stack import BODY, MODEL, check, profile, write_catalog  # noqa: E402
from bench.wrk_load import WrkResult, WrkTarget, run_wrk, wrk_binary  # noqa: E402
from tests.support.accounts import Account, create_account, login_node  # noqa: E402
from tests.support.databases import postgres_database  # noqa: E402
from tests.support.processes import (Coordinator, Process, darkbloom_cmd, free_port, spawn,  # noqa: E402
                                     start_coordinator, start_fixed_upstream, wait_until)

NATS_URL = "nats://127.0.0.1:4222"
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
MODES = ("plain", "stream")


@dataclass
class Bench:
    root: Path
    replicas: list[Coordinator]
    account: Account
    upstream_url: str
    scripts: Path
    nodes: list[Process] = field(default_factory=list)
    lbs: list[Process] = field(default_factory=list)
    consumers: list[Account] = field(default_factory=list)  # who pays; empty: the nodes' own account
    providers: list[Account] = field(default_factory=list)  # one per node when set; empty: the account

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: all replicas together, all nodes together; the replicas' loop wakeups."""
        return {"coordinators": sum(process_cpu(c.process.proc.pid) for c in self.replicas),
                "nodes": sum(process_cpu(n.proc.pid) for n in self.nodes),
                "wakeups": sum(loop_sleeps(c.process.proc.pid) for c in self.replicas)}

    def crossed(self) -> float:
        """Attempts sent to a session another replica holds, so far, all replicas together."""
        return sum(c.metric("darkbloom_fabric_remote_requests_total") for c in self.replicas)

    def target(self, name: str, base_url: str, mode: str) -> WrkTarget:
        body = {**BODY, "stream": True} if mode == "stream" else BODY
        payers = self.consumers or [self.account]
        return WrkTarget(f"{name}-{mode}", base_url + "/v1/chat/completions", body,
                         {"Authorization": f"Bearer {payers[0].api_key}"},
                         tuple(f"Bearer {a.api_key}" for a in payers) if len(payers) > 1 else ())

    def owner(self, n: int) -> Account:
        return self.providers[n % len(self.providers)] if self.providers else self.account

    def start_nodes(self, count: int, coordinator_url: str, tag: str) -> None:
        for n in range(count):
            home = self.root / f"node-{tag}-{n}"
            login_node(self.replicas[0], home, self.owner(n))  # a device token is valid on every replica
            self.nodes.append(spawn(darkbloom_cmd("serve", "--coordinator", coordinator_url, "--backend", "openai",
                                                  "--upstream-url", self.upstream_url, "--model", MODEL,
                                                  "--max-concurrency", "128"), home, "node.log"))

    def nodes_online(self, coord: Coordinator) -> int:
        return sum(online(coord, owner) for owner in (self.providers or [self.account]))

    def stop_nodes(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes.clear()
        for coord in self.replicas:
            wait_until(lambda c=coord: self.nodes_online(c) == 0, timeout=30, what="nodes gone")  # type: ignore[misc]

    def wait_nodes(self, count: int, replicas: list[Coordinator]) -> None:
        for coord in replicas:
            wait_until(lambda c=coord: self.nodes_online(c) >= count, timeout=60, interval=0.2,  # type: ignore[misc]
                       what=f"{count} node(s) seen by {coord.base_url}")

    def spread(self, count: int) -> str:
        """Sessions each replica holds: all sessions minus the ones it sees as another replica's."""
        held = [count - int(c.metric("darkbloom_fabric_remote_sessions")) for c in self.replicas]
        return " / ".join(f"{chr(65 + i)} {h}" for i, h in enumerate(held))

    def stop(self) -> None:
        for process in self.nodes + self.lbs:
            process.stop()
        for coord in self.replicas:
            coord.stop()


def online(coord: Coordinator, account: Account) -> int:
    response = httpx.get(coord.api_url + "/me/providers", headers=account.headers(), timeout=10)
    response.raise_for_status()
    return sum(1 for m in response.json()["data"] if m["online"])


def replicas_heard(coord: Coordinator) -> int:
    try:
        return int(httpx.get(coord.base_url + "/readyz", timeout=5).json().get("replicas", 0))
    except (httpx.HTTPError, ValueError):
        return 0


def haproxy_binary() -> str:
    found = shutil.which("haproxy")
    if found is None:
        raise SystemExit("haproxy is missing: `apt-get install -y haproxy` (Debian's package)")
    return found


def start_lb(root: Path, replicas: list[Coordinator], count: int) -> tuple[Process, str]:
    """deploy/haproxy.cfg in front of the first ``count`` replicas (the other `server` lines left out)."""
    lines = [line for line in HAPROXY_CFG.read_text().splitlines()
             if not (m := re.match(r"\s*server c(\d+) ", line)) or int(m.group(1)) <= count]
    config = root / f"haproxy-{count}.cfg"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    env = {"DARKBLOOM_LB_BIND": f"127.0.0.1:{port}"}
    env.update({f"DARKBLOOM_REPLICA_{i + 1}": c.base_url.removeprefix("http://") for i, c in enumerate(replicas)})
    process = spawn([haproxy_binary(), "-db", "-f", str(config)], root / f"lb-{count}", "haproxy.log", env)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.proc.poll() is not None:
            raise RuntimeError(f"haproxy exited:\n{process.log()}")
        try:
            return httpx.get(url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, interval=0.1, what=f"haproxy on {url}")
    return process, url


def measure(bench: Bench, target: WrkTarget, conc: int, duration: float) -> tuple[WrkResult, dict[str, float]]:
    crossed, before = bench.crossed(), bench.cpu()  # the scrape before the CPU count: not in it
    result = run_wrk(target, target.script(bench.scripts), conc, duration)
    after = bench.cpu()
    per_request = {k: 1e3 * (after[k] - before[k]) / max(result.requests, 1) for k in before}
    per_request["wakeups"] = (after["wakeups"] - before["wakeups"]) / max(result.requests, 1)
    per_request["crossed"] = (bench.crossed() - crossed) / max(result.requests, 1)
    print(f"  {target.name:18} c={conc:<3} {result.rps:8.1f} req/s  p50 {result.p50_ms:8.2f} ms  "
          f"p99 {result.p99_ms:8.2f} ms  errors {result.errors}", file=sys.stderr, flush=True)
    return result, per_request


def part_a(bench: Bench, duration: float, warmup: float, profile_dir: Path | None,
           profile_seconds: float) -> str:
    a, b = bench.replicas[0], bench.replicas[1]
    bench.start_nodes(1, a.base_url, "a")
    bench.wait_nodes(1, bench.replicas)
    print(f"(a) one node on replica A; held: {bench.spread(1)}", file=sys.stderr, flush=True)
    paths = {"same": a.base_url, "cross": b.base_url}
    cells: dict[tuple[str, str, int], tuple[WrkResult, dict[str, float]]] = {}
    for mode in MODES:
        targets = {p: bench.target(p, url, mode) for p, url in paths.items()}
        for target in targets.values():
            check(target, "charged")
            run_wrk(target, target.script(bench.scripts), 16, warmup)
        for conc in (1, 64):
            order = ("same", "cross") if conc == 1 else ("cross", "same")
            for path in order:
                cells[(path, mode, conc)] = measure(bench, targets[path], conc, duration)
    head = ("| path | mode | c=1 p50 ms | c=1 p99 ms | c=64 req/s | c=64 p50 ms | c=64 p99 ms "
            "| coordinators CPU ms/req (c=64) | node CPU ms/req (c=64) | errors |")
    lines = [head, "|---" * 10 + "|"]
    names = {"same": "same replica (consumer → A, node on A)", "cross": "cross-replica (consumer → B, node on A)"}
    for mode in MODES:
        for path in ("same", "cross"):
            (r1, _), (r64, cpu) = cells[(path, mode, 1)], cells[(path, mode, 64)]
            lines.append(f"| {names[path]} | {mode} | {r1.p50_ms:.2f} | {r1.p99_ms:.2f} | {r64.rps:,.0f} | "
                         f"{r64.p50_ms:.1f} | {r64.p99_ms:.1f} | {cpu['coordinators']:.2f} | {cpu['nodes']:.2f} | "
                         f"{r1.errors + r64.errors} |")
    ratios = ["", "| mode | c=1 p50 cross / same | added p50 ms | c=1 p99 cross / same | c=64 req/s cross / same "
              "| coordinators CPU/req cross / same |", "|---|---|---|---|---|---|"]
    for mode in MODES:
        s1, c1 = cells[("same", mode, 1)][0], cells[("cross", mode, 1)][0]
        (s64, scpu), (c64, ccpu) = cells[("same", mode, 64)], cells[("cross", mode, 64)]
        ratios.append(f"| {mode} | {c1.p50_ms / s1.p50_ms:.2f}× | {c1.p50_ms - s1.p50_ms:+.2f} | "
                      f"{c1.p99_ms / s1.p99_ms:.2f}× | {c64.rps / s64.rps:.2f}× | "
                      f"{ccpu['coordinators'] / scpu['coordinators']:.2f}× |")
    text = "\n".join(lines + ratios) + "\n"
    if profile_dir is not None:
        target = bench.target("cross", b.base_url, "plain")
        text += "\n" + profile(target, bench.scripts, {"admitting-B": b.process, "holder-A": a.process},
                               profile_seconds, profile_dir, 64)
    bench.stop_nodes()
    return text


def part_b(bench: Bench, nodes: int, duration: float, warmup: float, concurrencies: list[int],
           profile_dir: Path | None = None, profile_seconds: float = 5.0, rounds: int = 1,
           counts: tuple[int, ...] = (1, 2, 3)) -> str:
    """The table of (b). With ``rounds`` > 1 every k is measured once per round, the rounds one after
    the other (k = 1, 2, 3, then again), and each figure is the median over the rounds; a ratio to
    k = 1 is taken within its round (the machine's minute-to-minute drift cancels) and shown as the
    median with the rounds' range."""
    rows: list[tuple[int, int, str, str, int, WrkResult, dict[str, float]]] = []
    profiles = []
    for round_ in range(rounds):
        for count in counts:
            lb, url = start_lb(bench.root, bench.replicas, count)
            bench.lbs.append(lb)
            bench.start_nodes(nodes, url, f"b{count}r{round_}")
            bench.wait_nodes(nodes, bench.replicas[:count])
            spread = bench.spread(nodes)
            print(f"(b) round {round_ + 1} of {rounds}: {count} replica(s) behind HAProxy {url}; sessions held: "
                  f"{spread}", file=sys.stderr, flush=True)
            for mode in MODES:
                target = bench.target(f"lb{count}", url, mode)
                check(target, "charged")
                run_wrk(target, target.script(bench.scripts), 16, warmup)
                for conc in concurrencies:
                    result, cpu = measure(bench, target, conc, duration)
                    rows.append((round_, count, spread, mode, conc, result, cpu))
                if profile_dir is not None and round_ == 0 and mode == "plain" and count in (1, 3):
                    profiles.append(f"\n#### replica A with {count} replica(s) behind HAProxy, plain, c=16\n\n"
                                    + profile(target, bench.scripts, {"A": bench.replicas[0].process},
                                              profile_seconds, profile_dir / f"b{count}", 16))
            bench.stop_nodes()
            lb.stop()
            bench.lbs.remove(lb)
    return _table_b(rows, rounds) + "".join(profiles) + "\n"


def _table_b(rows: list[tuple[int, int, str, str, int, WrkResult, dict[str, float]]], rounds: int) -> str:
    lines = ["| replicas behind HAProxy | sessions held (A / B / C) | mode | c | req/s | × 1 replica | p50 ms | p99 ms "
             "| crossed NATS | coordinators CPU ms/req | × 1 replica | × 1 replica at c/k | coordinator loop wakeups/req "
             "| nodes CPU ms/req | errors |", "|---" * 15 + "|"]
    cells: dict[tuple[int, str, int], list[tuple[int, str, WrkResult, dict[str, float]]]] = {}
    for round_, count, spread, mode, conc, result, cpu in rows:
        cells.setdefault((count, mode, conc), []).append((round_, spread, result, cpu))
    base = {(mode, conc): {round_: (r.rps, cpu["coordinators"]) for round_, _, r, cpu in runs}
            for (count, mode, conc), runs in cells.items() if count == 1}

    def ratio(values: list[float]) -> str:
        middle = f"{statistics.median(values):.2f}×"
        return middle if len(values) == 1 else f"{middle} ({min(values):.2f}–{max(values):.2f})"

    for (count, mode, conc), runs in sorted(cells.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        ones = base[(mode, conc)]
        speed = [r.rps / ones[round_][0] for round_, _, r, _ in runs]
        cost = [cpu["coordinators"] / ones[round_][1] for round_, _, _, cpu in runs]
        at_load = []
        for round_, _, _, cpu in runs:
            same_load = _per_replica_base({key: per[round_] for key, per in base.items() if round_ in per},
                                          mode, conc / count) if count > 1 else None
            if same_load:
                at_load.append(cpu["coordinators"] / same_load)

        def median(pick: Callable[[WrkResult, dict[str, float]], float]) -> float:
            return statistics.median(pick(r, cpu) for _, _, r, cpu in runs)

        lines.append(f"| {count} | {runs[0][1]} | {mode} | {conc} | {median(lambda r, _: r.rps):,.0f} | "
                     f"{ratio(speed)} | {median(lambda r, _: r.p50_ms):.1f} | {median(lambda r, _: r.p99_ms):.1f} | "
                     f"{100 * median(lambda _, c: c['crossed']):.0f} % | {median(lambda _, c: c['coordinators']):.2f} | "
                     f"{ratio(cost)} | {ratio(at_load) if at_load else '—'} | "
                     f"{median(lambda _, c: c['wakeups']):.1f} | {median(lambda _, c: c['nodes']):.2f} | "
                     f"{sum(r.errors for _, _, r, _ in runs)} |")
    note = (f"\nMedians over {rounds} rounds; a ratio is taken within its round, shown as the median (range).\n"
            if rounds > 1 else "")
    return "\n".join(lines) + "\n" + note


def _per_replica_base(base: dict[tuple[str, int], tuple[float, float]], mode: str, per_replica: float) -> float | None:
    """One replica's coordinator CPU per request at the load each of k replicas carries (c/k connections,
    within 10 %), when that concurrency was measured: what a replica would pay alone at its own load."""
    near = [(abs(conc - per_replica), cpu) for (m, conc), (_, cpu) in base.items()
            if m == mode and abs(conc - per_replica) <= 0.1 * per_replica]
    return min(near)[1] if near else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of wrk per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of wrk per path before each mode")
    parser.add_argument("--nodes", type=int, default=3, help="nodes behind the load balancer in (b)")
    parser.add_argument("--concurrency", default="16,64", help="(b): comma-separated connections per cell")
    parser.add_argument("--skip", default="", help="a, b or a,b: parts to leave out")
    parser.add_argument("--rounds", type=int, default=1,
                        help="(b): measure every k this many times, one round after the other; medians are reported")
    parser.add_argument("--accounts", type=int, default=1,
                        help="(b): consumer accounts taking turns, request by request; above 1 each node also has an "
                             "owner of its own (by default one account pays and owns every node)")
    parser.add_argument("--replicas", default="1,2,3", help="(b): the replica counts to measure (1 always among them)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="directory for py-spy profiles: (a) the cross path at c=64; (b) replica A at k = 1 and 3")
    parser.add_argument("--profile-seconds", type=float, default=5.0, help="seconds per py-spy pass (two passes)")
    parser.add_argument("--upstream-delay", type=float, default=0.0,
                        help="seconds the fixed upstream waits before each content chunk (a model's pace: the "
                             "nodes' measured speeds then differ by what a real fleet's would, not by the bench's noise)")
    args = parser.parse_args()
    wrk_binary()
    haproxy_binary()
    root = Path(tempfile.mkdtemp(prefix="darkbloom-bench-replicas-"))
    scripts = root / "wrk"
    scripts.mkdir()
    started = time.monotonic()
    print(f"starting the fixed-response upstream and three replicas under {root}…", file=sys.stderr, flush=True)
    upstream, upstream_url = start_fixed_upstream(root / "upstream", "--delay", str(args.upstream_delay))
    bench: Bench | None = None
    try:
        with postgres_database() as database_url:
            prefix = "bench" + secrets.token_hex(6)
            redis_url = f"redis://127.0.0.1:6379/{secrets.randbelow(15) + 1}"
            catalog = write_catalog(root)
            replicas = [start_coordinator(root / f"replica-{name}", database_url, "--redis-url", redis_url,
                                          "--nats-url", NATS_URL, "--nats-subject-prefix", prefix,
                                          "--catalog", str(catalog))
                        for name in "ABC"]  # one after the other: the first one migrates the schema
            for coord in replicas:
                wait_until(lambda c=coord: replicas_heard(c) == 3, timeout=30, what="replicas joined")  # type: ignore[misc]
            account = create_account(replicas[0], credit_micro_usd=1_000_000_000)
            bench = Bench(root, replicas, account, upstream_url, scripts)
            if args.accounts > 1:
                bench.consumers = [create_account(replicas[0], credit_micro_usd=1_000_000_000)
                                   for _ in range(args.accounts)]
                bench.providers = [create_account(replicas[0]) for _ in range(args.nodes)]
            print(f"# replicas — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()} "
                  f"(`nproc` {os.cpu_count()}, `uname -m` {os.uname().machine})\n"
                  f"# {tree_state()}\n# three replicas on Postgres + Redis + NATS (default --replica-heartbeat 1 s),"
                  f" wrk -t1, {args.duration:g} s per cell, upstream delay {args.upstream_delay:g} s per chunk,"
                  f" {args.accounts} paying account(s),"
                  f" 1-min load {os.getloadavg()[0]:.2f} before\n", flush=True)
            skip = set(args.skip.split(","))
            if "a" not in skip:
                print("(a) cross-replica vs same-replica:\n", flush=True)
                print(part_a(bench, args.duration, args.warmup, args.profile, args.profile_seconds), flush=True)
            if "b" not in skip:
                counts = tuple(sorted({1, *(int(k) for k in args.replicas.split(","))}))
                print(f"(b) throughput with {', '.join(map(str, counts))} replicas behind HAProxy, {args.nodes} nodes "
                      f"through it:\n", flush=True)
                print(part_b(bench, args.nodes, args.duration, args.warmup,
                             [int(c) for c in args.concurrency.split(",")], args.profile, args.profile_seconds,
                             args.rounds, counts), flush=True)
            print(f"1-min load {os.getloadavg()[0]:.2f} after; {time.monotonic() - started:.0f} s in all", flush=True)
            bench.stop()
    finally:
        if bench is not None:
            bench.stop()
        upstream.stop()


if __name__ == "__main__":
    main()
