"""Legacy completions and embeddings requests: what passes to the node, and each 400 with its param."""

from __future__ import annotations

from typing import Any

import pytest

from darkbloom.wire.openai.errors import ApiError
from darkbloom.wire.openai.legacy import (MAX_EMBEDDING_INPUTS, MAX_PROMPTS, completion_prompts, completions_request,
                                         embeddings_request)

MODEL = "smollm2-135m"


def refused(translate: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        translate(body)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    return caught.value


@pytest.mark.parametrize("prompt, sent", [
    ("Once upon", "Once upon"), (["Once upon"], "Once upon"), ([1, 2, 3], [1, 2, 3]), ([[1, 2]], [1, 2]), ("", ""),
    (["a", "b", "c"], ["a", "b", "c"]), ([[1], [2, 3]], [[1], [2, 3]]), (["a", [1]], ["a", [1]]),
])
def test_completions_prompt_forms(prompt: Any, sent: Any) -> None:
    assert completion_prompts({"prompt": sent}) == (sent if isinstance(sent, list) and sent and
                                                    isinstance(sent[0], (str, list)) else [sent])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "echo": True, "suffix": "end", "logprobs": 2, "seed": 1}
    node = completions_request(body)
    assert node == {"model": MODEL, "prompt": sent, "max_tokens": 8, "echo": True, "suffix": "end", "logprobs": 2,
                    "seed": 1}


@pytest.mark.parametrize("change, param", [
    ({"model": ""}, "model"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": ["a", []]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": -1}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"echo": "yes"}, "echo"),
    ({"suffix": 1}, "suffix"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_completions_refusals_name_their_param(change: dict[str, Any], param: str) -> None:
    assert refused(completions_request, {"model": MODEL, "prompt": "Hi", **change}).param == param


def test_completions_n_and_best_of_one_are_fine() -> None:
    assert completions_request({"model": MODEL, "prompt": "Hi", "n": 1, "best_of": 1})["prompt"] == "Hi"


@pytest.mark.parametrize("given", ["hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_embeddings_inputs(given: Any) -> None:
    body = {"model": MODEL, "input": given, "encoding_format": "base64", "user": "u"}
    assert embeddings_request(body) == {"model": MODEL, "input": given}
    assert embeddings_request({"model": MODEL, "input": given, "encoding_format": "float"})["input"] == given


@pytest.mark.parametrize("change, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": None}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"dimensions": 64}, "dimensions"),
    ({"stream": True}, "stream"),
    ({"model": None}, "model"),
])
def test_embeddings_refusals_name_their_param(change: dict[str, Any], param: str) -> None:
    assert refused(embeddings_request, {"model": MODEL, "input": "hello", **change}).param == param


def test_embeddings_dimensions_null_is_absent() -> None:
    assert embeddings_request({"model": MODEL, "input": "x", "dimensions": None}) == {"model": MODEL, "input": "x"}


def test_a_list_of_prompts_is_at_most_max_prompts() -> None:
    assert len(completion_prompts(completions_request({"model": MODEL, "prompt": ["x"] * MAX_PROMPTS}))) == MAX_PROMPTS
    error = refused(completions_request, {"model": MODEL, "prompt": ["x"] * (MAX_PROMPTS + 1)})
    assert (error.code, error.param) == ("too_many_prompts", "prompt") and str(MAX_PROMPTS) in error.message
