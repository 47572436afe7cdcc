"""The prefill server's backlog, as mode `auto` sees it: the worker counts the uncached tokens of every
job submitted and not finished, each PrefillDone reports what is left behind it, and the decode side
uses a report only while it is fresh."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from decode_server import prefill_client
from decode_server.prefill_client import PrefillPeer
from tests.servers import ROOT

# In a process of its own: the prefill server's metrics share names with the decode server's, which
# other tests import into this one.
WORKER_CHECK = textwrap.dedent("""
    from pd.v1 import prefill_pb2
    from engine.offline import make_runner
    from engine.prefix_cache import PrefixCache
    from engine.sampling import SamplingParams
    from prefill_server.transports import GrpcSenders
    from prefill_server.worker import PrefillJob, PrefillWorker

    runner = make_runner()
    worker = PrefillWorker(runner, PrefixCache(runner.pool.allocator, runner.layout.block_size, enabled=False))

    class Output(list):
        send = list.append
        def end(self, error=None):
            assert error is None, error

    def job(request_id, n, out):
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(n))
        return PrefillJob(request_id, [i % 200 for i in range(n)], SamplingParams(), table, "grpc", 64, out,
                          GrpcSenders(runner).sender)

    first_out = Output()
    first, second = job("first", 40, first_out), job("second", 70, Output())
    worker.submit(first)
    worker.submit(second)  # the engine thread is not started: both wait
    assert worker.backlog_tokens == 110, worker.backlog_tokens
    worker._run(first)  # as the engine thread would, then its bookkeeping
    worker._finished(first)
    done = next(m.done for m in first_out if isinstance(m, prefill_pb2.PrefillResponse) and m.HasField("done"))
    assert (done.backlog_tokens, worker.backlog_tokens) == (70, 70), (done.backlog_tokens, worker.backlog_tokens)
    worker._finished(second)
    assert worker.backlog_tokens == 0
    print("backlog ok")
""")


def test_each_prefill_reports_the_backlog_behind_it() -> None:
    done = subprocess.run([sys.executable, "-c", WORKER_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "backlog ok" in done.stdout, done.stderr[-3000:]


def test_a_backlog_report_counts_only_while_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(prefill_client.time, "monotonic", lambda: now[0])
    peer = PrefillPeer.__new__(PrefillPeer)  # the bookkeeping only: no channel
    peer.reported_backlog_tokens, peer.reported_at = 0, -1e9
    assert peer.backlog_tokens() == 0
    peer.report_backlog(9000)
    now[0] += prefill_client.BACKLOG_FRESH_S
    assert peer.backlog_tokens() == 9000
    now[0] += 0.01
    assert peer.backlog_tokens() == 0  # stale: this server has sent it nothing lately
