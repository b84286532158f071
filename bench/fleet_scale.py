"""What a coordinator costs per machine of its fleet (issue 21): a simulated fleet of N provider
sessions on k replicas, measured from outside.

For every k in --replicas and N in --sizes, on a fresh Postgres database: k `darkbloom coordinator`
processes (k > 1: joined over the machine's NATS, with Redis), N machines seeded in the database
(device tokens of --owners accounts), and N simulated sessions (bench/fleet_sessions.py: real
WebSocket connections speaking the real protocol, spread round-robin over the replicas) in a few
client processes. --answerers of them serve the model the public requests ask for with a short fixed
answer; the others advertise a model nobody asks for. Then, in order:

1. **ramp**: every session registers (at most --ramp-inflight registering at once); the coordinators'
   CPU (utime + stime from /proc, all replicas) over the ramp ÷ N, RSS after − before ÷ N;
2. **idle**: --idle-seconds with every session connected and heartbeating and no request (60 s
   covers the once-a-minute `last_seen` write of every session); CPU per replica as % of a core;
   with k > 1 the bytes published on the replicas' NATS subjects and what each replica sees of the
   sessions the others hold (`darkbloom_fabric_remote_sessions`);
3. **probes**, one request at a time: `GET /v1/models`, `/health` on every replica, and public
   (paid) chat completions served by the answering sessions (k > 1: sent to each replica in turn);
4. **storm**: every session dropped at once, by SIGTERM to every replica and a new process on the
   same port (`restart`), or by aborting every socket (`drop`); the time until all N are registered
   again, the old processes' exit time, and every failed attempt by kind. Sessions reconnect with the
   node's own backoff, so the figure includes what that policy adds.

Only the coordinators' CPU counts as the coordinator's (the client processes share the machine and
are reported beside it); the Postgres backends of the database are read the same way.

Run: PYTHONPATH=src:. .venv/bin/python bench/fleet_scale.py --sizes 100,1000,10000 --replicas 1,2,3
     [--idle-seconds 60] [--storm restart|drop|none] [--json out.json] [--quick]
Everything listens on 127.0.0.1; every phase has a timeout; Ctrl-C stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet_laws import heard_each_other, laws, projection  # noqa: E402
from bench.fleet_probes import (Latencies, NatsCounter, PostgresBackends, counter_sum, cpu_seconds,  # noqa: E402
                                gauge, percentile, rss_bytes, sequential)
from bench.fleet_sessions import SessionSpec, worker_main  # noqa: E402
from bench.relay_overhead import machine, tree_state  # noqa: E402
from darkbloom.wire.crypto import token_hash  # noqa: E402
from darkbloom.wire.protocol import PROVIDER_WS_PATH  # noqa: E402
from tests.support.accounts import Account, create_account  # noqa: E402
from tests.support.processes import Coordinator, start_coordinator  # noqa: E402

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
IDLE_MODEL = "fleet-idle"
ANSWER_MODEL = "fleet-answer"
CHAT_BODY = {"model": ANSWER_MODEL, "messages": [{"role": "user", "content": "fleet bench"}], "max_tokens": 8}


# the database, the coordinators, the client processes


@contextmanager
def fresh_database() -> Iterator[tuple[str, str]]:
    """(SQLAlchemy URL, name) of a new Postgres database, dropped on leaving."""
    name = "fleetbench_" + secrets.token_hex(5)

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(ADMIN_DSN)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}", name
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def seed_machines(database: str, owners: list[Account], count: int, k: int) -> list[str]:
    """``count`` linked machines with a device token each (what `darkbloom login` leaves), written
    straight into the database; returns the tokens. Session n dials replica n % k, so machine n is
    owned by ``owners[(n // k) % len(owners)]``: every owner has machines on every replica."""
    tokens = ["dkp-" + secrets.token_urlsafe(32) for _ in range(count)]
    now = int(time.time())
    machines = [(f"mach_fleet{n:06d}", owners[(n // k) % len(owners)].account_id, f"fleet-{n}", now)
                for n in range(count)]

    async def insert() -> None:
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:5432/{database}")
        try:
            await conn.executemany("INSERT INTO machines (id, account_id, name, trust_level, private_only, models, "
                                   "created_at) VALUES ($1, $2, $3, 'none', false, '[]'::json, $4)", machines)
            await conn.executemany("INSERT INTO device_tokens (token_hash, machine_id, account_id, created_at) "
                                   "VALUES ($1, $2, $3, $4)",
                                   [(token_hash(t), m[0], m[1], now) for t, m in zip(tokens, machines)])
        finally:
            await conn.close()

    asyncio.run(insert())
    return tokens


@dataclass
class Replicas:
    """The k coordinator processes of one cell, restartable on their ports."""

    root: Path
    database_url: str
    args: list[str]
    coords: list[Coordinator]

    @classmethod
    def start(cls, root: Path, database_url: str, k: int, args: list[str]) -> Replicas:
        # one after the other: the first one migrates the schema
        coords = [start_coordinator(root / f"replica-{i}", database_url, *args) for i in range(k)]
        return cls(root, database_url, args, coords)

    @property
    def pids(self) -> list[int]:
        return [c.process.proc.pid for c in self.coords]

    def cpu(self) -> list[float]:
        return [cpu_seconds(pid) for pid in self.pids]

    def rss(self) -> list[int]:
        return [rss_bytes(pid) for pid in self.pids]

    def stop(self, timeout: float) -> list[float | None]:
        """SIGTERM every replica at once; seconds until each exited (None: killed after ``timeout``)."""
        started = time.monotonic()
        for c in self.coords:
            if c.process.proc.poll() is None:
                c.process.proc.send_signal(signal.SIGTERM)
        exits: list[float | None] = []
        for c in self.coords:
            try:
                c.process.proc.wait(timeout=max(0.1, started + timeout - time.monotonic()))
                exits.append(time.monotonic() - started)
            except subprocess.TimeoutExpired:
                c.process.proc.kill()
                c.process.proc.wait()
                exits.append(None)
        return exits

    def restart(self) -> None:
        """New processes on the same ports and homes, all at once."""
        ports = [int(c.base_url.rsplit(":", 1)[1]) for c in self.coords]
        with ThreadPoolExecutor(len(ports)) as pool:
            self.coords = list(pool.map(lambda i: start_coordinator(self.root / f"replica-{i}", self.database_url,
                                                                    *self.args, port=ports[i]), range(len(ports))))

    def kill(self) -> None:
        for c in self.coords:
            if c.process.proc.poll() is None:
                c.process.proc.kill()
                c.process.proc.wait()


class Fleet:
    """The client processes and what they report, merged."""

    def __init__(self, specs: list[SessionSpec], processes: int, replicas: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.n = len(specs)
        self.pipes = []
        self.procs = []
        for p in range(processes):
            parent, child = context.Pipe()
            proc = context.Process(target=worker_main, args=(child, specs[p::processes], replicas), daemon=True,
                                   name=f"fleet-client-{p}")
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def command(self, *command: Any, timeout: float = 60) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        answers = []
        for pipe in self.pipes:
            if not pipe.poll(timeout):
                raise TimeoutError(f"a client process did not answer {command[0]!r} in {timeout:g} s")
            answers.append(pipe.recv())
        return answers

    def status(self, reset: bool = False) -> dict[str, Any]:
        merged: dict[str, Any] = {"registered": None, "failures": Counter(), "latencies": [], "since_mark": []}
        for part in self.command("status", reset):
            merged["registered"] = part["registered"] if merged["registered"] is None else \
                [a + b for a, b in zip(merged["registered"], part["registered"])]
            merged["failures"].update(part["failures"])
            merged["latencies"] += part["latencies"]
            merged["since_mark"] += part["since_mark"]
            for key in ("attempts", "drops", "untrusted", "errors", "served"):
                merged[key] = merged.get(key, 0) + part[key]
        return merged

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs if p.pid is not None)

    def wait(self, done: Any, timeout: float, what: str) -> tuple[float, dict[str, Any], bool]:
        """Poll until ``done(status)``; (seconds, last status, whether it got there)."""
        started = time.monotonic()
        said = started
        while True:
            status = self.status()
            elapsed = time.monotonic() - started
            if done(status):
                return elapsed, status, True
            if elapsed > timeout:
                return elapsed, status, False
            if time.monotonic() - said > 10:
                said = time.monotonic()
                failures = sum(status["failures"].values())
                log(f"  {what}: {sum(status['registered'])}/{self.n} registered after {elapsed:.0f} s "
                    f"({len(status['since_mark'])} since the mark), {failures} failed attempts")
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            self.command("stop", timeout=30)
        except (TimeoutError, OSError, EOFError):
            pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# one cell: N sessions on k replicas


@dataclass(frozen=True)
class Options:
    idle_seconds: float
    storm: str
    clients: int
    answerers: int
    owners: int
    ramp_inflight: int
    ramp_rate: float
    models_requests: int
    chat_requests: int
    health_requests: int
    nats_url: str
    exit_timeout: float


def client_processes(n: int, asked: int) -> int:
    return asked if asked > 0 else max(1, min(4, math.ceil(n / 2500)))


def specs_for(coords: list[Coordinator], tokens: list[str], answerers: int) -> list[SessionSpec]:
    urls = [c.base_url.replace("http://", "ws://") + PROVIDER_WS_PATH for c in coords]
    return [SessionSpec(url=urls[i % len(urls)], replica=i % len(urls), token=token,
                        model=ANSWER_MODEL if i < answerers else IDLE_MODEL, answering=i < answerers,
                        max_concurrency=4 if i < answerers else 1)
            for i, token in enumerate(tokens)]


def run_cell(root: Path, k: int, n: int, opts: Options, cell: dict[str, Any]) -> None:
    """Measure N sessions on k replicas into ``cell`` (which keeps what was measured if interrupted)."""
    cell.update({"k": k, "n": n, "load_before": os.getloadavg()[0],
                 "run": f"ramp paced at {opts.ramp_rate:g}/s" if opts.ramp_rate else None})
    catalog = root / "catalog.json"
    catalog.write_text(json.dumps({"models": [{"id": m, "input_price": 1, "output_price": 1}
                                              for m in (IDLE_MODEL, ANSWER_MODEL)]}))
    args = ["--min-trust", "none", "--catalog", str(catalog)]
    prefix = "fleetbench" + secrets.token_hex(4)
    if k > 1:
        args += ["--nats-url", opts.nats_url, "--nats-subject-prefix", prefix,
                 "--redis-url", f"redis://127.0.0.1:6379/{secrets.randbelow(15) + 1}"]
    with ExitStack() as stack:
        database_url, database = stack.enter_context(fresh_database())
        log(f"[k={k} N={n:,}] database {database}; starting {k} coordinator(s)…")
        replicas = Replicas.start(root / f"k{k}-n{n}", database_url, k, args)
        stack.callback(replicas.kill)
        fleet: Fleet | None = None
        try:
            owners = [create_account(replicas.coords[0]) for _ in range(max(1, opts.owners))]
            consumer = create_account(replicas.coords[0], credit_micro_usd=10**12)
            tokens = seed_machines(database, owners, n, k)
            processes = client_processes(n, opts.clients)
            cell["client_processes"] = processes
            fleet = Fleet(specs_for(replicas.coords, tokens, opts.answerers), processes, k)
            counter = stack.enter_context(NatsCounter(opts.nats_url, prefix)) if k > 1 else None
            postgres = PostgresBackends(ADMIN_DSN, database)
            ramp(cell, replicas, fleet, postgres, n, opts)
            if not cell["ramp"]["complete"]:
                log(f"[k={k} N={n:,}] the ramp did not complete; skipping the rest of this cell")
                return
            idle(cell, replicas, fleet, postgres, counter, owners[0], n, opts)
            probes(cell, replicas, consumer, opts)
            if opts.storm != "none":
                storm(cell, replicas, fleet, n, opts)
        finally:
            # the coordinators first, with every session still connected: how long the last exit takes
            cell["load_after"] = os.getloadavg()[0]
            cell["final_exit_s"] = replicas.stop(opts.exit_timeout)
            if fleet is not None:
                fleet.stop()


def ramp(cell: dict[str, Any], replicas: Replicas, fleet: Fleet, postgres: PostgresBackends, n: int,
         opts: Options) -> None:
    time.sleep(1.0)  # let the coordinators settle after sign-ups
    rss0, cpu0, pg0, client0 = replicas.rss(), replicas.cpu(), postgres.cpu(), fleet.cpu()
    processes = len(fleet.procs)
    fleet.command("start", max(1, opts.ramp_inflight // processes), opts.ramp_rate / processes)
    log(f"[k={cell['k']} N={n:,}] ramp: {n:,} sessions in {processes} client process(es)…")
    seconds, status, complete = fleet.wait(lambda s: sum(s["registered"]) >= n, 60 + 0.06 * n, "ramp")
    cpu1, rss1, pg1, client1 = replicas.cpu(), replicas.rss(), postgres.cpu(), fleet.cpu()
    fleet.status(reset=True)
    registered = sum(status["registered"])
    cell["ramp"] = {"seconds": seconds, "complete": complete, "registered": registered,
                    "held": status["registered"], "failures": dict(status["failures"]),
                    "latency_p50_s": percentile(status["latencies"], 50),
                    "latency_p99_s": percentile(status["latencies"], 99)}
    cell["cpu_per_registration_ms"] = 1e3 * sum(b - a for a, b in zip(cpu0, cpu1)) / max(registered, 1)
    cell["rss_per_session_kb"] = sum(b - a for a, b in zip(rss0, rss1)) / max(registered, 1) / 1e3
    cell["rss_after_mb"] = [r / 1e6 for r in rss1]
    cell["postgres_cpu_per_registration_ms"] = 1e3 * PostgresBackends.spent(pg0, pg1) / max(registered, 1)
    cell["client_cpu_per_registration_ms"] = 1e3 * (client1 - client0) / max(registered, 1)
    log(f"  ramp: {registered:,}/{n:,} in {seconds:.1f} s, {cell['cpu_per_registration_ms']:.2f} ms CPU each, "
        f"{cell['rss_per_session_kb']:.0f} kB each")


def idle(cell: dict[str, Any], replicas: Replicas, fleet: Fleet, postgres: PostgresBackends,
         counter: NatsCounter | None, owner: Account, n: int, opts: Options) -> None:
    log(f"  idle: {opts.idle_seconds:g} s, no requests…")
    cpu0, pg0 = replicas.cpu(), postgres.cpu()
    t0 = time.monotonic()
    nats0 = counter.reading() if counter else None
    fleet0 = counter.fleet_bytes if counter else 0
    time.sleep(opts.idle_seconds)
    cpu1, pg1 = replicas.cpu(), postgres.cpu()
    window = time.monotonic() - t0
    cell["idle_window_s"] = window
    cell["idle_cpu_percent"] = [100 * (b - a) / window for a, b in zip(cpu0, cpu1)]
    cell["idle_us_per_session_s"] = 1e6 * sum(b - a for a, b in zip(cpu0, cpu1)) / window / n
    cell["postgres_idle_percent"] = 100 * PostgresBackends.spent(pg0, pg1) / window
    status = fleet.status(reset=True)
    cell["idle_lost"] = {"drops": status["drops"], "untrusted": status["untrusted"],
                         "registered": sum(status["registered"])}
    if counter is not None and nats0 is not None:
        t1, messages, size = counter.reading()
        cell["nats"] = {"bytes_per_s": (size - nats0[2]) / (t1 - nats0[0]),
                        "messages_per_s": (messages - nats0[1]) / (t1 - nats0[0]),
                        "fleet_bytes_per_s": (counter.fleet_bytes - fleet0) / (t1 - nats0[0]),
                        "largest_message": counter.largest, "max_payload": counter.max_payload}
        held = status["registered"]
        cell["fabric"] = [{"held": held[i], "sees_of_others": gauge(c.base_url, "darkbloom_fabric_remote_sessions"),
                           "others_hold": n - held[i],
                           "replicas_heard": gauge(c.base_url, "darkbloom_fabric_replicas"),
                           "dropped": counter_sum(c.base_url, "darkbloom_fabric_dropped_total"),
                           "owner_online": online(c, owner),
                           "owner_machines": sum(1 for m in range(n) if (m // len(held)) % opts.owners == 0)}
                          for i, c in enumerate(replicas.coords)]
    # the ramp's CPU less the idle cost of the sessions already connected (on average half of them)
    ramp_cpu = cell["cpu_per_registration_ms"] * cell["ramp"]["registered"] / 1e3
    idle_rate = sum(cell["idle_cpu_percent"]) / 100
    cell["cpu_per_registration_net_ms"] = 1e3 * (ramp_cpu - idle_rate * cell["ramp"]["seconds"] / 2) / n
    log(f"  idle: {' / '.join(f'{p:.1f} %' for p in cell['idle_cpu_percent'])} of a core, "
        f"{cell['idle_us_per_session_s']:.1f} µs/s per session")


def online(coord: Coordinator, owner: Account) -> int | None:
    """How many of ``owner``'s machines this replica lists online (`GET /v1/me/providers`)."""
    try:
        response = httpx.get(coord.api_url + "/me/providers", headers=owner.headers(), timeout=60, trust_env=False)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return sum(1 for m in response.json()["data"] if m["online"])


def probes(cell: dict[str, Any], replicas: Replicas, consumer: Account, opts: Options) -> None:
    coords = replicas.coords
    headers = consumer.headers()
    log("  probes: /v1/models, /health, public chat…")
    models = sequential(lambda c: c.get(coords[0].api_url + "/models", headers=headers), opts.models_requests, 60)
    with ThreadPoolExecutor(len(coords)) as pool:
        health = list(pool.map(lambda c: sequential(lambda h: h.get(c.base_url + "/health"), opts.health_requests,
                                                    60, gap=0.02), coords))
    turn = iter(range(10**9))
    cpu0, t0 = replicas.cpu(), time.monotonic()
    chat = sequential(lambda c: c.post(coords[next(turn) % len(coords)].api_url + "/chat/completions",
                                       json=CHAT_BODY, headers=headers), opts.chat_requests, 120,
                      ok=lambda r: r.status_code == 200 and "ok" in r.text)
    spent, window = sum(b - a for a, b in zip(cpu0, replicas.cpu())), time.monotonic() - t0
    idle_rate = sum(cell["idle_cpu_percent"]) / 100
    cell["models_p50_ms"], cell["models_p99_ms"], cell["models_requests"] = models.ms(50), models.ms(99), \
        len(models.seconds)
    cell["health_p99_ms"] = [h.ms(99) for h in health]
    cell["chat"] = {"p50_ms": chat.ms(50), "p99_ms": chat.ms(99), "ok": len(chat.seconds),
                    "failures": chat.failures,
                    "cpu_per_request_ms": 1e3 * (spent - idle_rate * window) / max(len(chat.seconds), 1)}
    failed: dict[str, Latencies] = {"models": models, **{f"health-{i}": h for i, h in enumerate(health)}}
    cell["probe_failures"] = {name: lat.failures for name, lat in failed.items() if lat.failures}
    log(f"  probes: /v1/models p50 {cell['models_p50_ms']:.1f} ms; chat p50 {chat.ms(50):.1f} / p99 "
        f"{chat.ms(99):.1f} ms ({len(chat.seconds)} ok, failures {chat.failures})")


def storm(cell: dict[str, Any], replicas: Replicas, fleet: Fleet, n: int, opts: Options) -> None:
    log(f"  storm ({opts.storm}): all {n:,} sessions dropped at once…")
    fleet.status(reset=True)
    started = time.monotonic()
    fleet.command("mark", started)
    result: dict[str, Any] = {"mode": opts.storm}
    if opts.storm == "restart":
        result["exit_s"] = replicas.stop(opts.exit_timeout)
        replicas.restart()
        result["restarted_after_s"] = time.monotonic() - started
    else:
        cpu0 = replicas.cpu()
        fleet.command("drop")
    _, status, complete = fleet.wait(lambda s: len(s["since_mark"]) >= n, 60 + 0.06 * n, "storm")
    since = status["since_mark"]
    if opts.storm == "drop":
        spent = sum(b - a for a, b in zip(cpu0, replicas.cpu()))
        result["cpu_per_reregistration_ms"] = 1e3 * spent / max(len(since), 1)
    # from the drop (the mark) to the last session's registration
    result.update({"all_registered_s": max(since) if complete and since else None,
                   "waited_s": time.monotonic() - started,
                   "reregistered": len(since), "p50_s": percentile(since, 50), "p99_s": percentile(since, 99),
                   "attempts": status["attempts"], "failures": dict(status["failures"]),
                   "untrusted": status["untrusted"]})
    cell["storm"] = result
    failures = sum(status["failures"].values())
    log(f"  storm: {len(since):,}/{n:,} again in {result['waited_s']:.1f} s{'' if complete else ' (gave up)'}, "
        f"{status['attempts']:,} attempts, {failures:,} failed {dict(status['failures'])}")


# the tables


def _pct(values: list[float]) -> str:
    return " / ".join(f"{v:.1f} %" for v in values)


def _ms(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else (f"{x:,.0f} ms" if x >= 100 else f"{x:.1f} ms")


def _storm_cell(c: dict[str, Any]) -> str:
    s = c.get("storm")
    if not s:
        return "–"
    time_text = f"{s['all_registered_s']:.1f} s" if s["all_registered_s"] is not None else \
        f"**not all in {s['waited_s']:.0f} s** ({s['reregistered']:,})"
    up = f" (new process up at {s['restarted_after_s']:.1f} s)" if "restarted_after_s" in s else ""
    return f"{time_text}{up}, p50 {s['p50_s']:.1f} s"


def _failures(failures: dict[str, int]) -> str:
    return ", ".join(f"{v:,} {k}" for k, v in sorted(failures.items(), key=lambda kv: -kv[1])) or "0"


def tables(cells: list[dict[str, Any]]) -> str:
    cells = [c for c in cells if "ramp" in c]
    done = [c for c in cells if "idle_cpu_percent" in c]
    lines = ["| k | sessions | ramp | coordinator CPU per registration | idle CPU per replica (% of a core) "
             "| idle CPU per session | RSS per session | `GET /v1/models` p50 | public p50 / p99 "
             "| all N reconnecting at once | failed attempts in the storm | old process exit |",
             "|---" * 12 + "|"]
    for c in cells:
        if c not in done:
            r = c.get("ramp", {})
            how = "interrupted" if c.get("interrupted") else "gave up"
            lines.append(f"| {c['k']} | {_size(c)} | **{r.get('registered', 0):,} registered in "
                         f"{r.get('seconds', 0):.0f} s, {how}** ({_failures(r.get('failures', {}))}) |" + " |" * 9)
            continue
        ramp_text = f"{c['ramp']['seconds']:.1f} s ({c['n'] / c['ramp']['seconds']:,.0f}/s)"
        s = c.get("storm") or {}
        exits = " / ".join("killed" if e is None else f"{e:.1f} s" for e in s.get("exit_s", [])) or "–"
        lines.append(f"| {c['k']} | {_size(c)} | {ramp_text} | {c['cpu_per_registration_ms']:.2f} ms "
                     f"| {_pct(c['idle_cpu_percent'])} | {c['idle_us_per_session_s']:.1f} µs/s "
                     f"| {c['rss_per_session_kb']:.0f} kB | {_ms(c['models_p50_ms'])} "
                     f"| {_ms(c['chat']['p50_ms'])} / {_ms(c['chat']['p99_ms'])} | {_storm_cell(c)} "
                     f"| {_failures(s.get('failures', {}))} | {exits} |")
    lines += ["", "| k | sessions | CPU per registration, net of idle | client CPU per registration "
              "| Postgres CPU per registration | Postgres idle "
              "| registration latency p50 / p99 (ramp) | failed attempts in the ramp | lost while idle "
              "| public requests ok | CPU per public request (net of idle) | `/health` p99 per replica |",
              "|---" * 12 + "|"]
    for c in done:
        r = c["ramp"]
        lost = c["idle_lost"]
        lines.append(f"| {c['k']} | {c['n']:,} | {c['cpu_per_registration_net_ms']:.2f} ms "
                     f"| {c['client_cpu_per_registration_ms']:.2f} ms "
                     f"| {c['postgres_cpu_per_registration_ms']:.2f} ms | {c['postgres_idle_percent']:.1f} % "
                     f"| {1e3 * r['latency_p50_s']:,.0f} / {1e3 * r['latency_p99_s']:,.0f} ms "
                     f"| {_failures(r['failures'])} | {lost['drops']} dropped, {lost['untrusted']} untrusted "
                     f"| {c['chat']['ok']} of {c['chat']['ok'] + sum(c['chat']['failures'].values())} "
                     f"| {c['chat']['cpu_per_request_ms']:.1f} ms "
                     f"| {' / '.join(_ms(h) for h in c['health_p99_ms'])} |")
    multi = [c for c in done if c["k"] > 1]
    if multi:
        lines += ["", "| k | N | sessions held per replica | what each replica sees of the others "
                  "| owner 0's machines listed online per replica | idle CPU per replica "
                  "| NATS bytes/s published (fleet subject) | largest message "
                  "| `/health` p99 per replica | fabric messages dropped |", "|---" * 10 + "|"]
        for c in multi:
            fabric = c["fabric"]
            sees = " / ".join(f"{_num(f['sees_of_others'])} of {f['others_hold']:,}" for f in fabric)
            listed = " / ".join(f"{_num(f['owner_online'])} of {f['owner_machines']:,}" for f in fabric)
            nats = c["nats"]
            held = " / ".join(f"{f['held']:,}" for f in fabric)
            dropped = " / ".join(f"{f['dropped']:.0f}" for f in fabric)
            lines.append(f"| {c['k']} | {c['n']:,} | {held} | {sees} | {listed} "
                         f"| {_pct(c['idle_cpu_percent'])} | {_bytes(nats['bytes_per_s'])}/s "
                         f"({_bytes(nats['fleet_bytes_per_s'])}/s) | {_bytes(nats['largest_message'])} "
                         f"(max_payload {nats['max_payload'] / 2**20:.0f} MiB) "
                         f"| {' / '.join(_ms(h) for h in c['health_p99_ms'])} "
                         f"| {dropped} |")
    return "\n".join(lines)


def _size(cell: dict[str, Any]) -> str:
    return f"{cell['n']:,}" + (f" ({cell['run']})" if cell.get("run") else "")


def _bytes(x: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:,.0f}"


def report_laws(cells: list[dict[str, Any]], n: int, k: int) -> str:
    done = [c for c in cells if "idle_cpu_percent" in c]
    found = laws(done)
    lines = ["Fitted laws (least squares over the cells above):"]
    for law in found.values():
        lines.append("- " + law.text({"N": (1e3, "per 1,000 sessions of the fleet"),
                                      "N/k": (1e3, "per 1,000 sessions held"),
                                      "N/k announced": (1e3, "per 1,000 sessions held and announced (k > 1)"),
                                      "N heard": (1e3, "per 1,000 sessions of the fleet heard (k > 1)")}))
    left_out = [f"k={c['k']} N={c['n']:,}" for c in done if not heard_each_other(c)]
    if left_out:
        lines.append(f"  ({', '.join(left_out)}: its replicas did not hear each other; fitted with nothing heard)")
    return "\n".join(lines + [""] + projection(done, n, k))


# the command line


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the run as Ctrl-C does: every `finally` runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,1000", help="fleet sizes N, comma-separated")
    parser.add_argument("--replicas", default="1", help="replica counts k, comma-separated")
    parser.add_argument("--idle-seconds", type=float, default=60.0,
                        help="idle window (≥ 60 s includes every session's once-a-minute `last_seen` write)")
    parser.add_argument("--storm", choices=("restart", "drop", "none"), default="restart")
    parser.add_argument("--clients", type=int, default=0, help="client processes (0: one per 2,500 sessions, ≤ 4)")
    parser.add_argument("--answerers", type=int, default=4, help="sessions that answer the public requests")
    parser.add_argument("--owners", type=int, default=10, help="accounts owning the machines")
    parser.add_argument("--ramp-inflight", type=int, default=64, help="registrations in flight at once (all clients)")
    parser.add_argument("--ramp-rate", type=float, default=0.0, help="sessions started per second (0: no limit)")
    parser.add_argument("--models-requests", type=int, default=100)
    parser.add_argument("--chat-requests", type=int, default=30)
    parser.add_argument("--health-requests", type=int, default=200)
    parser.add_argument("--exit-timeout", type=float, default=60.0, help="seconds a replica may take to exit")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--project", default="100000,10", help="N,k to project the fitted laws to")
    parser.add_argument("--json", type=Path, default=None, help="also write every cell's figures here ('-': stdout)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: print the tables and laws of the cells in these --json files, together")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: N=100, k=1, 10 s idle, few probes (unless given explicitly)")
    args = parser.parse_args()
    pn, pk = (int(x) for x in args.project.split(","))
    if args.report:
        runs = [json.loads(path.read_text()) for path in args.report]
        print("\n".join(run["header"] for run in runs))
        cells = [cell for run in runs for cell in run["cells"]]
        print(f"\n{tables(cells)}\n\n{report_laws(cells, pn, pk)}")
        return
    given = set(a.split("=")[0] for a in sys.argv[1:])
    if args.quick:
        for flag, value in (("--sizes", "100"), ("--idle-seconds", 10.0), ("--models-requests", 20),
                            ("--chat-requests", 10), ("--health-requests", 50)):
            if flag not in given:
                setattr(args, flag.removeprefix("--").replace("-", "_"), value)
    sizes = [int(s) for s in str(args.sizes).split(",")]
    ks = [int(k) for k in str(args.replicas).split(",")]
    opts = Options(args.idle_seconds, args.storm, args.clients, args.answerers, args.owners, args.ramp_inflight,
                   args.ramp_rate, args.models_requests, args.chat_requests, args.health_requests, args.nats_url,
                   args.exit_timeout)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the coordinators and clients
    if max(sizes) + 1000 > hard:
        log(f"warning: the open-file limit is {hard}; {max(sizes):,} sessions need about as many sockets")
    signal.signal(signal.SIGTERM, _interrupted)
    root = Path(tempfile.mkdtemp(prefix="darkbloom-fleet-"))
    header = (f"# fleet_scale — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} — {machine()}\n"
              f"# {tree_state()}; 1-min load {os.getloadavg()[0]:.2f} before; logs under {root}\n"
              f"# `{' '.join(['bench/fleet_scale.py', *sys.argv[1:]])}`")
    print(header, flush=True)
    cells: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for k in ks:
            for n in sizes:
                cells.append({})
                run_cell(root, k, n, opts, cells[-1])
    except KeyboardInterrupt:
        if cells:
            cells[-1]["interrupted"] = True
        log("interrupted: every process of this run is stopped")
    finally:
        print(f"\n{tables(cells)}\n", flush=True)
        print(report_laws(cells, pn, pk), flush=True)
        print(f"\n1-min load {os.getloadavg()[0]:.2f} after; {time.monotonic() - started:.0f} s in all", flush=True)
        if args.json is not None:
            text = json.dumps({"header": header, "cells": cells}, indent=1, default=str)
            if str(args.json) == "-":
                print(text)
            else:
                args.json.write_text(text)


if __name__ == "__main__":
    main()
