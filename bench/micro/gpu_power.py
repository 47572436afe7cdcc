"""What the card ran at while a figure was measured: board power against its limit, and the SM
clock. A long prefill on an H200 runs into the 700 W limit, and the clock drops under it, so a
floor computed from a short burst of matmuls at boost clock is not one the card can sustain.

Read through NVML (`pynvml`, from the nvidia-ml-py package; the CUDA images carry it). Where it
is missing, the samplers return None and the benchmarks print their figures without it.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PowerReading:
    watts: float        # median board power while sampling
    limit_watts: float  # the enforced power limit
    sm_mhz: float       # median SM clock
    max_sm_mhz: float   # the clock the card boosts to when nothing holds it back
    joules: float | None = None  # energy the board drew over the block (NVML's counter), if it counts


def _nvml_handle(device: torch.device) -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())
    except Exception:  # no NVML library, no permission, or a UUID it does not know
        return None


def _energy_mj(handle: Any) -> int | None:
    """The board's energy counter (mJ since the driver loaded), or None where it does not count."""
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except pynvml.NVMLError:
        return None


class PowerSampler:
    """`with PowerSampler(device) as s: ...`, then `s.reading` (None where NVML is not there).
    A thread samples every `period_s` while the block runs; the energy counter is read at both ends."""

    def __init__(self, device: torch.device, period_s: float = 0.02) -> None:
        self.handle = _nvml_handle(device)
        self.period_s = period_s
        self.reading: PowerReading | None = None
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy_start: int | None = None

    def _sample(self) -> None:
        import pynvml

        while not self._stop.wait(self.period_s):
            watts = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            mhz = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
            self._samples.append((watts, float(mhz)))

    def __enter__(self) -> PowerSampler:
        if self.handle is not None:
            self._energy_start = _energy_mj(self.handle)
            self._thread = threading.Thread(target=self._sample, daemon=True, name="power-sampler")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        energy_end = _energy_mj(self.handle)
        self._stop.set()
        self._thread.join()
        if not self._samples:
            return
        import pynvml

        self.reading = PowerReading(
            watts=statistics.median(w for w, _ in self._samples),
            limit_watts=pynvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1e3,
            sm_mhz=statistics.median(m for _, m in self._samples),
            max_sm_mhz=float(pynvml.nvmlDeviceGetMaxClockInfo(self.handle, pynvml.NVML_CLOCK_SM)),
            joules=None if energy_end is None or self._energy_start is None
            else (energy_end - self._energy_start) / 1e3)


def describe(reading: PowerReading | None) -> str:
    if reading is None:
        return ""
    return (f"{reading.watts:,.0f} W of {reading.limit_watts:,.0f}, SM clock {reading.sm_mhz:,.0f} MHz "
            f"(boost {reading.max_sm_mhz:,.0f})")


def as_json(reading: PowerReading | None) -> dict[str, float | None] | None:
    if reading is None:
        return None
    return {k: None if v is None else round(v, 1) for k, v in vars(reading).items()}


def pj_per_flop(reading: PowerReading | None, flops: float) -> float | None:
    """Energy per FLOP over a block that did `flops`, where the board's energy counter was read."""
    if reading is None or reading.joules is None:
        return None
    return reading.joules / flops * 1e12


def sustained_bf16_tflops(device: torch.device, seconds: float = 3.0,
                          n: int = 8192) -> tuple[float, PowerReading | None, float | None]:
    """The bf16 matmul rate the card holds once it has run into its power limit: n³ matmuls back
    to back for `seconds`, the rate of the last third; the power it ran at, and the energy a FLOP
    took over the whole run (pJ). `measure_bf16_tflops` times a short burst, at boost clock."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    per_window = 20
    windows: list[tuple[float, float]] = []  # (wall time at the end, ms per matmul)
    started = time.perf_counter()
    with PowerSampler(device) as sampler:
        while not windows or windows[-1][0] - started < seconds:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(per_window):
                a @ b
            t1.record()
            t1.synchronize()
            windows.append((time.perf_counter(), t0.elapsed_time(t1) / per_window))
    late = [ms for t, ms in windows if t - started >= seconds * 2 / 3] or [windows[-1][1]]
    flops = 2 * n**3 * per_window * len(windows)
    return 2 * n**3 / (statistics.median(late) * 1e-3) / 1e12, sampler.reading, pj_per_flop(sampler.reading, flops)
