"""`python -m bench.micro.nccl_p2p`: what NCCL's send/recv alone carries between two GPUs, by message
size: the ceiling the nccl KV transport (one message a layer, 67 MB for the Qwen2.5-7B shape at
32k tokens) works under, beside a plain peer copy of the same bytes (the cuda-ipc transport's).

Two processes, one a GPU, each in a two-rank NCCL group; the same total is sent as messages of
each size, back to back, timed by the receiver from a barrier to the last message landed.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import metadata, time_cuda, write_json
from serving.grpc_common import set_nccl_env

MB = 1 << 20


def _run(rank: int, port: int, total_mb: int, sizes_mb: list[int], repeats: int, json_path: str | None) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    buf = torch.ones(total_mb * MB // 2, dtype=torch.bfloat16, device="cuda")
    rows = []
    for size in sizes_mb:
        parts = buf.split(size * MB // 2)
        seconds = []
        for i in range(repeats + 1):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for part in parts:
                (dist.send if rank == 0 else dist.recv)(part, 1 - rank)
            torch.cuda.synchronize()
            if i:
                seconds.append(time.perf_counter() - t0)
        if rank == 1:
            best = min(seconds)
            rows.append({"message_mb": size, "messages": len(parts), "total_bytes": buf.numel() * 2,
                         "seconds": round(best, 6), "gbps": round(buf.numel() * 2 / best / 1e9, 1)})
            print(f"NCCL send/recv {len(parts):>4} x {size:>5} MB: {best * 1e3:6.2f} ms = {rows[-1]['gbps']:5.0f} GB/s",
                  flush=True)
    if rank == 1:
        other = torch.empty(buf.numel(), dtype=buf.dtype, device="cuda:0")
        ms = time_cuda(lambda: other.copy_(buf), iters=repeats)
        print(f"peer copy (one {total_mb} MB copy, cuda:1 -> cuda:0): {ms:.2f} ms = "
              f"{buf.numel() * 2 / ms / 1e6:.0f} GB/s", flush=True)
        if json_path:
            write_json(json_path, {**metadata(), "rows": rows, "peer_copy_ms": round(ms, 3)})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.nccl_p2p", description=__doc__)
    p.add_argument("--total-mb", type=int, default=1792, help="bytes moved per size (1,792 MiB = 32k tokens of 7B KV)")
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256, 1792])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("error: bench.micro.nccl_p2p needs two GPUs")
    set_nccl_env()  # as the servers run NCCL; the spawned ranks inherit it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # on a port it picks
    mp.spawn(_run, args=(store.port, args.total_mb, args.sizes_mb, args.repeats, args.json), nprocs=2)


if __name__ == "__main__":
    main()
