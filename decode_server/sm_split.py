"""Partitioned mode's split of the SMs: --prefill-sms as given, or the largest count whose measured
gap for a decoding request stays within --itl-slo-ms, from a table measured on the device."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_server.config import DecodeConfig, PrefillMode
from engine import green_context
from engine.green_context import SmPartitions

log = logging.getLogger(__name__)

DEFAULT_TABLE = Path(__file__).with_name("sm_split_table.json")


@dataclass(frozen=True)
class SplitRow:
    prefill_sms: int
    a_gap_ms: float  # A's longest gap between two tokens while a prefill runs on prefill_sms SMs


@dataclass(frozen=True)
class SplitTable:
    path: str
    decode_step_alone_ms: float
    rows: tuple[SplitRow, ...]
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> SplitTable:
        where = Path(path) if path else DEFAULT_TABLE
        try:
            doc = json.loads(where.read_text())
            rows = tuple(SplitRow(int(r["prefill_sms"]), float(r["a_gap_ms"])) for r in doc["rows"])
            alone = float(doc["decode_step_alone_ms"])
            source = str(doc.get("provenance", {}).get("source", "unrecorded"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--sm-split-table {where}: can't read it ({type(e).__name__}: {e}); it needs "
                             "decode_step_alone_ms and rows of prefill_sms and a_gap_ms") from None
        if not rows:
            raise ValueError(f"--sm-split-table {where}: it has no rows")
        return cls(str(where), alone, tuple(sorted(rows, key=lambda r: r.prefill_sms)), source)

    def pick(self, itl_slo_ms: float | None) -> tuple[int, float]:
        """(prefill SMs, the SLO it was picked for): the most SMs whose gap is within the SLO, which is
        twice the decode step alone unless given."""
        slo = itl_slo_ms if itl_slo_ms is not None else 2 * self.decode_step_alone_ms
        fits = [r for r in self.rows if r.a_gap_ms <= slo]
        if not fits:
            least = min(self.rows, key=lambda r: r.a_gap_ms)
            raise ValueError(f"no split in {self.path} keeps A's gap within {slo:g} ms (the shortest, "
                             f"{least.a_gap_ms:g} ms, is with {least.prefill_sms} prefill SMs); raise "
                             "--itl-slo-ms or pass --prefill-sms")
        return max(r.prefill_sms for r in fits), slo


def open_partitions(cfg: DecodeConfig, device: torch.device) -> tuple[SmPartitions | None, int]:
    """Partitioned mode's green contexts and the default prefill SM count; (None, 0) where the device
    has none, said in one line: partitioned prompts are then prefilled as layered ones."""
    level = logging.WARNING if cfg.default_mode == PrefillMode.PARTITIONED else logging.INFO
    reason = green_context.unavailable(device)
    if reason:
        log.log(level, "no green contexts (%s): partitioned prefill falls back to layered", reason)
        return None, 0
    partitions = green_context.GreenContexts(device)
    if cfg.prefill_sms is not None:
        sms, how = cfg.prefill_sms, "--prefill-sms"
    else:
        table = SplitTable.load(cfg.sm_split_table)
        sms, slo = table.pick(cfg.itl_slo_ms)
        how = f"picked for A's gap within {slo:g} ms from {table.path} ({table.source})"
    problem = partitions.check(sms)
    if problem:
        raise ValueError(f"--prefill-sms {problem}")
    try:
        partitions.prepare(sms)
    except RuntimeError as e:  # e.g. a driver older than green contexts
        log.log(level, "no green contexts (making one of %d SMs failed: %s): partitioned prefill falls back to "
                "layered", sms, e)
        return None, 0
    log.info("partitioned prefill on %d of %d SMs in a green context (%s); decode keeps the primary context",
             sms, partitions.total_sms, how)
    return partitions, sms
