"""The client reads an error answer in every shape vLLM gives one, and a refused API key
raises an error naming the settings that carry the key (no server: answers built here)."""

from __future__ import annotations

import httpx
import pytest

from asyncgrpo.adapters.vllm.client import (
    PromptTooLongError,
    ServerAuthError,
    VLLMClient,
    error_detail,
)
from asyncgrpo.adapters.vllm.replies import VLLMError

KEY_FIX = "vllm_server_api_key"


@pytest.mark.parametrize(
    ("response", "detail"),
    [
        (httpx.Response(401, json={"error": "Unauthorized"}), "Unauthorized"),
        (httpx.Response(400, json={"error": {"message": "bad n", "code": 400}}), "bad n"),
        (httpx.Response(404, json={"detail": "Not Found"}), "Not Found"),
        (httpx.Response(400, json={"error": {"code": 400}}), '{"error":{"code":400}}'),
        (httpx.Response(400, json=["not", "an", "object"]), '["not","an","object"]'),
        (httpx.Response(502, text="<html>Bad Gateway</html>"), "<html>Bad Gateway</html>"),
        (httpx.Response(500, text=""), ""),
    ],
)
def test_the_detail_of_every_answer_shape(response: httpx.Response, detail: str) -> None:
    assert error_detail(response) == detail


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize(
    "body",
    [{"json": {"error": "Unauthorized"}}, {"json": {"detail": "Forbidden"}}, {"text": "denied"}],
)
def test_a_refused_key_names_the_settings_and_the_fix(status: int, body: dict) -> None:
    with pytest.raises(ServerAuthError) as raised:
        VLLMClient._raise_for_client_error(httpx.Response(status, **body), "/v1/models")
    message = str(raised.value)
    refused = f"/v1/models: the server refused the request's API key (HTTP {status}"
    assert message.startswith(refused)
    assert KEY_FIX in message and "VLLM_API_KEY" in message and "Give the run" in message


def test_other_errors_keep_their_own_kinds() -> None:
    too_long = httpx.Response(400, json={"error": {"message": "maximum context length is 64"}})
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        VLLMClient._raise_for_client_error(too_long, "generation")
    with pytest.raises(VLLMError, match=r"generation: HTTP 422: bad request") as raised:
        VLLMClient._raise_for_client_error(
            httpx.Response(422, json={"error": "bad request"}), "generation"
        )
    assert not isinstance(raised.value, ServerAuthError)
    VLLMClient._raise_for_client_error(httpx.Response(200, json={}), "generation")
