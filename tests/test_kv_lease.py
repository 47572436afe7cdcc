"""prefill_server.kv_lease: a finished job's blocks stay taken until the decode side acknowledges them or
the lease runs out, whichever comes first, and an acknowledgement that comes first frees them as the job ends."""

from __future__ import annotations

import time

from prefill_server.kv_lease import KVLeases


class Freed:
    def __init__(self) -> None:
        self.blocks: list[int] = []

    def __call__(self, blocks: list[int]) -> None:
        self.blocks += blocks


def test_blocks_wait_for_the_acknowledgement() -> None:
    freed = Freed()
    leases = KVLeases(freed, lease_s=60)
    leases.hold("peer", "r1", [3, 4])
    leases.hold("peer", "r2", [5])
    assert freed.blocks == [] and leases.held_blocks == 3
    leases.release("peer", "r1")
    assert freed.blocks == [3, 4] and leases.held_blocks == 1
    leases.release("other-peer", "r2")  # another decode server's request of the same id frees nothing
    assert freed.blocks == [3, 4]
    leases.close()


def test_an_acknowledgement_before_the_job_ends_frees_the_blocks_as_it_ends() -> None:
    freed = Freed()
    leases = KVLeases(freed, lease_s=60)
    leases.release("peer", "r1")
    assert freed.blocks == []
    leases.hold("peer", "r1", [7])
    assert freed.blocks == [7] and leases.held_blocks == 0
    leases.close()


def test_an_unacknowledged_lease_runs_out() -> None:
    freed = Freed()
    leases = KVLeases(freed, lease_s=0.2, sweep_every_s=0.05)
    leases.hold("peer", "r1", [1])
    leases.release("gone", "never-held")  # remembered for a lease's time, then forgotten
    time.sleep(0.1)
    assert freed.blocks == []
    deadline = time.monotonic() + 5
    while not freed.blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert freed.blocks == [1] and leases.held_blocks == 0
    assert leases.sweep() == 0
    leases.close()
