"""Fuzz the Generate request (hypothesis) against real processes: random fields, sizes and raw bytes
always get a defined status (OK or one of the reliability contract's codes) within a per-call
deadline; never a crash, a hang, an UNKNOWN/INTERNAL, or a leaked KV block."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd.v1 import decode_pb2, decode_pb2_grpc

from tests.test_reliability_fixtures import Server, health_status, request, wait_kv_idle

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures"]

VOCAB, CONTEXT = 320, 40960
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_READ = 40     # a valid but long request: read this much, then cancel (that path is fuzzed too)
CALL_TIMEOUT = 30.0
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

int32 = st.integers(-(2**31), 2**31 - 1)
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
token_lists = st.one_of(
    st.lists(int32, max_size=40),                                    # anything
    st.lists(st.integers(0, VOCAB - 1), max_size=600),                # in the vocabulary
    st.integers(CONTEXT + 1, CONTEXT + 100).map(lambda n: [1] * n),   # over the context on its own
)
samplings = st.builds(decode_pb2.SamplingParams,
                      temperature=st.one_of(st.just(0.0), st.floats(0, 5, width=32), float32),
                      top_p=st.one_of(st.just(0.0), st.floats(0, 1, width=32), float32),
                      top_k=st.one_of(st.integers(0, 400), int32),
                      seed=st.integers(0, 2**64 - 1))
valid_samplings = st.builds(decode_pb2.SamplingParams, temperature=st.floats(0, 5, width=32),
                            top_p=st.floats(0, 1, width=32), top_k=st.integers(0, 400),
                            seed=st.integers(0, 2**64 - 1))
wild = st.builds(  # every field anything: mostly refused, each refusal must be clean
    decode_pb2.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=20), st.text(min_size=250, max_size=300)),
    token_ids=token_lists,
    prompt=st.one_of(st.just(""), st.text(max_size=300)),
    max_new_tokens=st.one_of(st.integers(-3, 60), int32, st.just(CONTEXT)),
    sampling=samplings,
    stop_token_ids=st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=5), st.lists(int32, max_size=1100)),
    ignore_eos=st.booleans(),
    prefill_mode=st.one_of(st.sampled_from([0, 1, 2, 3]), int32),
    chunk_size=st.one_of(st.integers(-5, 200), int32),
)
plausible = dict(  # well-formed requests with random sizes, modes and sampling: mostly served
    request_id=st.one_of(st.just(""), st.text(max_size=40)),
    max_new_tokens=st.one_of(st.integers(1, 60), st.integers(CONTEXT - 700, CONTEXT)),
    sampling=st.one_of(st.just(decode_pb2.SamplingParams()), valid_samplings),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=5),
    ignore_eos=st.booleans(),
    prefill_mode=st.sampled_from([0, 1, 2, 3]),
    chunk_size=st.integers(0, 200),
)
requests = st.one_of(
    wild,
    st.builds(decode_pb2.GenerateRequest, token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=600),
              **plausible),
    st.builds(decode_pb2.GenerateRequest, prompt=st.text(min_size=1, max_size=300), **plausible),
)

def send(stub_channel: grpc.Channel, payload: decode_pb2.GenerateRequest | bytes,
         ) -> tuple[grpc.StatusCode, list[decode_pb2.GenerateResponse], str]:
    if isinstance(payload, bytes):
        rpc = stub_channel.unary_stream("/pd.v1.Decode/Generate", request_serializer=None,
                                        response_deserializer=decode_pb2.GenerateResponse.FromString)
        stream = rpc(payload, timeout=CALL_TIMEOUT)
    else:
        stream = decode_pb2_grpc.DecodeStub(stub_channel).Generate(payload, timeout=CALL_TIMEOUT)
    replies: list[decode_pb2.GenerateResponse] = []
    try:
        for reply in stream:
            replies.append(reply)
            if len(replies) == MAX_READ and not reply.finish_reason:
                stream.cancel()
                return grpc.StatusCode.OK, replies, "cancelled by the fuzzer"
    except grpc.RpcError as e:
        return e.code(), replies, e.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, replies, ""


def check_stream(replies: list[decode_pb2.GenerateResponse], max_new_tokens: int | None) -> None:
    assert [r.index for r in replies] == list(range(len(replies)))
    assert all(0 <= r.token_id < VOCAB for r in replies)
    assert all(not r.finish_reason for r in replies[:-1])
    if replies and replies[-1].finish_reason:
        assert replies[-1].finish_reason in ("length", "stop", "eos")
    if max_new_tokens is not None:
        assert len(replies) <= max_new_tokens


def test_fuzz_generate_fields(rel_pair: tuple[Server, Server]) -> None:
    decode, prefill = rel_pair
    reference = fresh_tokens(decode)
    seen: dict[str, int] = {}
    with grpc.insecure_channel(decode.address, options=[("grpc.max_send_message_length", -1)]) as ch:

        @FUZZ
        @given(req=requests)
        def one(req: decode_pb2.GenerateRequest) -> None:
            code, replies, details = send(ch, req)
            seen[code.name] = seen.get(code.name, 0) + 1
            assert code in DEFINED, (code, details)
            if code != grpc.StatusCode.OK:
                assert replies == [] and details and "\n" not in details, (code, details)
            check_stream(replies, req.max_new_tokens if code == grpc.StatusCode.OK else None)

        one()
    print("fuzz statuses:", seen)
    assert seen.get("INVALID_ARGUMENT", 0) > 0 and seen.get("OK", 0) > 0, seen
    after_fuzzing(decode, prefill, reference)


def test_fuzz_generate_raw_bytes(rel_pair: tuple[Server, Server]) -> None:
    decode, prefill = rel_pair
    reference = fresh_tokens(decode)
    valid = request(12, 3).SerializeToString()
    with grpc.insecure_channel(decode.address) as ch:

        @FUZZ
        @given(payload=st.one_of(st.binary(max_size=300),
                                 st.binary(max_size=len(valid)).map(lambda b: valid[:len(b)] + b)))
        def one(payload: bytes) -> None:
            code, replies, details = send(ch, payload)
            assert code in DEFINED, (code, details)
            check_stream(replies, None)

        one()
    after_fuzzing(decode, prefill, reference)


def fresh_tokens(decode: Server) -> list[int]:
    with grpc.insecure_channel(decode.address) as ch:
        return [r.token_id for r in decode_pb2_grpc.DecodeStub(ch).Generate(request(64, 12), timeout=30)]


def after_fuzzing(decode: Server, prefill: Server, reference: list[int]) -> None:
    """Still healthy, nothing leaked, and the same answer as before."""
    assert health_status(decode.address) == "SERVING" and health_status(prefill.address) == "SERVING"
    wait_kv_idle(decode, prefill, timeout=10)
    assert fresh_tokens(decode) == reference
    assert decode.proc is not None and decode.proc.poll() is None
    assert "Traceback" not in decode.log() and "Traceback" not in prefill.log()
