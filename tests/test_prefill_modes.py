"""The prefill modes have one table per side, both read from the proto's PrefillMode: the decode
server's enum (its --mode choices, the request's numbers) and the client's name -> number map."""

from __future__ import annotations

from pd.v1 import decode_pb2

from client.stream import PREFILL_MODES
from decode_server.config import DecodeConfig, PrefillMode


def test_the_server_knows_every_mode_the_proto_names_and_numbers_them_alike() -> None:
    named = {v.number for v in decode_pb2.PrefillMode.DESCRIPTOR.values if v.number}
    assert {mode.number for mode in PrefillMode} == named
    assert {mode.value: mode.number for mode in PrefillMode} == PREFILL_MODES
    assert all(PrefillMode.from_number(mode.number) is mode for mode in PrefillMode)
    assert PrefillMode.from_number(0) is None and PrefillMode.from_number(max(named) + 1) is None


def test_the_default_mode_follows_the_prefill_address() -> None:
    assert DecodeConfig().default_mode is PrefillMode.COLOCATED
    assert DecodeConfig(prefill_addr="127.0.0.1:1").default_mode is PrefillMode.DISAGGREGATED
    assert DecodeConfig(mode="layered").default_mode is PrefillMode.LAYERED
