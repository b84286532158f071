"""`darkbloom models convert ID --to mlx`: a GGUF model of the store (or the bundled one) made into an
MLX model directory — `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` —
offline, from what the GGUF file holds (docs/models.md "Converting a GGUF model to MLX").

Only the Llama architecture (SmolLM, Llama 3 and other dense models stored as `llama`) with a GPT-2
style byte-level BPE vocabulary, split before BPE as one of llama.cpp's pre-tokenizers `_SPLITS`
names, is converted. Each tensor is dequantized (`gguf.quants`, llama.cpp's own reference code) to
float32 and stored in `dtype`, one at a time. llama.cpp's converter permuted the rows of every Q and K
projection (it pairs rotary dimensions as (0, 1), (2, 3)…, Hugging Face's layout as (0, d/2), …);
`_unpermute` puts them back, so the model computes what the original checkpoint did.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)
DTYPES = ("float32", "float16", "bfloat16")
_ITEM_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# GGUF tensor names → Hugging Face Llama names (`blk.N.` → `model.layers.N.`)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# llama.cpp's pre-tokenizers (llama-vocab.cpp) that `_pre_tokenizer` reproduces: GPT-2's split; each
# digit alone, then GPT-2's; Llama 3's
_SPLITS = {"gpt-2": "gpt2", "smollm": "digits", "starcoder": "digits", "refact": "digits",
           "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens (LLAMA_TOKEN_TYPE_CONTROL)
_USER_DEFINED_TOKEN = 4


class ConversionError(Exception):
    """A GGUF file this converter cannot turn into an MLX model; the message says why."""


@dataclass(frozen=True)
class _Tensor:
    name: str  # the Hugging Face name
    shape: tuple[int, ...]
    values: Callable[[], np.ndarray]  # float32, dequantized and laid out as Hugging Face's, when called


class GgufModel:
    """A GGUF file this converter accepts, read (its metadata parsed, its tensors mapped, not yet
    dequantized): what it is, and what converting it writes. Raises ConversionError."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise ConversionError(f"{path} cannot be read as GGUF ({type(exc).__name__})") from None
        self.path = path
        self.metadata = _metadata(reader)
        architecture = self.metadata.get("general.architecture")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConversionError(f"{path.name} is a {architecture!r} model; only {', '.join(SUPPORTED_ARCHITECTURES)} "
                                  "models convert to MLX (pull an MLX repo of it instead: darkbloom models pull "
                                  "owner/name)")
        if self.metadata.get("tokenizer.ggml.model") != "gpt2":
            raise ConversionError(f"{path.name} has a {self.metadata.get('tokenizer.ggml.model')!r} vocabulary; only "
                                  "byte-level BPE ('gpt2') vocabularies convert to MLX")
        _split_kind(self.metadata)
        self.config = _config(self.metadata, has_output=any(t.name == "output.weight" for t in reader.tensors))
        self._tensors = list(_tensors(reader, self.config))

    @property
    def parameters(self) -> int:
        return sum(math.prod(tensor.shape) for tensor in self._tensors)

    def weights_bytes(self, dtype: str) -> int:
        """The size of the `model.safetensors` a conversion to `dtype` writes, less its header."""
        return self.parameters * _ITEM_SIZE[_check_dtype(dtype)]

    def write_mlx(self, out_dir: Path, *, dtype: str) -> None:
        """Write the MLX model directory into `out_dir` (created; must not hold a model), one tensor in
        memory at a time."""
        _check_dtype(dtype)
        out_dir.mkdir(parents=True, exist_ok=True)
        _save_safetensors(self._tensors, out_dir / "model.safetensors", dtype)
        (out_dir / "config.json").write_text(json.dumps({**self.config, "torch_dtype": dtype}, indent=2) + "\n")
        tokenizer, tokenizer_config = _tokenizer(self.metadata)
        tokenizer.save(str(out_dir / "tokenizer.json"))
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def convert_gguf_to_mlx(gguf_path: Path, out_dir: Path, *, dtype: str = "bfloat16") -> None:
    """Write the MLX model directory of `gguf_path` into `out_dir` (created; must not hold a model)."""
    GgufModel(gguf_path).write_mlx(out_dir, dtype=dtype)


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dtype


def _metadata(reader: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        values[key] = field.contents()
    return values


def _config(metadata: dict[str, Any], *, has_output: bool) -> dict[str, Any]:
    arch = metadata["general.architecture"]

    def number(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ConversionError(f"the GGUF file has no {arch}.{key}")
        return value

    hidden = int(number("embedding_length"))
    heads = int(number("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(number("feed_forward_length")),
        "num_hidden_layers": int(number("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(number("attention.head_count_kv", heads)),
        "head_dim": int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(number("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if name in metadata:
            config[key] = int(metadata[name])
    return config


def _tensors(reader: Any, config: dict[str, Any]) -> Iterator[_Tensor]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        permuted_heads = heads if name.endswith("self_attn.q_proj.weight") else \
            kv_heads if name.endswith("self_attn.k_proj.weight") else None
        yield _Tensor(name, shape, functools.partial(_dequantized, tensor, shape, permuted_heads))


def _dequantized(tensor: Any, shape: tuple[int, ...], permuted_heads: int | None) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
    except NotImplementedError:
        raise ConversionError(f"the GGUF file's tensor {tensor.name} is {tensor.tensor_type.name}, which this "
                              "converter cannot dequantize") from None
    return values if permuted_heads is None else _unpermute(values, permuted_heads)


def _hf_name(gguf_name: str) -> str:
    layer = _LAYER_NAME.match(gguf_name)
    if layer is not None:
        number, part, kind = layer.groups()
        if part not in _LAYER_TENSORS:
            raise ConversionError(f"the GGUF file holds a tensor this converter does not know: {gguf_name}")
        return f"model.layers.{number}.{_LAYER_TENSORS[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base not in _MODEL_TENSORS:
        raise ConversionError(f"the GGUF file holds a tensor this converter does not know: {gguf_name}")
    return f"{_MODEL_TENSORS[base]}.{kind}"


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a Q or K projection (rows of each head interleaved pairwise)."""
    rows = weights.shape[0]
    return (weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _save_safetensors(tensors: list[_Tensor], path: Path, dtype: str) -> None:
    """safetensors' layout written by hand — the JSON header, then each tensor's bytes in turn — so that
    one tensor at a time is in memory, and for BF16, which numpy (and so `safetensors.numpy`) lacks."""
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for tensor in tensors:
        size = math.prod(tensor.shape) * _ITEM_SIZE[dtype]
        header[tensor.name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as fh:
        fh.write(len(encoded).to_bytes(8, "little"))
        fh.write(encoded)
        for tensor in tensors:
            fh.write(np.ascontiguousarray(_cast(tensor.values(), dtype)).tobytes())


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype != "bfloat16":
        return values.astype(dtype, copy=False)
    # numpy has no bfloat16: the upper half of each float32, rounded to nearest even
    bits = values.astype(np.float32, copy=False).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _split_kind(metadata: dict[str, Any]) -> str:
    """How llama.cpp splits text before BPE for this vocabulary (`tokenizer.ggml.pre`), as one of the
    splittings `_pre_tokenizer` reproduces; raises ConversionError for any other."""
    pre = metadata.get("tokenizer.ggml.pre")
    kind = _SPLITS.get(pre) if isinstance(pre, str) else None
    if kind is None:
        raise ConversionError(f"the GGUF's vocabulary splits text as llama.cpp's {pre!r} pre-tokenizer, which this "
                              f"converter does not reproduce (it does {', '.join(sorted(_SPLITS))})")
    return kind


def _pre_tokenizer(metadata: dict[str, Any]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    kind = _split_kind(metadata)
    if kind == "llama3":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _tokenizer(metadata: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The byte-level BPE tokenizer the GGUF's vocabulary and merges describe (`tokenizers`), and the
    `tokenizer_config.json` naming its special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata)
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(token, special=True, normalized=False)
               for token, kind in zip(tokens, types) if kind == _CONTROL_TOKEN]
    added = [AddedToken(token, special=False, normalized=False)
             for token, kind in zip(tokens, types) if kind == _USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(metadata.get(f"{metadata['general.architecture']}.context_length", 2048)),
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in metadata:
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, tokenizer_config
