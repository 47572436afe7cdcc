"""A prompt's token ids as both servers hold them: the protobuf repeated int32 field they arrived
in. numpy reads such a field in one copy and protobuf forwards it into another message in one, so
no path from the wire to the engine or on to a prefill server turns a long prompt into Python
ints one at a time (that took 1-4 ms for 32k tokens on the event loop, bench/NOTES.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from pd.v1 import decode_pb2

TokenIds = Sequence[int]  # a repeated int32 field as received; plain lists work too, only slower


def token_ids(values: Iterable[int]) -> TokenIds:
    """`values` (e.g. a tokenizer's list) as a repeated int32 field."""
    return decode_pb2.GenerateRequest(token_ids=values).token_ids


def as_array(ids: TokenIds) -> np.ndarray:
    """The ids as an int64 array: one copy out of a repeated field or an array."""
    return np.asarray(ids, dtype=np.int64)
