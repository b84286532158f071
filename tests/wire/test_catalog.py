"""The model catalog: costs (docs/billing.md "Money"), aliases, uniqueness, JSON and TOML files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from darkbloom.wire.catalog import BUNDLED_MODEL_ID, Catalog, CatalogModel


def _model(**fields: object) -> CatalogModel:
    return CatalogModel(**{"id": "m", "input_price": 50_000, "output_price": 200_000, **fields})


@pytest.mark.parametrize("prompt, completion, expected", [
    (0, 0, 0),
    (1, 0, 1),             # 0.05 µUSD rounds up to 1
    (0, 1, 1),             # 0.2 µUSD rounds up to 1
    (1, 1, 2),             # each side rounds up on its own
    (20, 0, 1),            # exactly 1.0: no extra rounding
    (21, 0, 2),
    (0, 5, 1),             # exactly 1.0
    (0, 6, 2),
    (1_000_000, 1_000_000, 250_000),
    (1_000_001, 999_999, 50_001 + 200_000),
])
def test_cost_rounds_each_side_up(prompt: int, completion: int, expected: int) -> None:
    assert _model().cost(prompt, completion) == expected
    assert isinstance(_model().cost(prompt, completion), int)


def test_cost_ceil_is_per_side_not_on_the_sum() -> None:
    model = _model(input_price=500_000, output_price=500_000)
    # 0.5 + 0.5 = 1.0 would be 1 on the sum; the cost rounds each term up: 1 + 1
    assert model.cost(1, 1) == 2


def test_cost_is_exact_integer_arithmetic_for_large_counts() -> None:
    """Money is never a float: the result is exact even where float division would round."""
    model = _model(input_price=1_000_001, output_price=0)
    prompt = 10**11 + 1  # float division gives 100000100001; the exact ceiling is 100000100002
    exact = -(-(prompt * 1_000_001) // 1_000_000)
    assert model.cost(prompt, 0) == exact


def test_free_model_costs_nothing() -> None:
    assert _model(input_price=0, output_price=0).cost(10_000, 10_000) == 0


def test_default_catalog() -> None:
    catalog = Catalog.default()
    model = catalog.resolve(BUNDLED_MODEL_ID)
    assert BUNDLED_MODEL_ID == "smollm2-135m"
    assert model is not None and (model.input_price, model.output_price) == (50_000, 200_000)


def test_resolve_by_id_and_alias() -> None:
    catalog = Catalog(models=[_model(id="a", aliases=["alpha", "a-latest"]), _model(id="b")])
    assert catalog.resolve("a").id == "a"  # type: ignore[union-attr]
    assert catalog.resolve("alpha").id == "a"  # type: ignore[union-attr]
    assert catalog.resolve("a-latest").id == "a"  # type: ignore[union-attr]
    assert catalog.resolve("b").id == "b"  # type: ignore[union-attr]
    assert catalog.resolve("c") is None
    assert catalog.resolve("A") is None  # ids are exact


@pytest.mark.parametrize("models", [
    [{"id": "a"}, {"id": "a"}],
    [{"id": "a", "aliases": ["x"]}, {"id": "b", "aliases": ["x"]}],
    [{"id": "a"}, {"id": "b", "aliases": ["a"]}],
    [{"id": "a", "aliases": ["a"]}],
    [{"id": "a", "aliases": ["x", "x"]}],
])
def test_duplicate_names_are_rejected(models: list[dict]) -> None:
    with pytest.raises(ValidationError, match="appears twice"):
        Catalog.model_validate({"models": [{"input_price": 1, "output_price": 1, **m} for m in models]})


@pytest.mark.parametrize("fields", [
    {"input_price": -1}, {"output_price": -1}, {"id": ""}, {"max_output_tokens": 0}, {"unknown": 1},
    {"input_price": "cheap"},
])
def test_invalid_models_are_rejected(fields: dict) -> None:
    with pytest.raises(ValidationError):
        _model(**fields)


def test_a_source_is_a_gguf_file_or_a_whole_mlx_repo() -> None:
    gguf = _model(source={"repo": "o/n", "file": "sub/m.Q4_K_M.gguf"})
    assert gguf.format == "gguf" and gguf.source is not None and gguf.source.file == "sub/m.Q4_K_M.gguf"
    for source in ({"repo": "o/n"}, {"repo": "o/n", "file": ""}, {"repo": "o/n", "revision": "v1"}):
        mlx = _model(format="mlx", source=source)
        assert mlx.source is not None and mlx.source.file is None
        # what GET /v1/models/catalog serves: no file for an MLX model
        assert mlx.model_dump(exclude_none=True)["source"] == {"repo": "o/n", "revision": source.get("revision",
                                                                                                         "main")}
    assert _model(format="mlx").format == "mlx"  # no source: a model the operator does not say how to pull


@pytest.mark.parametrize(("fields", "cause"), [
    ({"source": {"repo": "o/n"}}, "a gguf model's source needs its file"),
    ({"source": {"repo": "o/n", "file": "model.safetensors"}}, "a gguf model's source needs its file"),
    ({"source": {"repo": "o/n", "file": "a\\b.gguf"}}, "a gguf model's source needs its file"),
    ({"source": {"repo": "o/n", "file": ".gguf"}}, "a gguf model's source needs its file"),
    ({"format": "mlx", "source": {"repo": "o/n", "file": "m.gguf"}}, "an mlx model's source names its repo only"),
    ({"format": "safetensors"}, "format"),
])
def test_a_source_that_does_not_fit_the_format_is_rejected(fields: dict, cause: str) -> None:
    with pytest.raises(ValidationError, match=cause):
        _model(**fields)


def _expected(catalog: Catalog) -> None:
    a, b = catalog.resolve("alpha"), catalog.resolve("b")
    assert a is not None and b is not None
    assert (a.id, a.input_price, a.output_price, a.max_output_tokens, a.weight_hash) == \
        ("a", 100, 300, 512, "sha256:abababababababababababababababababababababababababababababababab")
    assert (b.id, b.aliases, b.max_output_tokens, b.weight_hash) == ("b", [], 4096, None)


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps({"models": [
        {"id": "a", "aliases": ["alpha"], "input_price": 100, "output_price": 300, "max_output_tokens": 512,
         "weight_hash": "sha256:abababababababababababababababababababababababababababababababab"},
        {"id": "b", "input_price": 1, "output_price": 2},
    ]}))
    _expected(Catalog.load(path))


def test_load_toml(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text("""
[[models]]
id = "a"
aliases = ["alpha"]
input_price = 100
output_price = 300
max_output_tokens = 512
weight_hash = "sha256:abababababababababababababababababababababababababababababababab"

[[models]]
id = "b"
input_price = 1
output_price = 2
""")
    _expected(Catalog.load(path))


def test_load_rejects_duplicates_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text('[[models]]\nid = "a"\ninput_price = 1\noutput_price = 1\n'
                    '[[models]]\nid = "a"\ninput_price = 2\noutput_price = 2\n')
    with pytest.raises(ValidationError):
        Catalog.load(path)
