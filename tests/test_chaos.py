"""Chaos under load (`make soak`): client.load's Poisson arrivals against a decode server with two prefill
servers, while one of them is SIGKILLed and restarted, then SIGSTOPped and thawed. Afterwards:

- every request ended with a status the reliability contract allows (OK; UNAVAILABLE only around an
  outage, within seconds, never a hang);
- goodput recovers within 2 s of the restart and of the thaw: requests sent from then on end OK within
  the latency objective, as many of them as before the chaos;
- the victim serves prefills again after each recovery;
- no KV is leaked: every server's pool is whole, nothing running or waiting.

CHAOS_RATE (requests/s, default 5) and CHAOS_SEED change the load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from client.load_plan import LoadSpec, build_plan
from client.load_run import Deployment, LoadRunner, Record
from decode_server.nixl_receive import ENDED_WAIT_S
from engine.transport.nixl import TRANSFER_TIMEOUT_S, nixl_available
from tests.test_reliability_fixtures import Server, start_all, stop_all, wait_kv_idle

pytestmark = pytest.mark.soak

RATE = float(os.environ.get("CHAOS_RATE", "5"))
SEED = int(os.environ.get("CHAOS_SEED", "25"))
RECOVERY_S = 2.0     # goodput is back this long after a restart or a thaw
IN_FLIGHT_S = 1.0    # a request sent this shortly before a fault may still be in its prefill when it comes
FREEZE_S = 10.0      # how long the victim stays SIGSTOPped: longer than finding it frozen and retrying
CALM_S = 5.0         # load before the first fault, and between the faults
SLO_S = 5.0          # a request that ends OK within this counts towards goodput (a tiny model on a shared CPU)
FREEZE_DETECT_S = 5.0  # the contract: a request stuck on a frozen prefill server ends within this of the freeze
RETRY_S = 3.0        # and its retry on the other prefill server, on this loaded CPU
SETTLE_S = TRANSFER_TIMEOUT_S + ENDED_WAIT_S  # the decode side's bound on a silent peer's last notification
PREFILL_OK = 'prefill_requests_total{status="OK"}'


@dataclass
class Timeline:
    """When each fault happened, in seconds from the load's start (the records' clock)."""

    t0: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> float:
        self.marks[name] = time.perf_counter() - self.t0
        return self.marks[name]


async def chaos(runner: LoadRunner, victim: Server, timeline: Timeline, served: dict[str, float],
                servers: list[Server]) -> Server:
    """Kill the victim, restart it, freeze it, thaw it; returns the process serving in its place (also added
    to `servers`, for the clean-up)."""
    while not runner.t0:
        await asyncio.sleep(0.01)
    timeline.t0 = runner.t0
    await asyncio.sleep(CALM_S)
    victim.kill()
    timeline.mark("killed")
    replacement = victim.restarted()
    servers.append(replacement)
    await asyncio.to_thread(replacement.start)
    timeline.mark("restarted")
    served["after restart"] = replacement.metrics().get(PREFILL_OK, 0.0)
    await asyncio.sleep(CALM_S)
    replacement.signal(signal.SIGSTOP)
    timeline.mark("frozen")
    await asyncio.sleep(FREEZE_S)
    replacement.signal(signal.SIGCONT)
    timeline.mark("thawed")
    served["after thaw"] = await asyncio.to_thread(lambda: replacement.metrics().get(PREFILL_OK, 0.0))
    return replacement


def ended_s(r: Record) -> float:
    return r.token_times_s[-1] if r.ok and r.token_times_s else r.sent_s


def goodput(records: list[Record], start: float, end: float, fault_at_end: bool) -> tuple[int, int]:
    """(requests sent in [start, end) that ended OK within the SLO, requests sent then). Where a fault
    comes at `end`, a request sent within IN_FLIGHT_S of it that failed was still in its prefill when
    the fault came (over nixl one on the frozen server can't be retried): it is the fault's, which
    check_statuses judges, not the window's."""
    sent = [r for r in records if start <= r.sent_s < end
            and (r.ok or not fault_at_end or r.sent_s < end - IN_FLIGHT_S)]
    return sum(r.ok and ended_s(r) - r.sent_s <= SLO_S for r in sent), len(sent)


def check_statuses(records: list[Record], marks: dict[str, float]) -> None:
    outages = [(marks["killed"], marks["restarted"] + RECOVERY_S), (marks["frozen"], marks["thawed"] + RECOVERY_S)]
    for r in records:
        if not r.ok:
            assert r.status == "UNAVAILABLE", (r.key, r.status, r.error_message)
            assert "prefill server" in r.error_message, r.error_message
            # in flight at an outage, or sent during one
            assert any(start - 30 <= r.sent_s <= end for start, end in outages), (r.key, r.sent_s, marks)
        elif marks["frozen"] - 30 <= r.sent_s <= marks["thawed"]:
            # one stuck on the frozen server was given up within seconds of the freeze and retried on the other
            stuck_from = max(r.sent_s, marks["frozen"])
            assert ended_s(r) - stuck_from <= FREEZE_DETECT_S + RETRY_S, (r.key, r.sent_s, ended_s(r), marks)


@pytest.mark.parametrize("transport", ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed"))])
def test_chaos_under_load(server_logs: Path, transport: str) -> None:
    """Over nixl the prefill server is killed, and frozen, mid-transfer as well: writes into the decode pool."""
    flag = ["--kv-transport", transport]
    victim = Server("prefill_server", flag, server_logs)
    survivor = Server("prefill_server", flag, server_logs)
    decode = Server("decode_server", [*flag, "--prefill-addr", f"{victim.address},{survivor.address}"], server_logs)
    start_all([victim, survivor, decode])
    servers = [decode, survivor, victim]
    duration = 3 * CALM_S + FREEZE_S + 15  # a restart takes 8-11 s on a loaded 2-core machine (imports, model)
    spec = LoadSpec(rate=RATE, duration=duration, prompt_len="uniform:16:192", output_len="uniform:4:16", seed=SEED)
    runner = LoadRunner(build_plan(spec), Deployment("chaos", (decode.address,), "disaggregated"), timeout_s=120,
                        progress=False)
    timeline = Timeline()
    served: dict[str, float] = {}

    async def run() -> Server:
        _, replacement = await asyncio.gather(runner.run(warmup=True),
                                              chaos(runner, victim, timeline, served, servers))
        return replacement

    try:
        replacement = asyncio.run(run())
        records, marks = runner.records, timeline.marks
        assert marks["thawed"] + RECOVERY_S + 3 < duration, f"the load ended too soon after the faults: {marks}"
        check_statuses(records, marks)
        # no hang: every request ended, and well before its deadline
        assert all(ended_s(r) - r.sent_s < 30 for r in records)
        good_before, sent_before = goodput(records, 1.0, marks["killed"], fault_at_end=True)
        assert sent_before and good_before == sent_before, "failures before any fault"
        after_restart = goodput(records, marks["restarted"] + RECOVERY_S, marks["frozen"], fault_at_end=True)
        after_thaw = goodput(records, marks["thawed"] + RECOVERY_S, duration, fault_at_end=False)
        for (good, sent), what in ((after_restart, "restart"), (after_thaw, "thaw")):
            assert sent and good == sent, f"goodput {good}/{sent} from {RECOVERY_S}s after the {what}"
        # over nixl, blocks of a request sent to the frozen server that it never started stay held until
        # the prefill side's transfer timeout: nothing tells the decode side that no WRITE will come
        wait_kv_idle(decode, survivor, replacement, timeout=10 + (SETTLE_S if transport == "nixl" else 0))
        # the victim was used again: prefills it finished after the restart, and after the thaw
        final = replacement.metrics()[PREFILL_OK]
        assert served["after thaw"] > served["after restart"] and final > served["after thaw"], (served, final)
        print("\nchaos: " + json.dumps({"marks_s": {k: round(v, 2) for k, v in marks.items()},
                                        "requests": len(records),
                                        "unavailable": sum(r.status == "UNAVAILABLE" for r in records),
                                        "goodput_before": [good_before, sent_before],
                                        "goodput_after_restart": list(after_restart),
                                        "goodput_after_thaw": list(after_thaw)}))
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                s.signal(signal.SIGCONT)
        stop_all(servers)
