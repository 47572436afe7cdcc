"""`python -m client.wait_ready HOST:PORT`: wait until a server's gRPC health says SERVING (a job
that must not start before the servers it talks to)."""

from __future__ import annotations

import argparse
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (model load included)")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if is_serving(args.address):
            print(f"{args.address} is SERVING")
            return
        time.sleep(0.2)
    print(f"{args.address} not SERVING after {args.timeout:.0f}s", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
