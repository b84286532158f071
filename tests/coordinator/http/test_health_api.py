"""Public endpoints (docs/api.md "Public endpoints"): liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.coordinator.http.conftest import Api


def test_health(api: Api) -> None:
    resp = api.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_readyz_reports_the_database(api: Api) -> None:
    resp = api.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ready", "database": "ok"}


def test_metrics_is_prometheus_text(api: Api) -> None:
    resp = api.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(resp.text))
    assert families
    assert all(f.name and f.type for f in families)
    assert "# HELP" in resp.text and "# TYPE" in resp.text


def test_public_endpoints_need_no_auth_and_ignore_a_bad_token(api: Api) -> None:
    for path in ("/health", "/readyz", "/metrics"):
        assert api.get(path, headers={"Authorization": "Bearer dk-garbage"}).status_code == 200
