"""parse_*_frame's one-pass path (pydantic-core parses and validates the JSON at once) answers
exactly as the two-step path (json.loads, then validate_python) it falls back to: the same frame
for what both accept, the same FrameError code and message for the rest."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from darkbloom.wire import protocol
from darkbloom.wire.protocol import FrameError, parse_coordinator_frame, parse_provider_frame

REG = '{"type":"register","models":[{"id":"m"}],"public_key":"pk"'
EDGES: list[str | bytes] = [
    '{"type":"inference_response_chunk","request_id":"r","encrypted_data":{"ephemeral_public_key":"a",'
    '"ciphertext":"b"},"extra":1}',
    '{"type":"inference_response_chunk","request_id":"r","encrypted_data":{"ciphertext":"b"}}',
    '{"type":"inference_response_chunk","request_id":7,"encrypted_data":{"ephemeral_public_key":"a","ciphertext":"b"}}',
    '{"type":"heartbeat","status":"a\tb"}', '{"type":"heartbeat","status":"a\x01b"}',  # raw control characters
    '\ufeff{"type":"heartbeat"}', b'\xef\xbb\xbf{"type":"heartbeat"}',  # a BOM: refused as text, taken as bytes
    '{"type":"heartbeat","status":"\\ud800"}',  # a lone surrogate
    '{"type":"heartbeat","status":"\\u0000 \u2028 caf\u00e9"}', b'{"type":"heartbeat","status":"\xff"}',
    '{"type":"heartbeat","status":"caf\u00e9"}'.encode("utf-16"),
    '{"type":"heartbeat","status":"x","status":"y"}', '{"type":"heartbeat","type":"bogus"}',
    '{"type":"bogus","type":"heartbeat"}', ' \n{"type":"heartbeat"}\n ', '{"type":"heartbeat"} x',
    '{"type":"heartbeat",}', '{"type":"heartbeat"}\x00', '"\\u0022"', "[]", "{}", '{"type":null}',
    '{"type":"heartbeat","active_requests":1e400}', '{"type":"heartbeat","active_requests":3.0}',
    '{"type":"heartbeat","active_requests":"3"}', '{"type":"heartbeat","active_requests":-0}',
    '{"type":"heartbeat","active_requests":123456789012345678901234567890}', '{"type":"heartbeat","models":"abc"}',
    REG + ',"decode_tps":NaN}', REG + ',"decode_tps":Infinity}', REG + ',"max_concurrency":10000000000000000000000}',
    REG + ',"private_only":"yes"}', REG + ',"private_only":1}', REG + ',"hardware":null}',
    '{"type":"inference_complete","request_id":"r","usage":{"prompt_tokens":true,"completion_tokens":0}}',
    '{"type":"inference_error","request_id":"r","status_code":503.5}',
    '{"type":"inference_error","request_id":"r","status_code":503.0}',
    '{"type":"cancel","request_id":"r"}', '{"type":"attestation_challenge","nonce":"n","timestamp":"12"}',
    '{"type":"registered","provider_id":"p","account_id":null}', '{"type":"trust_status"}',
]


def _two_step(raw: str | bytes, coordinator: bool) -> object:
    """The path every frame took before the one-pass path existed."""
    data = (protocol._decode(raw, None, protocol.MAX_REQUEST_FRAME_BYTES) if coordinator
            else protocol._decode(raw, protocol.PROVIDER_TYPES))
    adapter = protocol._coordinator_adapter if coordinator else protocol._provider_adapter
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        code = "unknown_type" if coordinator and "union_tag_invalid" in str(exc) else "malformed_frame"
        raise FrameError(code, protocol._short(exc)) from None


def _outcome(parse, raw):  # type: ignore[no-untyped-def]
    try:
        frame = parse(raw)
    except FrameError as exc:
        return ("refused", exc.code, exc.message)
    return ("frame", type(frame), _nan_safe(frame.model_dump()), frame.model_fields_set)


def _nan_safe(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: _nan_safe(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("coordinator", [False, True], ids=["provider", "coordinator"])
@pytest.mark.parametrize("raw", EDGES)
def test_one_pass_answers_as_the_two_step_path(raw: str | bytes, coordinator: bool) -> None:
    parse = parse_coordinator_frame if coordinator else parse_provider_frame
    assert _outcome(parse, raw) == _outcome(lambda r: _two_step(r, coordinator), raw)


HEARTBEAT = '{"type":"heartbeat","status":"idle","active_requests":0,"models":["m"]}'


def test_a_heartbeat_text_is_parsed_once_and_its_frozen_frame_answers_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str | bytes] = []
    real = protocol._parse_provider_frame
    monkeypatch.setattr(protocol, "_parse_provider_frame", lambda raw: parsed.append(raw) or real(raw))
    protocol._heartbeats.clear()
    first = parse_provider_frame(HEARTBEAT)
    assert parse_provider_frame(HEARTBEAT) is first and parsed == [HEARTBEAT]
    assert _outcome(lambda raw: first, HEARTBEAT) == _outcome(lambda r: _two_step(r, False), HEARTBEAT)
    with pytest.raises(ValidationError):
        first.status = "busy"  # shared: nobody may change it
    for other in (EDGES[0], HEARTBEAT.encode()):  # another frame, or bytes: parsed every time
        parse_provider_frame(other)
        parse_provider_frame(other)
    assert len(parsed) == 5


def test_many_different_heartbeat_texts_stay_within_the_bound() -> None:
    for n in range(3 * protocol._HEARTBEATS_REMEMBERED):
        parse_provider_frame(f'{{"type":"heartbeat","active_requests":{n}}}')
        assert len(protocol._heartbeats) <= protocol._HEARTBEATS_REMEMBERED
    long = '{"type":"heartbeat","status":"' + "x" * protocol._HEARTBEAT_TEXT_LIMIT + '"}'
    parse_provider_frame(long)
    assert long not in protocol._heartbeats
