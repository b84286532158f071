"""A catalog stored through one replica (PUT /v1/admin/catalog) is taken up by the others: they read
the stored one every few seconds (routing/live_catalog.py), so a weight pin or a price change does
not stop at the replica that received it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.processes import wait_until
from tests.support.replicas import replica_set

pytestmark = pytest.mark.e2e


def test_a_catalog_put_on_one_replica_reaches_the_other(tmp_path: Path) -> None:
    with replica_set(tmp_path, 2) as replicas:
        a, b = replicas.coordinators
        entry = {"id": "smollm2-135m", "input_price": 7, "output_price": 11, "weight_hash": "sha256:" + "c" * 64,
                 "context_length": 4096}
        stored = httpx.put(a.api_url + "/admin/catalog", headers=a.admin(), json={"models": [entry]}, timeout=30)
        assert stored.status_code == 200, stored.text

        def on_b() -> bool:
            data = httpx.get(b.api_url + "/models/catalog", timeout=10).json()["data"]
            return data == [{**entry, "aliases": [], "max_output_tokens": 4096}]
        wait_until(on_b, timeout=30, interval=0.2, what="the catalog on the other replica")
