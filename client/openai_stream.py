"""One streamed `/v1/completions` request to an OpenAI-compatible server (aiohttp), read into the
same `StreamResult` as a gRPC stream, so that the load generator records both alike.

The prompt goes as token ids and each SSE event is taken as one token (this project's server
sends one event a token); an HTTP error becomes the gRPC status it stands for, so a run's failures
read the same over either API.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import grpc

from client.stream import StreamResult

HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
               409: grpc.StatusCode.ALREADY_EXISTS, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
               504: grpc.StatusCode.DEADLINE_EXCEEDED}


JSON = {"Content-Type": "application/json"}


def base_url(target: str) -> str:
    """`host:port` or a URL; the API's root ends in /v1."""
    url = target if "://" in target else f"http://{target}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def completion_body(token_ids: list[int], max_tokens: int, mode: str | None, chunk_size: int,
                    prefill_sms: int = 0, extra_body: str = "") -> bytes:
    """What the gRPC load sends, as an OpenAI request: greedy, ignore_eos, this project's prefill fields;
    `extra_body` (a JSON object) adds fields of its own."""
    body: dict[str, Any] = {"prompt": token_ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True}
    if mode:
        body["prefill_mode"] = mode
    if chunk_size:
        body["chunk_size"] = chunk_size
    if prefill_sms:
        body["prefill_sms"] = prefill_sms
    if extra_body:
        body.update(json.loads(extra_body))
    return json.dumps(body).encode()


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def collect_openai(session: aiohttp.ClientSession, url: str, body: bytes, request_id: str,
                         timeout: float | None = None) -> StreamResult:
    result = StreamResult(sent_at=time.perf_counter())
    try:
        async with session.post(f"{url}/completions", data=body, headers={**JSON, "X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                result.error = HTTP_STATUS.get(response.status, grpc.StatusCode.UNKNOWN)
                result.error_message = _error_message(await response.text())
                return result
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                arrived = time.perf_counter()
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    result.error = getattr(grpc.StatusCode, str(error.get("code", "")).upper(), grpc.StatusCode.UNKNOWN)
                    result.error_message = str(error.get("message", ""))
                    break
                if not event.get("choices"):  # the usage event
                    continue
                choice = event["choices"][0]
                result.tokens.append(len(result.tokens))  # ids don't come over this API: their positions
                result.arrivals.append(arrived)
                result.text += choice.get("text", "")
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except TimeoutError:
        result.error, result.error_message = grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout}s"
    except aiohttp.ClientError as e:
        result.error, result.error_message = grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}"
    return result
