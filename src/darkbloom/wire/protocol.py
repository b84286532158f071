"""Every WebSocket message between provider node and coordinator (docs/protocol.md "Frames").

Both sides import this module and nothing else of each other. Frames are JSON text
with a ``type`` discriminator; ``parse_provider_frame`` / ``parse_coordinator_frame``
turn raw text into one of the models below or raise ``FrameError``.

Every response chunk passes through here, so a frame is first parsed and validated in one pass
by pydantic-core (``validate_json``, ~2× cheaper than ``json.loads`` then ``validate_python``);
what that pass refuses goes through ``json.loads`` and ``validate_python``, which decide whether,
and why, it is refused. The first pass accepts nothing the second refuses (stdlib ``json`` is the
more lenient: UTF-16 bytes, a BOM, lone surrogates) and gives the same frame for what both accept.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from darkbloom.wire.catalog import MAX_MODEL_ID


MAX_FRAME_BYTES = 8 * 1024 * 1024  # provider → coordinator (docs/protocol.md "Robustness")
# the coordinator socket's ws_max_size, from the same number: a frame over MAX_FRAME_BYTES still arrives,
# to be refused alone (its request failed, the socket kept); only one over this closes the socket (1009)
SOCKET_MESSAGE_LIMIT = 2 * MAX_FRAME_BYTES


def sealed_frame_bytes(body_bytes: int) -> int:
    """The largest ``inference_request`` frame a body of ``body_bytes`` can become: base64 of nonce ‖
    box (24 + 16 bytes around the body) inside the frame's JSON."""
    return -(-(body_bytes + 40) // 3) * 4 + 1024


# coordinator → provider: what a node of this release accepts (it says so in `register`): an 8 MiB body sealed
MAX_REQUEST_FRAME_BYTES = sealed_frame_bytes(8 * 1024 * 1024)
PROVIDER_WS_PATH = "/ws/provider"

# the node APIs a sealed body may be for: `chat` (also what Responses and Messages become), `completions`, `embeddings`
Api = Literal["chat", "completions", "embeddings"]

# what a model may advertise in `ModelInfo.capabilities` beyond plain chat (`images` also from `is_vision`;
# `completion_batches`: a legacy completions body whose `prompt` is a list of several, one choice each)
CAPABILITIES = frozenset({"tools", "structured_output", "logprobs", "completions", "completion_batches", "embeddings",
                          "images"})

# `InferenceError.code` values the coordinator passes on to the client.
PROVIDER_ERROR_CODES = frozenset({"context_length_exceeded"})
PROTOCOL_VERSION = "1"

# What a node may report (docs/protocol.md "Bounds"): far above any real machine, low enough that no
# arithmetic on them overflows; a `register` outside them is refused, naming the field.
MAX_SIZE_BYTES = 2**50           # a model's weights: 1 PiB
MAX_CONTEXT_LENGTH = 2**24       # a model's context window, in tokens
MAX_CPU_COUNT = 2**16
MAX_MEMORY_GB = 2.0**30          # 1 EiB, in GB
MAX_DECODE_TPS = 1e6             # tokens per second
MAX_ACTIVE_REQUESTS = 2**20
MAX_CONCURRENCY = 1024
# `hardware.device` (cpu, metal, cuda, …) and `hardware.backend` (llama-cpp, openai): a short lower-case name
HARDWARE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,31}$"
# A model id a node advertises: what a spreadsheet, a shell or a path cannot take for something else
# (owner/name and name:tag as the Hub and Ollama spell them); the same rule on both sides.
MODEL_ID_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:/-]{{0,{MAX_MODEL_ID - 1}}}")
MODEL_ID_RULE = (f"a model id is 1 to {MAX_MODEL_ID} characters: letters, digits and . _ : / -, "
                 "starting with a letter or digit")


def model_id_problem(model_id: str) -> str | None:
    """Why a node may not advertise ``model_id`` (None when it may)."""
    return None if MODEL_ID_PATTERN.fullmatch(model_id) else MODEL_ID_RULE


def _advertisable(model_id: str) -> str:
    problem = model_id_problem(model_id)
    if problem is not None:
        raise ValueError(problem)
    return model_id


ModelId = Annotated[str, Field(max_length=MAX_MODEL_ID), AfterValidator(_advertisable)]


class _Frame(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Envelope(BaseModel):
    """NaCl box output: base64 ephemeral X25519 public key + base64(nonce ‖ box)."""

    ephemeral_public_key: str
    ciphertext: str


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    id: ModelId
    size_bytes: int = Field(default=0, ge=0, le=MAX_SIZE_BYTES)
    weight_hash: str = ""
    quantization: str = ""
    is_vision: bool = False
    context_length: int = Field(default=0, ge=0, le=MAX_CONTEXT_LENGTH)
    # what the model serves beyond plain chat (CAPABILITIES); unknown names are ignored
    capabilities: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=32)


HardwareName = Annotated[str, Field(pattern=HARDWARE_NAME_PATTERN)]


class Hardware(BaseModel):
    cpu_count: int = Field(default=0, ge=0, le=MAX_CPU_COUNT)
    memory_gb: float = Field(default=0.0, ge=0, le=MAX_MEMORY_GB, allow_inf_nan=False)
    gpu: str | None = None
    # where the node runs its models (cpu, metal, cuda, another ggml GPU backend); None: unknown (an
    # upstream, an older node)
    device: HardwareName | None = None
    backend: HardwareName | None = None  # llama-cpp or openai


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    # of the prompt tokens, those the node read from its cache instead of evaluating (0 from an older node)
    cached_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> Usage:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        return self


# provider → coordinator


class Register(_Frame):
    type: Literal["register"] = "register"
    auth_token: str | None = None
    models: list[ModelInfo]
    backend: str = ""
    version: str = ""
    runtime_hash: str = ""
    public_key: str
    identity_key: str = ""
    attestation: str = ""
    certificate: str | None = None
    encrypted_response_chunks: bool = True
    # every response chunk is a box from the node's registered X25519 key (docs/protocol.md): only
    # such a node's requests may cross replicas, and a chunk from any other key fails
    authenticated_chunks: bool = False
    private_only: bool = False
    max_concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    max_request_frame_bytes: int = Field(default=MAX_FRAME_BYTES, ge=1, le=2**40)  # the node's WebSocket max_size
    hardware: Hardware = Field(default_factory=Hardware)
    decode_tps: float = Field(default=0.0, ge=0, le=MAX_DECODE_TPS, allow_inf_nan=False)
    name: str = ""
    # the model ids in memory at registration; None (an older node): every advertised model is loaded
    loaded_models: list[str] | None = None


class Heartbeat(_Frame):
    model_config = ConfigDict(extra="ignore", frozen=True)  # one parsed frame may answer many alike texts

    type: Literal["heartbeat"] = "heartbeat"
    status: str = "idle"
    active_requests: int = Field(default=0, ge=0, le=MAX_ACTIVE_REQUESTS)
    models: list[str] = Field(default_factory=list)  # the model ids in memory now (docs/protocol.md)


class InferenceAccepted(_Frame):
    type: Literal["inference_accepted"] = "inference_accepted"
    request_id: str


class InferenceResponseChunk(_Frame):
    type: Literal["inference_response_chunk"] = "inference_response_chunk"
    request_id: str
    encrypted_data: Envelope


class InferenceComplete(_Frame):
    type: Literal["inference_complete"] = "inference_complete"
    request_id: str
    usage: Usage


class InferenceError(_Frame):
    type: Literal["inference_error"] = "inference_error"
    request_id: str
    status_code: int = 500
    message: str = "provider error"
    # for a request the backend refused: which parameter, and a machine-readable code from
    # PROVIDER_ERROR_CODES (the coordinator passes on only those, never the provider's message)
    param: Annotated[str, Field(max_length=128)] | None = None
    code: Annotated[str, Field(max_length=64)] | None = None


class AttestationResponse(_Frame):
    type: Literal["attestation_response"] = "attestation_response"
    nonce: str
    signature: str
    runtime_hash: str = ""


ProviderFrame = Annotated[
    Union[
        Register,
        Heartbeat,
        InferenceAccepted,
        InferenceResponseChunk,
        InferenceComplete,
        InferenceError,
        AttestationResponse,
    ],
    Field(discriminator="type"),
]

# coordinator → provider


class Registered(_Frame):
    type: Literal["registered"] = "registered"
    provider_id: str
    account_id: str | None = None
    machine_id: str | None = None
    trust_level: str = "none"
    # this coordinator opens a sealed array of chunks in one inference_response_chunk (docs/protocol.md);
    # a node merges chunks only when told so (an older coordinator would distrust it for an array)
    chunk_arrays: bool = False


Priority = Literal["live", "batch"]


class InferenceRequest(_Frame):
    type: Literal["inference_request"] = "inference_request"
    request_id: str
    encrypted_body: Envelope
    api: Api = "chat"  # what the sealed body asks for (its OpenAI endpoint); not secret
    priority: Priority = "live"  # "batch": a batch line, which the node's engine runs behind live requests


class Cancel(_Frame):
    type: Literal["cancel"] = "cancel"
    request_id: str


class AttestationChallenge(_Frame):
    type: Literal["attestation_challenge"] = "attestation_challenge"
    nonce: str
    timestamp: int


class TrustStatus(_Frame):
    type: Literal["trust_status"] = "trust_status"
    trust_level: str
    reason: str = ""
    certificate: str | None = None


class ErrorFrame(_Frame):
    type: Literal["error"] = "error"
    code: str
    message: str


CoordinatorFrame = Annotated[
    Union[Registered, InferenceRequest, Cancel, AttestationChallenge, TrustStatus, ErrorFrame],
    Field(discriminator="type"),
]

_provider_adapter: TypeAdapter[Any] = TypeAdapter(ProviderFrame)
_coordinator_adapter: TypeAdapter[Any] = TypeAdapter(CoordinatorFrame)

PROVIDER_TYPES = frozenset(("register", "heartbeat", "inference_accepted", "inference_response_chunk",
                            "inference_complete", "inference_error", "attestation_response"))


class FrameError(ValueError):
    """A frame that cannot be accepted; ``code`` goes into the error frame sent back. ``frame_type``:
    the type of a well-formed frame whose fields were refused (a ``register`` out of bounds)."""

    def __init__(self, code: str, message: str, frame_type: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.frame_type = frame_type


def _decode(raw: str | bytes, known_types: frozenset[str] | None, limit: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    if len(raw) > limit:
        raise FrameError("frame_too_large", f"frame exceeds {limit} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError("malformed_frame", f"frame is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise FrameError("malformed_frame", "frame must be a JSON object with a string 'type'")
    if known_types is not None and data["type"] not in known_types:
        raise FrameError("unknown_type", f"unknown frame type {data['type']!r}")
    return data


# A node's heartbeats are alike, and so are those of every node of a release serving the same models:
# each text is parsed once, and its frame (frozen) answers it again. Bounded in texts and in length.
_HEARTBEAT_TEXT_LIMIT = 1024
_HEARTBEATS_REMEMBERED = 1024
_heartbeats: dict[str, Heartbeat] = {}


def parse_provider_frame(raw: str | bytes) -> Any:
    if type(raw) is str and len(raw) <= _HEARTBEAT_TEXT_LIMIT:
        known = _heartbeats.get(raw)
        if known is not None:
            return known
    frame = _parse_provider_frame(raw)
    if type(frame) is Heartbeat and type(raw) is str and len(raw) <= _HEARTBEAT_TEXT_LIMIT:
        if len(_heartbeats) >= _HEARTBEATS_REMEMBERED:
            _heartbeats.clear()  # many different texts at once (a flood): start over, never grow
        _heartbeats[raw] = frame
    return frame


def _parse_provider_frame(raw: str | bytes) -> Any:
    if len(raw) <= MAX_FRAME_BYTES:
        try:
            return _provider_adapter.validate_json(raw)  # one pass: the well-formed frame, every chunk
        except ValidationError:
            pass  # the two-step path below says why, exactly as it always has
    data = _decode(raw, PROVIDER_TYPES)
    try:
        return _provider_adapter.validate_python(data)
    except ValidationError as exc:
        raise FrameError("malformed_frame", _short(exc), data["type"]) from None


def parse_coordinator_frame(raw: str | bytes) -> Any:
    """A frame from the coordinator: up to MAX_REQUEST_FRAME_BYTES (a sealed request near the body limit)."""
    if len(raw) <= MAX_REQUEST_FRAME_BYTES:
        try:
            return _coordinator_adapter.validate_json(raw)
        except ValidationError:
            pass
    data = _decode(raw, None, MAX_REQUEST_FRAME_BYTES)
    try:
        return _coordinator_adapter.validate_python(data)
    except ValidationError as exc:
        raise FrameError("unknown_type" if "union_tag_invalid" in str(exc) else "malformed_frame",
                         _short(exc)) from None


def dump(frame: BaseModel) -> str:
    return frame.model_dump_json(exclude_none=False)


def _short(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"invalid frame: {where}: {first.get('msg', 'invalid')}"
