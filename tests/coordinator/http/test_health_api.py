"""Public endpoints (docs/api.md "Public endpoints"): liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.coordinator.http.conftest import Api, bearer
from tests.support.raw_provider import ThreadedRaw


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


def _histogram_counts(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s observation count per label set; also checks each +Inf bucket holds all of them."""
    [family] = [f for f in text_string_to_metric_families(text) if f.name == name]
    assert family.type == "histogram"
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    infinite: dict[tuple[tuple[str, str], ...], float] = {}
    for sample in family.samples:
        if sample.name == name + "_count":
            counts[tuple(sorted(sample.labels.items()))] = sample.value
        elif sample.name == name + "_bucket" and sample.labels["le"] == "+Inf":
            infinite[tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))] = sample.value
    assert counts == infinite
    return counts


def test_metrics_has_latency_histograms_after_a_registration_and_requests(api: Api) -> None:
    owner = api.signup()
    token, key = api.link_machine(owner)["token"], bearer(api.create_key(owner)["key"])
    body: dict[str, Any] = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hello"}]}
    before = api.get("/metrics").text
    provider = ThreadedRaw(api.coordinator.base_url, token, answer="hi")  # returns once registered
    try:
        plain = api.post("/v1/chat/completions", json=body, headers={**key, "X-Darkbloom-Route": "self"})
        assert plain.status_code == 200, plain.text
        streamed = api.post("/v1/chat/completions", json={**body, "stream": True},
                            headers={**key, "X-Darkbloom-Route": "self"})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert api.post("/v1/chat/completions", json={**body, "model": "no-such-model"}, headers=key
                        ).status_code == 404
        after = api.get("/metrics").text
    finally:
        provider.close()

    def grew(name: str, **labels: str) -> float:
        label_set = tuple(sorted(labels.items()))
        return _histogram_counts(after, name)[label_set] - _histogram_counts(before, name).get(label_set, 0)

    chat = "/v1/chat/completions"
    assert grew("darkbloom_request_duration_seconds", api=chat, outcome="ok") == 2  # answered and streamed
    assert grew("darkbloom_request_duration_seconds", api=chat, outcome="refused") == 1
    assert grew("darkbloom_placement_seconds", route="exclusive") == 2
    assert grew("darkbloom_time_to_first_content_seconds", api=chat) == 2
    assert grew("darkbloom_registration_seconds", trust="self_signed") == 1
