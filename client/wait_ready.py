"""`python -m client.wait_ready HOST:PORT`: wait until a server's gRPC health says SERVING.

Used by `make serve-*`: fails fast, with the server log's last lines, if the process dies first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("address")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (model load included)")
    parser.add_argument("--pid-file", type=Path, help="fail at once if this process exits")
    parser.add_argument("--log", type=Path, help="server log to show on failure")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout
    pid = int(args.pid_file.read_text()) if args.pid_file and args.pid_file.exists() else None
    while time.monotonic() < deadline:
        if is_serving(args.address):
            print(f"{args.address} is SERVING")
            return
        if pid is not None and not pid_alive(pid):
            tail = args.log.read_text().splitlines()[-5:] if args.log and args.log.exists() else []
            print(f"the server on {args.address} exited before it was ready:", *tail, sep="\n  ", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.2)
    print(f"{args.address} not SERVING after {args.timeout:.0f}s (see {args.log})", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
