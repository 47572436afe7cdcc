"""`python -m bench.micro.gemv_launches`: the 64-row W8A8 tiles at Qwen2.5-7B's down and gate/up, the
engine's tile and wider ones, each launched three times and nothing else timed: a target for a
profiler (`ncu --kernel-name regex:_gemv_kernel --section SpeedOfLight --section MemoryWorkloadAnalysis
python -m bench.micro.gemv_launches`), whose launches come in the order printed."""

from __future__ import annotations

import torch

from engine.fp8 import quantize_per_channel
from engine.kernels import gemv
from engine.kernels.fp8_quant import quantize_rows

LAUNCHES = 3


def main() -> None:
    torch.manual_seed(0)
    for name, n, k, gated in (("down", 3584, 18944, False), ("gate_up", 2 * 18944, 3584, True)):
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        w, scale = quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        x_e4m3 = quantize_rows(x)
        engine = gemv.gated_config_for(w, 64) if gated else gemv.config_for(w, 64)
        assert engine is not None
        wider = ([gemv.GemvConfig(128, 128, 4, 3, 1, quantize_x=True, strip_n=72)] if gated else
                 [gemv.GemvConfig(128, 256, 4, 4, 2, quantize_x=True),
                  gemv.GemvConfig(128, 128, 4, 5, 4, quantize_x=True)])
        for cfg in [engine, *wider]:
            print(name, cfg, flush=True)
            for _ in range(LAUNCHES):
                if gated:
                    gemv.gemv_silu(x, w, cfg=cfg, scale=scale, x_e4m3=x_e4m3)
                else:
                    gemv.gemv(x, w, cfg=cfg, scale=scale, x_e4m3=x_e4m3)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
