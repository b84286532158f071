"""`darkbloom models convert ID --to mlx`: the bundled GGUF (or one of the store) made into an MLX model
directory of the store, run as a process; what it refuses, leaving nothing behind; and the converted
model computing what llama.cpp computes on the GGUF — the same token ids, the same greedy answer."""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import numpy as np
import pytest
from filelock import FileLock

from darkbloom.provider import mlx_convert
from darkbloom.provider.convert import ConvertError, convert_into_store
from darkbloom.provider.mlx_model import files_bytes, manifest_hash
from darkbloom.provider.model_store import MLX_DIR_NAME, Manifest, ModelStore
from darkbloom.provider.models import HASH_CACHE_NAME
from tests.provider.models.conftest import Node, failed, pulled
from tests.support.mlx_model import converted_smollm2
from tests.support.processes import wait_until

MLX_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
STORED_GGUF = "smol-q4"  # the bundled GGUF as a pulled model of the store


@pytest.fixture
def node(tmp_path: Path) -> Node:
    """A DARKBLOOM_HOME (no Hub: nothing is downloaded) and no coordinator for `models list` to ask."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("DARKBLOOM_COORDINATOR", "DARKBLOOM_API_KEY")}
    return Node(home, {**env, "DARKBLOOM_HOME": str(home), "PYTHONUNBUFFERED": "1"})


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()


def store_gguf(node: Node, model_id: str, gguf: Path) -> str:
    """A copy of `gguf` installed in the store as a pulled model `model_id`; its sha256."""
    copy = node.home / gguf.name
    shutil.copyfile(gguf, copy)
    digest = sha256(copy)
    ModelStore(node.home).install(copy, Manifest(id=model_id, file=gguf.name, size_bytes=copy.stat().st_size,
                                                 weight_hash=digest))
    return digest


def store_fake_mlx(node: Node, model_id: str) -> Path:
    """An MLX model directory (a config and one small tensor) installed in the store as `model_id`."""
    from safetensors.numpy import save_file

    directory = node.home / "fake-mlx"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": np.ones((2, 2), np.float32)}, str(directory / "model.safetensors"))
    manifest = Manifest(id=model_id, format="mlx", file=MLX_DIR_NAME, size_bytes=files_bytes(directory),
                        weight_hash=manifest_hash(directory))
    return ModelStore(node.home).install(directory, manifest).path


def tiny_gguf(path: Path, architecture: str, vocabulary: str, split: str = "smollm") -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch=architecture)
    writer.add_tokenizer_model(vocabulary)
    writer.add_tokenizer_pre(split)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def partial_leftovers(node: Node) -> list[str]:
    """What `.partial/` holds besides the lock every pull and conversion takes."""
    partial = node.store / ".partial"
    return sorted(p.name for p in partial.iterdir() if p.name != "pull.lock") if partial.exists() else []


def safetensors_dtypes(path: Path) -> set[str]:
    header_size = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_size])
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


# The command, as a process


@pytest.mark.e2e
def test_the_bundled_model_converts_into_the_store_and_is_listed(node: Node, gguf: Path) -> None:
    result = node.run("models", "convert", "smollm2-135m", "--to", "mlx")
    model_id, path = pulled(result)
    assert (model_id, path) == ("smollm2-135m-mlx", node.store / "smollm2-135m-mlx" / "mlx")
    assert "converting smollm2-135m (Q4_1, 98.4 MB) to MLX bfloat16" in result.stderr
    assert sorted(p.name for p in path.iterdir()) == MLX_FILES
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["format"] == "mlx" and manifest["file"] == "mlx" and manifest["source"] is None
    assert manifest["weight_hash"] == manifest_hash(path) and manifest["size_bytes"] == files_bytes(path)
    assert manifest["converted_from"] == f"smollm2-135m {sha256(gguf)}"
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert safetensors_dtypes(path / "model.safetensors") == {"BF16"}
    # the conversion the other tests load (tests/support/mlx_model.py) is this one, file for file
    assert manifest_hash(path) == manifest_hash(converted_smollm2("bfloat16"))
    # the hash is recorded, so serving the directory does not read it again
    assert manifest["weight_hash"] in json.loads((node.home / HASH_CACHE_NAME).read_text()).values()
    assert node.entries() == ["smollm2-135m-mlx"] and partial_leftovers(node) == []

    listed = node.run("models", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    entry = next(m for m in json.loads(listed.stdout) if m["id"] == "smollm2-135m-mlx")
    assert entry == {"id": "smollm2-135m-mlx", "source": "store", "file": str(path),
                     "size_bytes": manifest["size_bytes"], "weight_hash": manifest["weight_hash"],
                     "configured": False, "in_catalog": None}

    again = node.run("models", "convert", "smollm2-135m", "--to", "mlx")
    assert pulled(again) == (model_id, path)
    assert "smollm2-135m-mlx is in the model store already (mlx): the conversion replaces it" in again.stderr
    assert json.loads((path.parent / "manifest.json").read_text())["weight_hash"] == manifest["weight_hash"]
    assert node.entries() == ["smollm2-135m-mlx"] and partial_leftovers(node) == []


@pytest.mark.e2e
def test_a_pulled_gguf_converts_under_another_id_and_dtype(node: Node, gguf: Path) -> None:
    digest = store_gguf(node, STORED_GGUF, gguf)
    model_id, path = pulled(node.run("models", "convert", STORED_GGUF, "--to", "mlx", "--as", "smol-f16",
                                     "--dtype", "float16"))
    assert (model_id, path) == ("smol-f16", node.store / "smol-f16" / "mlx")
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["converted_from"] == f"{STORED_GGUF} {digest}"
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float16"
    assert safetensors_dtypes(path / "model.safetensors") == {"F16"}
    assert node.entries() == ["smol-f16", STORED_GGUF]  # the GGUF stays

    line = failed(node.run("models", "convert", "smol-f16", "--to", "mlx"))
    assert "'smol-f16' is already an MLX model" in line


def _hold_the_lock(node: Node) -> Iterator[None]:
    (node.store / ".partial").mkdir(parents=True)
    with FileLock(str(node.store / ".partial" / "pull.lock")):
        yield


def _plant_symlink(node: Node) -> Iterator[None]:
    outside = node.home.parent / "outside"
    outside.mkdir()
    (outside / "precious").write_text("kept")
    (node.store / ".partial").mkdir(parents=True)
    (node.store / ".partial" / "smollm2-135m-mlx").symlink_to(outside)
    yield
    assert (node.store / ".partial" / "smollm2-135m-mlx").is_symlink()
    assert [p.name for p in outside.iterdir()] == ["precious"]


def _without_gguf(node: Node) -> Iterator[None]:
    """`gguf` cannot be imported (a package that raises as a missing one does, first on the path)."""
    shadow = node.home.parent / "shadow" / "gguf"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'gguf'\", name='gguf')\n")
    node.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow.parent), node.env.get("PYTHONPATH")]))
    yield


Setup = Callable[[Node], Iterator[None]]


def _store(*models: tuple[str, str]) -> Setup:
    """The store holding `models`: (id, "gguf") the bundled GGUF, (id, "mlx") a small MLX directory,
    (id, "gpt2"), (id, "spm") or (id, "qwen2-split") a tiny GGUF of another architecture, vocabulary
    or pre-tokenizer."""
    def setup(node: Node) -> Iterator[None]:
        from darkbloom.provider.bundled_model import bundled_gguf_path

        for model_id, kind in models:
            if kind == "gguf":
                store_gguf(node, model_id, bundled_gguf_path())
            elif kind == "mlx":
                store_fake_mlx(node, model_id)
            else:
                tiny = tiny_gguf(node.home.parent / f"{model_id}.gguf", *{
                    "gpt2": ("gpt2", "gpt2"), "spm": ("llama", "llama"), "qwen2-split": ("llama", "gpt2", "qwen2"),
                }[kind])
                store_gguf(node, model_id, tiny)
        yield
    return setup


def _nothing(node: Node) -> Iterator[None]:
    yield


@pytest.mark.parametrize(("args", "setup", "code", "cause"), [
    (["nope"], _nothing, 1, "model 'nope' is not in the model store"),
    (["../x"], _nothing, 1, "model '../x' is not in the model store"),
    (["smollm2-135m", "--to", "gguf"], _nothing, 2, "--to must be mlx (the only format a GGUF model converts to); "
                                                    "got 'gguf'"),
    (["smollm2-135m", "--dtype", "int8"], _nothing, 2, "--dtype must be one of float32, float16, bfloat16"),
    (["mine"], _store(("mine", "mlx")), 1, "'mine' is already an MLX model"),
    (["old"], _store(("old", "gpt2")), 1, "old.gguf is a 'gpt2' model; only llama models convert to MLX"),
    (["spm"], _store(("spm", "spm")), 1, "spm.gguf has a 'llama' vocabulary; only byte-level BPE"),
    (["qs"], _store(("qs", "qwen2-split")), 1, "the GGUF's vocabulary splits text as llama.cpp's 'qwen2' "
                                               "pre-tokenizer, which this converter does not reproduce"),
    ([STORED_GGUF, "--as", "smollm2-135m"], _store((STORED_GGUF, "gguf")), 1,
     "'smollm2-135m' is the bundled model's id; choose another with --as"),
    (["smollm2-135m", "--as", "a/b"], _nothing, 1, "model id 'a/b' must not contain '/'"),
    (["smollm2-135m", "--as", ".hidden"], _nothing, 1, "model id '.hidden'"),
    (["smollm2-135m", "--as", "smollm2-135m"], _nothing, 1, "--as 'smollm2-135m' is the model being converted"),
    (["smollm2-135m"], _hold_the_lock, 1, "another pull or conversion is running in"),
    (["smollm2-135m"], _plant_symlink, 1, "smollm2-135m-mlx is a symlink, and the model store follows none"),
    (["smollm2-135m"], _without_gguf, 1, "converting to MLX needs the mlx extra: pip install 'darkbloom[mlx]' "
                                         "(gguf cannot be imported)"),
], ids=["unknown", "path-id", "to-gguf", "dtype", "already-mlx", "other-architecture", "other-vocabulary",
        "other-pre-tokenizer", "as-bundled", "as-invalid", "as-hidden", "as-itself", "locked", "symlink",
        "no-mlx-extra"])
def test_what_cannot_be_converted_is_refused_in_one_line_leaving_nothing(node: Node, args: list[str], setup: Setup,
                                                                         code: int, cause: str) -> None:
    if "--to" not in args:
        args = [*args[:1], "--to", "mlx", *args[1:]]
    steps = setup(node)
    next(steps)
    before = node.entries(), partial_leftovers(node)
    line = failed(node.run("models", "convert", *args), code)
    assert cause in line
    assert (node.entries(), partial_leftovers(node)) == before
    next(steps, None)  # the set-up's own checks


@pytest.mark.e2e
def test_an_interrupted_conversion_leaves_nothing_and_keeps_what_it_would_replace(node: Node) -> None:
    old = store_fake_mlx(node, "smollm2-135m-mlx")
    old_hash = manifest_hash(old)
    weights = node.store / ".partial" / "smollm2-135m-mlx" / "mlx" / "model.safetensors"
    process = node.popen("models", "convert", "smollm2-135m", "--to", "mlx", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        wait_until(lambda: process.poll() is not None or (weights.exists() and weights.stat().st_size > 1 << 20),
                   timeout=120, what="the conversion writing its weights")
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.decode().strip().splitlines()[-1] == \
        "error: conversion of smollm2-135m interrupted; nothing was kept" and stdout == b""
    assert node.entries() == ["smollm2-135m-mlx"] and manifest_hash(old) == old_hash
    assert partial_leftovers(node) == []


def test_a_store_without_room_is_refused_before_anything_is_written(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = ModelStore(tmp_path)

    def full(path: Any) -> shutil._ntuple_diskusage:
        return shutil._ntuple_diskusage(100 << 30, 100 << 30, 1 << 20)

    monkeypatch.setattr("darkbloom.provider.convert.shutil.disk_usage", full)
    with pytest.raises(ConvertError, match=r"not enough disk space for smollm2-135m-mlx: it needs 336\.1 MB more in "
                                           r".*, which has 1\.0 MB free"):
        convert_into_store("smollm2-135m", store, progress=io.StringIO())
    assert store.models() == [] and sorted(p.name for p in (store.root / ".partial").iterdir()) == ["pull.lock"]


def test_a_disk_that_fills_up_keeps_the_model_it_would_have_replaced(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node(tmp_path, {})
    old = store_fake_mlx(node, "smollm2-135m-mlx")
    old_hash = manifest_hash(old)

    def fill_up(self: mlx_convert.GgufModel, out_dir: Path, *, dtype: str) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mlx_convert.GgufModel, "write_mlx", fill_up)
    progress = io.StringIO()
    with pytest.raises(ConvertError, match="not enough disk space for smollm2-135m-mlx in .*: the disk filled up "
                                           "while converting; nothing was kept"):
        convert_into_store("smollm2-135m", ModelStore(tmp_path), progress=progress)
    assert "the conversion replaces it" in progress.getvalue()
    assert manifest_hash(old) == old_hash and partial_leftovers(node) == []


# The converter's parts


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, which wrote every Q and K projection of a GGUF."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize(("heads", "head_dim", "columns"), [(9, 64, 576), (3, 64, 576), (4, 8, 1), (1, 2, 3)])
def test_unpermute_inverts_llama_cpps_permute(heads: int, head_dim: int, columns: int) -> None:
    original = np.random.default_rng(heads).standard_normal((heads * head_dim, columns)).astype(np.float32)
    permuted = llama_cpp_permute(original, heads)
    if head_dim > 2:
        assert not np.array_equal(permuted, original)
    assert np.array_equal(mlx_convert._unpermute(permuted, heads), original)
    bias = original[:, 0]  # a Q or K bias is permuted the same way
    assert np.array_equal(mlx_convert._unpermute(llama_cpp_permute(bias, heads), heads), bias)


EDGES = np.array([0.0, -0.0, 1.0, -2.5, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.0e38, -1.0e-40, 1.0e-30, 65504.0,
                  np.pi], np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_safetensors_writer_round_trips_each_dtype(tmp_path: Path, dtype: str) -> None:
    import mlx.core as mx
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((7, 5)).astype(np.float32) * 3,
               "model.norm.weight": rng.standard_normal(3).astype(np.float32),
               "edges": EDGES if dtype != "float16" else EDGES[np.abs(EDGES) <= 65504]}
    path = tmp_path / "model.safetensors"
    mlx_convert._save_safetensors([mlx_convert._Tensor(name, values.shape, functools.partial(np.asarray, values))
                                   for name, values in tensors.items()], path, dtype)

    with safe_open(str(path), framework="numpy") as opened:
        assert sorted(opened.keys()) == sorted(tensors) and opened.metadata() == {"format": "mlx"}
    loaded = cast(dict[str, mx.array], mx.load(str(path)))
    for name, values in tensors.items():
        assert loaded[name].dtype == getattr(mx, dtype) and loaded[name].shape == values.shape
        # bit for bit what MLX itself makes of the float32 values (round to nearest, ties to even)
        expected = mx.array(values).astype(getattr(mx, dtype))
        assert mx.array_equal(loaded[name], expected, equal_nan=True).item(), name
        tolerance = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 0}[dtype]
        normal = np.abs(values) > 1e-4
        back = np.array(loaded[name].astype(mx.float32))
        assert np.all(np.abs(back[normal] - values[normal]) <= tolerance * np.abs(values[normal]))


def vocabulary_gguf(path: Path, reader: Any, split: str) -> Path:
    """The metadata alone of a GGUF (no tensors: llama.cpp loads it vocab_only), with another
    `tokenizer.ggml.pre`."""
    from gguf import GGUFValueType, GGUFWriter

    writer = GGUFWriter(str(path), arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = split if key == "tokenizer.ggml.pre" else field.contents()
        writer.add_key_value(key, value, field.types[0],
                             sub_type=field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp splits these otherwise with Llama 3's pre-tokenizer than with GPT-2's
SPLIT_BY_PRE_TOKENIZER = ["tabs\tand\r\nnewlines\n\n\n", "a \n\n  b"]


@pytest.mark.parametrize("split", ["gpt-2", "llama-bpe"])  # and `smollm`: the bundled model's own, tested below
def test_the_tokenizer_splits_text_as_llama_cpps_pre_tokenizer(tmp_path: Path, gguf: Path, split: str) -> None:
    import llama_cpp
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    llama = llama_cpp.Llama(model_path=str(vocabulary_gguf(tmp_path / f"{split}.gguf", reader, split)),
                            vocab_only=True, verbose=False)
    tokenizer, _ = mlx_convert._tokenizer({**mlx_convert._metadata(reader), "tokenizer.ggml.pre": split})
    for text in [*TRICKY, *SPLIT_BY_PRE_TOKENIZER]:
        assert tokenizer.encode(text, add_special_tokens=False).ids == \
            llama.tokenize(text.encode(), add_bos=False, special=True), text
    # the test has teeth: the split of the other pre-tokenizer gives other tokens
    other, _ = mlx_convert._tokenizer({**mlx_convert._metadata(reader),
                                       "tokenizer.ggml.pre": {"gpt-2": "llama-bpe", "llama-bpe": "gpt-2"}[split]})
    assert any(other.encode(text, add_special_tokens=False).ids !=
               llama.tokenize(text.encode(), add_bos=False, special=True) for text in SPLIT_BY_PRE_TOKENIZER)


# The converted model against llama.cpp on the same GGUF

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers greater than 100."}],
]
# A near tie: llama.cpp's first token is "L" by 0.09 logits over "The" (its Q4_1 × Q8 dot products),
# the bfloat16 model's "The" by 0.25: its next-token logits agree, its greedy answer may not.
NEAR_TIE = [{"role": "user", "content": "What is the capital of France?"}]
TRICKY = ["Hello world", " leading space", "  two  spaces  ", "1234567890 3.14159 -42", "naïve café — 日本語 🤖",
          "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>after", "tabs\tand\r\nnewlines\n\n\n", "don't I'LL we've",
          "x=>y; f(a,b)!=c", "   ", "Ünïcödé\u00a0nbsp", "<|im_start|> <|im_end|><|im_end|>"]
GENERATED = 16  # greedy tokens asked of each
MATCHED = 8  # the prefix that must be equal: float rounding may part the two later


@pytest.fixture(scope="module")
def mlx_smollm2() -> tuple[Any, Any]:
    from mlx_lm import load

    model, tokenizer, *_ = load(str(converted_smollm2("bfloat16")))
    return model, tokenizer


@pytest.fixture(scope="module")
def llama(gguf: Path) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=2, logits_all=True, verbose=False)


def render(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    """The chat in the model's own template (from the GGUF), as token ids."""
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    return list(tokenizer.encode(text, add_special_tokens=False))


def mlx_greedy(model: Any, prompt: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=GENERATED)  # no sampler: argmax
    return [int(token) for token, _ in steps]


def llama_greedy(llama: Any, prompt: list[int]) -> list[int]:
    tokens = []
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == GENERATED:
            return tokens
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.e2e
def test_the_mlx_tokenizer_gives_llama_cpps_token_ids(mlx_smollm2: tuple[Any, Any], llama: Any) -> None:
    _, tokenizer = mlx_smollm2
    for text in TRICKY:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.e2e
@pytest.mark.parametrize("chat", CHATS, ids=["capital", "system", "primes"])
def test_greedy_output_matches_llama_cpp(mlx_smollm2: tuple[Any, Any], llama: Any, chat: list[dict[str, str]],
                                         record_property: Callable[[str, object], None]) -> None:
    model, tokenizer = mlx_smollm2
    prompt = render(tokenizer, chat)
    assert prompt == llama.tokenize(tokenizer.decode(prompt).encode(), add_bos=False, special=True)

    ours, theirs = mlx_greedy(model, prompt), llama_greedy(llama, prompt)
    record_property("matched_tokens", f"{common_prefix(ours, theirs)} of {GENERATED}")
    assert ours[:MATCHED] == theirs[:MATCHED], (tokenizer.decode(ours), tokenizer.decode(theirs))


@pytest.mark.e2e
@pytest.mark.parametrize("chat", [*CHATS, NEAR_TIE], ids=["capital", "system", "primes", "near-tie"])
def test_the_next_token_logits_agree_with_llama_cpp(mlx_smollm2: tuple[Any, Any], llama: Any,
                                                    chat: list[dict[str, str]]) -> None:
    import mlx.core as mx

    model, tokenizer = mlx_smollm2
    prompt = render(tokenizer, chat)
    ours = np.array(model(mx.array(prompt)[None])[0, -1].astype(mx.float32))
    llama.reset()
    llama.eval(prompt)
    theirs = np.array(llama.scores[llama.n_tokens - 1], np.float32)
    assert np.corrcoef(ours, theirs)[0, 1] > 0.99
    # each one's most likely token is among the other's three most likely
    assert np.argmax(ours) in np.argsort(-theirs)[:3] and np.argmax(theirs) in np.argsort(-ours)[:3]


@pytest.mark.e2e
def test_without_the_unpermutation_the_answer_is_another(llama: Any) -> None:
    """The test above has teeth: the Q and K rows left as llama.cpp laid them out, the model says
    something else from its first tokens on."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer, *_ = load(str(converted_smollm2("bfloat16")))
    for layer in model.model.layers:
        attention = layer.self_attn
        for projection, heads in ((attention.q_proj, attention.n_heads), (attention.k_proj, attention.n_kv_heads)):
            weight = np.array(projection.weight.astype(mx.float32))
            projection.weight = mx.array(llama_cpp_permute(weight, heads)).astype(projection.weight.dtype)
    prompt = render(tokenizer, CHATS[0])
    assert mlx_greedy(model, prompt)[:MATCHED] != llama_greedy(llama, prompt)[:MATCHED]
