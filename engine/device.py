"""Which device each server uses by default, the dtype that goes with it, and the dtypes by name."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The dtypes a model and its KV cache can have, by the names flags and the KV layout use.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


def resolve_device(requested: str, role: str) -> torch.device:
    """`auto`: prefill on GPU 0 and decode on GPU 1 when there are two; one GPU is shared (with a
    warning); no GPU means the CPU."""
    if requested != "auto":
        device = torch.device(requested)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"--device {requested}: CUDA is not available on this machine; use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"--device {requested}: only {torch.cuda.device_count()} GPU(s) visible")
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return torch.device("cpu")
    if count == 1:
        log.warning("one GPU visible: the %s server shares it with the other server", role)
        return torch.device("cuda:0")
    return torch.device("cuda:0" if role == "prefill" else "cuda:1")


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if requested not in DTYPES:
        raise ValueError(f"--dtype {requested}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[requested]


def default_preset() -> str:
    return "qwen2.5-7b" if torch.cuda.is_available() else "tiny"


def free_memory(device: torch.device) -> int | None:
    """Bytes `device` can still take: the GPU's free memory and what this process's allocator holds unused,
    or the host's available memory for the CPU (Linux's MemAvailable); None where it can't be read."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found[1]) * 1024 if found else None
