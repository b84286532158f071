"""Cost laws fitted to bench/fleet_scale.py's cells, and what they project for a bigger fleet.

Each law is an ordinary least-squares fit over the cells that measured it. Per-replica idle CPU is
α·(N/k) + α′·(N/k)·[k>1] + β·N·[k>1] + γ: what a replica pays for each session it holds (heartbeats,
pings, bookkeeping), for announcing each of them over NATS, for hearing each session of the fleet
announced (its own come back too), and for nothing; a cell whose replicas did not hear each other
(announcements over the bus's payload limit, never published) heard nothing: its β term is 0. On one
replica: CPU per registration, RSS per session, the listing's p50 and the storm's length against N.
With replicas, the idle NATS traffic against N and k (before issue 21 every replica announced all its
sessions every second: ~700 B/s per session of the fleet; since, deltas and a small heartbeat).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Law:
    """y ≈ Σ coefficient·term + constant, with the terms' names (for printing)."""

    what: str
    unit: str
    terms: tuple[str, ...]
    coefficients: tuple[float, ...]
    constant: float
    points: int

    def at(self, **values: float) -> float:
        return sum(c * values[t] for t, c in zip(self.terms, self.coefficients)) + self.constant

    def text(self, scale: dict[str, tuple[float, str]] | None = None) -> str:
        """``scale`` maps a term to (factor, how to name it): e.g. {"N": (1e3, "per 1,000 sessions")}."""
        scale = scale or {}
        parts = []
        for term, c in zip(self.terms, self.coefficients):
            factor, name = scale.get(term, (1.0, f"× {term}"))
            parts.append(f"{_number(c * factor)} {self.unit} {name}")
        parts.append(f"{_number(self.constant)} {self.unit}")
        return f"{self.what} ≈ " + " + ".join(parts) + f"  ({self.points} points)"


def _number(x: float) -> str:
    if x == 0 or math.isnan(x):
        return f"{x:g}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:,.{digits}f}"


def fit(what: str, unit: str, rows: list[tuple[dict[str, float], float]], terms: tuple[str, ...]) -> Law | None:
    """Least squares of y on ``terms`` plus a constant; None when the points cannot pin them down."""
    rows = [(x, y) for x, y in rows if not math.isnan(y)]
    if len(rows) < len(terms) + 1:
        return None
    a = np.array([[x[t] for t in terms] + [1.0] for x, _ in rows])
    if np.linalg.matrix_rank(a) < len(terms) + 1:
        return None
    solution, *_ = np.linalg.lstsq(a, np.array([y for _, y in rows]), rcond=None)
    return Law(what, unit, terms, tuple(float(c) for c in solution[:-1]), float(solution[-1]), len(rows))


IDLE_TERMS = ("N/k", "N/k announced", "N heard")


def idle_terms(n: float, k: int, heard: bool = True) -> dict[str, float]:
    fabric = 1.0 if k > 1 else 0.0
    return {"N/k": n / k, "N/k announced": fabric * n / k, "N heard": fabric * n if heard else 0.0}


def heard_each_other(cell: dict[str, Any]) -> bool:
    """k = 1, or every replica saw every session the others hold."""
    return cell["k"] == 1 or all(f["sees_of_others"] is not None and f["sees_of_others"] >= f["others_hold"]
                                 for f in cell.get("fabric", []))


def laws(cells: list[dict[str, Any]]) -> dict[str, Law]:
    """Every law the cells pin down, by name."""
    found: dict[str, Law | None] = {}
    # µs of CPU per second = % of a core × 10,000
    replica_idle = [(idle_terms(c["n"], c["k"], heard_each_other(c)), per_replica * 1e4)
                    for c in cells for per_replica in c["idle_cpu_percent"]]
    # the fullest model whose costs are all ≥ 0: since issue 21 nothing is announced per session per
    # second, and a fit with that term then gives it a negative cost out of noise
    for terms in (IDLE_TERMS, ("N/k", "N heard"), ("N/k",)):
        law = fit("idle CPU per replica", "µs/s", replica_idle, terms)
        if law is not None and min(law.coefficients) >= 0:
            found["idle"] = law
            break
    one = [c for c in cells if c["k"] == 1]
    found["registration"] = fit("CPU per registration", "ms",
                                [({"N": c["n"]}, c["cpu_per_registration_ms"]) for c in one], ("N",))
    found["registration_net"] = fit("CPU per registration, net of idle", "ms",
                                    [({"N": c["n"]}, c["cpu_per_registration_net_ms"]) for c in one], ("N",))
    found["rss"] = fit("RSS per session", "kB", [({"N": c["n"]}, c["rss_per_session_kb"]) for c in one], ("N",))
    found["models"] = fit("GET /v1/models p50", "ms", [({"N": c["n"]}, c["models_p50_ms"]) for c in one], ("N",))
    found["storm"] = fit("all N re-registered after a restart", "s",
                         [({"N": c["n"]}, c["storm"]["all_registered_s"]) for c in one
                          if c.get("storm") and c["storm"].get("all_registered_s") is not None], ("N",))
    found["nats"] = fit("idle NATS bytes/s, all replicas", "B/s",
                        [({"N": c["n"], "k": c["k"]}, c["nats"]["bytes_per_s"]) for c in cells
                         if c["k"] > 1 and c.get("nats") and heard_each_other(c)], ("N", "k"))
    return {name: law for name, law in found.items() if law is not None}


def largest_message(cells: list[dict[str, Any]]) -> tuple[int, int] | None:
    """The largest fabric message any cell saw, and the bus's max_payload then."""
    seen = [(c["nats"]["largest_message"], c["nats"]["max_payload"]) for c in cells if c["k"] > 1 and c.get("nats")]
    return max(seen) if seen else None


def projection(cells: list[dict[str, Any]], n: int, k: int) -> list[str]:
    """What the fitted laws say of ``n`` machines on ``k`` replicas, one line each."""
    found = laws(cells)
    lines = [f"Projection to {n:,} machines on {k} replicas ({n // k:,} sessions per replica):"]
    idle = found.get("idle")
    if idle is not None:
        per_replica = idle.at(**idle_terms(n, k))
        lines.append(f"- idle CPU per replica ≈ {per_replica / 1e6:.2f} cores")
        if "N heard" in idle.terms:
            beta = idle.coefficients[idle.terms.index("N heard")]
            if beta > 0:
                lines.append(f"- hearing the fleet alone fills a replica's core at N ≈ {1e6 / beta:,.0f}, "
                             f"whatever k (β = {beta:.1f} µs/s per session of the fleet)")
            per_session = idle.at(**idle_terms(1, k)) - idle.constant  # µs/s per machine of the fleet, on k
            lines.append(f"- one event loop per replica (a core at most) idles full at N ≈ "
                         f"{(1e6 - idle.constant) / per_session:,.0f} on {k} replicas")
    one = [c for c in cells if c["k"] == 1]
    if one:
        largest = max(one, key=lambda c: c["n"])  # per-session RSS is flat; small N is all fixed overhead
        per = largest["rss_per_session_kb"]
        lines.append(f"- RSS per replica ≈ {per * n / k / 1e6:.2f} GB for its own sessions ({per:.0f} kB each, "
                     f"as at N = {largest['n']:,})")
    if (reg := found.get("registration_net") or found.get("registration")) is not None:
        per = reg.at(N=n / k)
        lines.append(f"- a storm of {n // k:,} registrations per replica needs ≥ {per * n / k / 1e3:,.0f} s "
                     f"of CPU each ({per:.1f} ms per registration at N/k)")
    if (storm := found.get("storm")) is not None:
        lines.append(f"- all re-registered after a restart, one replica of {n // k:,}: ≈ {storm.at(N=n / k):,.0f} s "
                     f"(k = 1 law)")
    if (models := found.get("models")) is not None:
        lines.append(f"- GET /v1/models p50 at N = {n:,} (every replica lists the whole fleet): "
                     f"≈ {models.at(N=n):,.0f} ms")
    if (nats := found.get("nats")) is not None:
        published = nats.at(N=n, k=k)
        lines.append(f"- idle fabric traffic ≈ {published / 1e6:,.3f} MB/s published (the NATS law above); "
                     f"delivered to k subscribers ≈ {published * k / 1e6:,.3f} MB/s")
    if (largest := largest_message(cells)) is not None:
        lines.append(f"- largest fabric message in these cells: {largest[0] / 1e3:,.1f} kB "
                     f"(max_payload {largest[1] / 2**20:g} MiB)")
    return lines
