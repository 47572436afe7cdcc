"""An HTTP request's envelope, before its fields are read: the body (size, compression, JSON, read
timeout), the X-Request-Id header, and every refusal as OpenAI's error body, aiohttp's own included.

A body is bounded by the context (--http-max-body-bytes): a larger one is refused by its
Content-Length before a byte of it is read, so a client can't make this process read, hold and
parse tens of megabytes while it decodes for others.

Bodies are decompressed here, not by aiohttp (started with auto_decompress=False), so that an
unknown encoding or a corrupt stream is a 4xx in OpenAI's body, and a decompression bomb stops at the
size limit. Large bodies are decompressed and parsed off the event loop."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from aiohttp import web

log = logging.getLogger(__name__)

# gRPC's ending -> (HTTP status, OpenAI error type)
STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")
PARSE_IN_THREAD_BYTES = 64 << 10   # bodies past this are decompressed and parsed off the event loop
BODY_BYTES_PER_TOKEN = 32          # a token id and its comma, or an escaped character or two
BODY_BYTES_ELSE = 1 << 20
GATES_AT_ONCE = 2                  # value counts in flight; more bodies that need one wait their turn
GATE_TIMEOUT_S = 30.0
# Run as `python -I -S -c GATE max_values` with the body on stdin: prints {"values": n} (counting
# stops past max_values, as count_values counts: GATE ends with its source) or {"error": why it is not
# JSON}. Only json is imported, so it starts fast.
GATE_MAIN = """
import json, sys
try:
    data = json.loads(sys.stdin.buffer.read())
except (ValueError, RecursionError) as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit
print(json.dumps({"values": count_values(data, int(sys.argv[1]))}))
"""
BODY_TIMEOUT_S = 20.0              # the whole body must arrive within this after the headers
HEADER_TIMEOUT_S = 15.0            # ... and the headers within this of the connection opening (or going idle)
MAX_REQUEST_ID_BYTES = 256
# the zlib window bits that take a gzip (31) or zlib (15) header, as each encoding's name says
DECOMPRESS_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


class ApiError(Exception):
    """A request's ending as OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, code: str, param: str | None = None,
                 grpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param
        self.grpc_code = grpc_code  # how the request log and metrics count it, as for gRPC

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, param: str | None = None) -> ApiError:
        status, kind = STATUS.get(code, SERVER_ERROR)
        return cls(status, message, kind, code.name.lower(), param, code)

    @classmethod
    def internal(cls, message: str) -> ApiError:
        return cls(SERVER_ERROR[0], message, SERVER_ERROR[1], "internal", None, grpc.StatusCode.INTERNAL)

    @classmethod
    def bad_body(cls, message: str, code: str, status: int = 400) -> ApiError:
        return cls(status, message, "invalid_request_error", code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(--http-max-body-bytes); a prompt that fills the context fits in less",
                    "invalid_request_error", "request_too_large", None, grpc.StatusCode.RESOURCE_EXHAUSTED)


def request_id_header(request: web.Request) -> str | None:
    """X-Request-Id as sent, or None when absent; refused unless printable ASCII (it goes into logs and
    gRPC metadata), which a header that is not UTF-8 never is."""
    value = request.headers.get("X-Request-Id")
    if not value:
        return None
    if not (value.isascii() and value.isprintable()) or len(value) > MAX_REQUEST_ID_BYTES:
        raise ApiError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_BYTES} printable ASCII characters",
                       "invalid_request_error", "invalid_request_id", "X-Request-Id")
    return value


def default_max_body_bytes(max_model_len: int) -> int:
    """The default --http-max-body-bytes: room for a prompt that fills the context, written the
    longest way a client writes it (token ids, or escaped text: at most BODY_BYTES_PER_TOKEN bytes
    a token), beside the other fields (tools, schemas, logit_bias)."""
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_BYTES_ELSE


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body's bytes, decompressed: 413 past `limit` (told by Content-Length before reading,
    else found while reading or inflating), 408 when it trickles in past BODY_TIMEOUT_S, 415 for an
    encoding other than gzip / deflate, 400 for a corrupt one."""
    if (request.content_length or 0) > limit:
        raise too_large(limit)
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise too_large(limit) from e
    except TimeoutError as e:
        raise ApiError.bad_body(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", "request_timeout",
                                408) from e
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    wbits = DECOMPRESS_WBITS.get(encoding)
    if wbits is None:
        raise ApiError.bad_body(f"Content-Encoding {encoding[:32]!r} is not supported; send the body as is, gzip "
                                "or deflate", "unsupported_content_encoding", 415)
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(inflate, raw, wbits, encoding, limit)
    return inflate(raw, wbits, encoding, limit)


def inflate(raw: bytes, wbits: int, encoding: str, limit: int) -> bytes:
    stream = zlib.decompressobj(wbits)
    try:
        body = stream.decompress(raw, limit + 1)
    except zlib.error as e:
        raise ApiError.bad_body(f"the request body is not valid {encoding}: {e}", "invalid_encoding") from e
    if len(body) > limit:
        raise too_large(limit)
    if not stream.eof:
        raise ApiError.bad_body(f"the request body's {encoding} stream is cut short", "invalid_encoding")
    return body


_gates = asyncio.Semaphore(GATES_AT_ONCE)


async def parse_body(raw: bytes, max_values: int) -> Any:
    """The body as JSON. Parsing holds the GIL throughout (the json module's C scanner), and every
    decode step waits for the GIL between its operations, so a body of a million small values,
    parsed in this process, would hold every stream for the whole parse. Such a body is found
    without parsing: it holds at most 1 + its commas + its opening brackets values. Where that bound
    is past `max_values` (more than any request that fits the context holds), a separate process
    counts them exactly, and the body is refused unparsed here when they are too many."""
    if len(raw) <= PARSE_IN_THREAD_BYTES:
        return parse_json(raw)
    if await asyncio.to_thread(value_bound, raw) > max_values:
        async with _gates:
            verdict = await asyncio.to_thread(gate_verdict, raw, max_values)
        if "error" in verdict:
            raise ApiError.bad_body(f"the request body is not valid JSON: {verdict['error']}", "invalid_json")
        if verdict["values"] > max_values:
            raise too_complex(max_values)
    return await asyncio.to_thread(parse_json, raw)


def value_bound(raw: bytes) -> int:
    """At most how many JSON values `raw` holds: 1 + its commas + its opening brackets. Counted with
    numpy, which lets the GIL go while it scans; `bytes.count` keeps it (3-5 ms for a 2.4 MB body on
    a 2-core CPU, and every decode step waits for the GIL between its operations)."""
    scanned = np.frombuffer(raw, np.uint8)
    return 1 + sum(int(np.count_nonzero(scanned == byte)) for byte in b",[{")


def too_complex(max_values: int) -> ApiError:
    return ApiError.bad_body(f"the request body holds more than {max_values} JSON values; no request that fits "
                             "this server's context limit needs that many", "request_too_complex")


def count_values(data: Any, limit: int) -> int:
    """The JSON values in `data` (itself, its items, its objects' values), counted up to past `limit`
    (in this process, or in GATE's)."""
    n, todo = 0, [data]
    while todo and n <= limit:
        x = todo.pop()
        n += 1
        if isinstance(x, list):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return n


def gate_verdict(raw: bytes, max_values: int) -> dict[str, Any]:
    """GATE's verdict on `raw`. subprocess.Popen starts it with vfork, which holds this process
    for well under a millisecond, where the event loop's fork would copy the page tables of a
    process that holds a model (tens of ms with the GIL held); the wait releases the GIL."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", GATE, str(max_values)], input=raw,
                              capture_output=True, timeout=GATE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"checking it took over {GATE_TIMEOUT_S:g} s"}
    try:
        verdict: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        return {"error": "the JSON check failed"}
    return verdict


def parse_json(raw: bytes) -> Any:
    """400 when it is not JSON (bad UTF-8 included)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ApiError.bad_body(f"the request body is not valid JSON: {e}", "invalid_json") from e


class ClientErrorLog:
    """Clients' mistakes (refused requests, unknown fields taken), one line each, at most `per_window`
    a window; then one line counting those left out, so that a client sending garbage can't flood
    the log. Only the server's own faults get a traceback, elsewhere."""

    def __init__(self, per_window: int = 20, window_s: float = 10.0) -> None:
        self.per_window, self.window_s = per_window, window_s
        self.window_start, self.logged, self.left_out = 0.0, 0, 0

    def refused(self, request_id: str, error: ApiError) -> None:
        self._line(logging.INFO, f"request {request_id} refused ({error.status} {error.code}): {str(error)[:300]}")

    def warn(self, request_id: str, text: str) -> None:
        self._line(logging.WARNING, f"request {request_id}: {text}")

    def _line(self, level: int, text: str) -> None:
        now = time.monotonic()
        if now - self.window_start >= self.window_s:
            if self.left_out:
                log.info("%d more refused requests were not logged in the last %g s", self.left_out, self.window_s)
            self.window_start, self.logged, self.left_out = now, 0, 0
        if self.logged < self.per_window:
            self.logged += 1
            log.log(level, "%s", text)
        else:
            self.left_out += 1


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method) in OpenAI's error body too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, f"{request.method} {request.path}: {e.reason}", "invalid_request_error",
                        e.reason.lower().replace(" ", "_")).response()


GATE = "from __future__ import annotations\n" + inspect.getsource(count_values) + GATE_MAIN
