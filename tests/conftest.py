"""Shared fixtures: database URLs (SQLite and the machine's Postgres), real coordinator processes;
and how the suite is marked and split among pytest-xdist's workers (``--dist loadscope``, with its own units)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from darkbloom.store import create_engine, migrate
from tests.support.databases import database_for, postgres_database
from tests.support.processes import Coordinator, start_coordinator
from tests.support.replicas import ACROSS_REPLICAS

# A shell's background job (`make check &`) ignores SIGINT, and a process inherits an ignored signal
# through exec: the tests that stop a process with Ctrl-C (a pull, the demo, tshark) would signal
# nothing. A handled signal is reset to its default in a child, so the run handles it (here, and in
# every xdist worker, which loads this file too).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# llama.cpp's threads meet at an OpenMP barrier after every step; by default they spin there, and on
# a machine busier than its cores (xdist workers, nodes, coordinators) a spinning thread holds the
# core its peer needs: a generation ran 4x slower. Waiting threads sleep instead, here and in every
# process a test starts (set before llama.cpp is loaded).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh Postgres database for this test, dropped afterwards."""
    with postgres_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'coordinator.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with database_for(request.param, tmp_path) as url:
        yield url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated engine on each backend (``database_url`` covers SQLite and Postgres)."""
    engine = create_engine(database_url)
    await migrate(engine)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def coordinator(tmp_path: Path, sqlite_url: str) -> Iterator[Coordinator]:
    """A real coordinator process on SQLite."""
    coord = start_coordinator(tmp_path / "coordinator-home", sqlite_url)
    try:
        yield coord
    finally:
        coord.stop()


# Modules that share one thing on the machine run one after another, on one worker: Redis db 0 (the
# sign-up and log-in counters of 127.0.0.1); loopback captures by tshark (one interface, filters by
# port) whose tests also count every request. The bundled model, run in the test process or by
# llama_cpp.server (the ``upstream`` fixture, in "llama-b"), is in two groups of about equal length:
# two generations at once on two cores, never four. MLX's CPU build (one thread) generates in "mlx".
SHARED = {
    "tests/coordinator/http/test_auth_throttle_api.py": "redis-db0",
    "tests/e2e/test_rate_limits.py": "redis-db0",
    "tests/reliability/test_capture.py": "capture",
    "tests/reliability/test_capture_nats.py": "capture",
    **{f"tests/{module}.py": "llama-a" for module in (
        "provider/test_llama_backend", "provider/test_llama_hostile_requests", "provider/test_llama_text_apis")},
    **{f"tests/{module}.py": "llama-b" for module in (
        "coordinator/inference/test_token_bounds", "provider/direct/test_direct_apis_real",
        "provider/direct/test_local_server", "provider/direct/test_node_direct", "provider/test_llama_tools",
        "provider/test_node", "provider/test_node_cancel", "provider/test_openai_backend")},
    **{f"tests/{module}.py": "mlx" for module in (
        "provider/test_mlx_backend", "e2e/test_mlx_node", "provider/models/test_convert")},
}
# Packages whose processes are package-scoped fixtures: the whole package on one worker.
PACKAGES = ("tests/clients/",)
# The longest units (a make test's durations), handed out first so that none is left running alone
# at the end; the rest follow in collection order. Order only: a stale entry costs balance, not
# correctness.
LONGEST_FIRST = ("tests/clients/", "tests/reliability/test_schemathesis.py", "llama-b", "redis-db0", "llama-a", "mlx",
                 "tests/reliability/test_chaos_money.py", "capture", "tests/coordinator/fabric/test_faults.py",
                 "tests/coordinator/money/test_e2e_billing.py", "tests/reliability/test_chaos_money_replicas.py",
                 "tests/coordinator/money/test_conservation.py", "tests/coordinator/money/test_crash_under_load.py")


# Packages whose every test is e2e: `make check` (-m "not e2e") does not import them at all (their
# client SDKs cost each xdist worker seconds of collection); a test in them without the mark is an error
E2E_PACKAGES = ("batches", "clients", "console", "e2e", "selfroute")
TESTS = Path(__file__).parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.option.markexpr == "not e2e" and collection_path.parent == TESTS:
        return collection_path.name in E2E_PACKAGES or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _uses_postgres(item):
            item.add_marker(pytest.mark.postgres)
        package = item.path.relative_to(TESTS).parts[0]
        if package in E2E_PACKAGES and item.get_closest_marker("e2e") is None:
            raise pytest.UsageError(f"{item.nodeid} is not marked e2e, and tests/{package}/ holds e2e tests only")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection order is the scheduler's queue
        items[:] = _longest_first(items)


def _longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items unit by unit, the units of LONGEST_FIRST first; within a unit, collection order."""
    units = [work_unit(item.nodeid) for item in items]
    first_seen = {unit: index for index, unit in reversed(list(enumerate(units)))}
    rank = {unit: position for position, unit in enumerate(LONGEST_FIRST)}
    order = sorted(range(len(items)), key=lambda i: (rank.get(units[i], len(rank)), first_seen[units[i]], i))
    return [items[i] for i in order]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with the units above: each unit (module, package or shared group) runs
    whole on one worker, in the workers' collection order (LONGEST_FIRST first). (xdist's own
    ``loadgroup`` marks items by renaming their node ids, which pytest 9.2 no longer reads: it
    grouped nothing.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # not by test count: a few long tests make a long unit

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByUnit(config, log)


def work_unit(nodeid: str) -> str:
    """The unit a worker runs whole: a module by default (its module-scoped coordinators and nodes
    start once), a package where fixtures are package-scoped, or a group of modules sharing a resource.
    A module whose tests run on one coordinator and across replicas (tests/selfroute/conftest.py) is
    two units, one per stack, as two modules would be."""
    module, _, test = nodeid.partition("::")
    for package in PACKAGES:
        if module.startswith(package):
            return package
    if ACROSS_REPLICAS in test.partition("[")[2].rstrip("]").split("-"):
        return f"{module}[{ACROSS_REPLICAS}]"
    return SHARED.get(module, module)


def _uses_postgres(item: pytest.Item) -> bool:
    """A fresh database from ``postgres_url``, or the ``postgres`` case of a backend parameter. Replica
    sets are marked where they are made: tests/selfroute's by the fixture parameter, others by their module."""
    callspec = getattr(item, "callspec", None)
    return "postgres_url" in item.fixturenames or (callspec is not None and "postgres" in callspec.params.values())
