"""Typed reads of a JSON request body's fields: a wrong type or range is one line naming the field."""

from __future__ import annotations

import math
import struct
from typing import Any

from decode_server.openai_prompt import json_type
from serving.validation import InvalidRequest

MAX_FIELD_NAME_CHARS = 64  # of an unknown field's name, as an error or a warning shows it


class Body:
    """Typed reads of a JSON object's fields; a wrong type is one line naming the field."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise InvalidRequest(f"the request body must be a JSON object, got {type(data).__name__}")
        self.data: dict[str, Any] = data

    def get(self, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.data.get(name)
        # JSON's true/false are Python ints too; they are not numbers here
        if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and bool not in
                                                                    (kind if isinstance(kind, tuple) else (kind,)))):
            raise InvalidRequest(f"{name} must be {what}, got {json_type(value)}", name)
        return value

    def integer(self, name: str, default: int, low: int | None = None, high: int | None = None) -> int:
        value = self.get(name, int, "an integer")
        if value is None:
            return default
        if (low is not None and value < low) or (high is not None and value >= high):
            raise InvalidRequest(f"{name} must be in [{low}, {high}), got {value}", name)
        return int(value)

    def float32(self, name: str, default: float) -> float:
        """A number as the proto's float fields hold it, so that a request samples the same tokens
        over HTTP as over gRPC (and a top_p below float32's range is 0 there too, not a filter
        that keeps nothing)."""
        value = self.get(name, (int, float), "a number")
        if value is None:
            return default
        try:
            rounded: float = struct.unpack("f", struct.pack("f", value))[0]
        except (OverflowError, struct.error):
            rounded = math.inf
        if not math.isfinite(rounded):
            raise InvalidRequest(f"{name} must be a finite 32-bit number, got {value}", name)
        return rounded

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.get(name, bool, "true or false")
        return default if value is None else bool(value)
