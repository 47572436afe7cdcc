"""`bench.micro.gemv_ws`' bulk-copy W8A8 tile on the CPU, through Triton's interpreter: with and without the
warp-specialized loop it gives the dequantized product (the GPU sweep compares it with the engine's tile)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CHECK = """
import torch
from bench.micro.gemv_ws import copy_tile
from engine.fp8 import FP8_MAX, quantize_per_channel
torch.manual_seed(0)
m, n, k = 5, 96, 512
w, s = quantize_per_channel(torch.randn(n, k) * k**-0.5)
x = torch.randn(m, k)
x_scale = (x.abs().amax(1, keepdim=True) / FP8_MAX).contiguous()
xq = (x / x_scale).to(torch.float8_e4m3fn)
ref = (xq.float() * x_scale) @ (w.float() * s[:, None]).T
for spec in (False, True):
    out = copy_tile(torch.cat([xq, xq.new_zeros(64 - m, k)]), torch.cat([x_scale, x_scale.new_zeros(64 - m, 1)]),
                    w, s, 32, 128, 3, spec)[:m]
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 4e-3, (spec, err)
print("copy tile ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_copy_tile_matches_the_dequantized_product() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "copy tile ok" in proc.stdout
