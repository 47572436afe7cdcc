"""Programmatic dependent launch (Hopper and later) for the decode step's own kernels.

A decode step at batch 1 is about 170 kernels of 2-70 µs; between two of them the GPU drains one
grid, then launches and ramps up the next. Launched with PDL, a kernel's programs may be scheduled
while the kernel before it on the stream finishes: each waits (`griddepcontrol.wait`: the previous
grid complete, its writes visible) before it reads or writes anything, and lets the next kernel be
scheduled once its own main loop is done. The wait makes the order what the stream's would be, so
results do not change. CUDA graphs keep these edges when captured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@functools.cache
def supported() -> bool:
    """A Hopper (or later) GPU, and a Triton that launches with PDL."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return ("launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (9, 0))


@dataclass
class LaunchSettings:
    """How our kernels launch, for the whole process (one model in it): set when the model is built
    (`engine.ops.apply_launch_options`); PDL is on by default wherever it is supported."""

    pdl_wanted: bool = True

    def pdl(self) -> bool:
        return self.pdl_wanted and supported()  # asked on first launch, not at import: no CUDA before a fork


SETTINGS = LaunchSettings()


def enabled() -> bool:
    """Whether kernels launch with PDL."""
    return SETTINGS.pdl()


def set_enabled(flag: bool) -> None:
    """Turn PDL off (or back on where supported) for kernels launched, or graphs captured, from now on."""
    SETTINGS.pdl_wanted = flag


# a * b + c contracted to one fused multiply-add, as Triton has done by default: the kernels' code and bits,
# and the tests that compare kernels bit for bit, stay what they are where a later Triton turns it off by default
FP_FUSION = True


def options(max_registers: int | None = None) -> dict[str, bool | int]:
    """A launch's PDL arguments: the kernel's `PDL` constexpr (wait, then let the next be scheduled) and
    Triton's `launch_pdl`, always set together; with `max_registers` (0 or None: the compiler's count),
    Triton's `maxnreg`, a cap on a thread's registers so that more programs share an SM; and FP_FUSION."""
    flag = enabled()
    return {"PDL": flag, "launch_pdl": flag, "enable_fp_fusion": FP_FUSION,
            **({"maxnreg": max_registers} if max_registers else {})}
