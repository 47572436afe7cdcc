"""TokenReader on the CPU (CI): plain Python ints, as the engines append them."""

from __future__ import annotations

import torch

from engine.host_read import TokenReader


def test_cpu_read_gives_python_ints() -> None:
    got = TokenReader(torch.device("cpu")).read(torch.tensor([3, 1, 4], dtype=torch.long))
    assert got == [3, 1, 4] and all(type(t) is int for t in got)
