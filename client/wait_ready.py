"""`python -m client.wait_ready HOST:PORT`: wait until a server's gRPC health says SERVING (a job
that must not start before the servers it talks to).

A server started with TLS is probed over TLS: `--tls-ca` verifies its certificate, and
`--tls-cert/--tls-key` is the certificate presented to one that requires a client's (mutual TLS). With
`--health-port` the probe asks the server's plaintext health port instead, on the same host.
`probe_for` derives the same from the flags a server is started with (the launcher's probe).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass(frozen=True)
class Probe:
    """Where and how to ask a server's health: plaintext, or TLS with these PEM files."""

    address: str
    root_certs: tuple[Path, ...] = ()   # TLS when not empty: the certificates trusted for the server's
    client_cert: Path | None = None     # presented when the server requires a client certificate
    client_key: Path | None = None

    def channel(self) -> grpc.Channel:
        if not self.root_certs:
            return grpc.insecure_channel(self.address)
        roots = b"".join(p.read_bytes() for p in self.root_certs)
        key = self.client_key.read_bytes() if self.client_key else None
        cert = self.client_cert.read_bytes() if self.client_cert else None
        return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(roots, key, cert))


def _health_address(address: str, health_port: int) -> str:
    return f"{address.rsplit(':', 1)[0]}:{health_port}"


def probe_for(address: str, server_args: Sequence[str]) -> Probe:
    """The probe of a server at `address` started with `server_args` (its own flags): its plaintext
    --health-port when it has one; else over TLS when it has --tls-cert, trusting the CAs among its
    flags (--tls-ca, --tls-client-ca) and its own certificate (a self-signed one), and presenting its
    --tls-client-cert, or its own certificate, to a server that requires one (--tls-client-ca)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--tls-client-ca", "--tls-client-cert", "--tls-client-key"):
        parser.add_argument(flag, type=Path)
    parser.add_argument("--health-port", type=int, default=0)
    flags, _ = parser.parse_known_args(list(server_args))
    if flags.health_port:
        return Probe(_health_address(address, flags.health_port))
    if flags.tls_cert is None:
        return Probe(address)
    roots = tuple(p for p in (flags.tls_ca, flags.tls_client_ca, flags.tls_cert) if p is not None)
    if flags.tls_client_ca is None:
        return Probe(address, roots)
    if flags.tls_client_cert is not None:
        return Probe(address, roots, flags.tls_client_cert, flags.tls_client_key)
    return Probe(address, roots, flags.tls_cert, flags.tls_key)


def is_serving(probe: Probe | str, timeout: float = 1.0) -> bool:
    """`probe`: a Probe, or a plaintext address. A PEM file that can't be read is not yet serving (a server
    given it refuses to start, in a line of its own)."""
    probe = Probe(probe) if isinstance(probe, str) else probe
    try:
        channel = probe.channel()
    except OSError:
        return False
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (model load included)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA bundle: probe over TLS, trusting it")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate, for a server that requires one")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--health-port", type=int, default=0, help="the server's plaintext health port: probe it")
    args = parser.parse_args()
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        parser.error("--tls-cert needs --tls-ca, the CA that signed the server's certificate")
    for path in (args.tls_ca, args.tls_cert, args.tls_key):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    if args.health_port:
        probe = Probe(_health_address(args.address, args.health_port))
    else:
        probe = Probe(args.address, (args.tls_ca,) if args.tls_ca else (), args.tls_cert, args.tls_key)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if is_serving(probe):
            print(f"{args.address} is SERVING")
            return
        time.sleep(0.2)
    print(f"{args.address} not SERVING after {args.timeout:.0f}s", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
