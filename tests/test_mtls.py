"""Mutual TLS: with --tls-client-ca, both servers refuse a caller without a client certificate or with one
another CA signed; the decode server presents --tls-client-cert to its prefill servers, so a disaggregated
Generate works end to end (dialled by IP, the prefill server's certificate checked against the DNS name that
resolved to it); kubelet-style probes get health alone, in plaintext, on --health-port."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from decode_server.__main__ import parse_config as parse_decode
from prefill_server.__main__ import parse_config as parse_prefill
from tests.servers import ROOT, free_port
from tests.test_reliability_fixtures import Server, health_status, request, start_all, stop_all

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

x509 = pytest.importorskip("cryptography.x509")


@dataclass
class Issued:
    cert: Path
    key: Path


class CA:
    """A throwaway certificate authority that issues leaf certificates for 127.0.0.1/localhost."""

    def __init__(self, folder: Path, name: str) -> None:
        from cryptography.hazmat.primitives.asymmetric import ec

        self.folder, self.name = folder, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = self._name(name)
        self.cert = self._builder(subject, self.key.public_key()).issuer_name(subject).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(self.key, self._sha256())
        self.path = self._write(f"{name}-ca", self.cert, self.key).cert

    @staticmethod
    def _name(common_name: str):  # type: ignore[no-untyped-def]
        from cryptography.x509.oid import NameOID

        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    @staticmethod
    def _sha256():  # type: ignore[no-untyped-def]
        from cryptography.hazmat.primitives import hashes

        return hashes.SHA256()

    def _builder(self, subject, public_key):  # type: ignore[no-untyped-def]
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def _write(self, stem: str, cert, key) -> Issued:  # type: ignore[no-untyped-def]
        from cryptography.hazmat.primitives import serialization

        issued = Issued(self.folder / f"{stem}.crt", self.folder / f"{stem}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        return issued

    def issue(self, common_name: str, ip_too: bool = True) -> Issued:
        """A certificate good for both ends of a connection (server and client auth), as cert-manager issues,
        for localhost and (`ip_too`) 127.0.0.1."""
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID

        key = ec.generate_private_key(ec.SECP256R1())
        names = [x509.DNSName("localhost")]
        if ip_too:
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (self._builder(self._name(common_name), key.public_key()).issuer_name(self.cert.subject)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, self._sha256()))
        return self._write(f"{self.name}-{common_name}", cert, key)


class HealthPortServer(Server):
    """Ready when its plaintext --health-port says SERVING (its gRPC port wants a client certificate)."""

    def __init__(self, module: str, args: list[str], log_dir: Path) -> None:
        self.health_port = free_port()
        super().__init__(module, [*args, "--health-port", str(self.health_port)], log_dir)

    def ready(self) -> bool:
        return health_status(f"127.0.0.1:{self.health_port}") == "SERVING"


@dataclass
class Mtls:
    decode: HealthPortServer
    prefill: HealthPortServer
    ca: CA
    client: Issued    # signed by `ca`
    stranger: Issued  # signed by another CA


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[Mtls]:
    folder = tmp_path_factory.mktemp("mtls")
    ca = CA(folder, "pd")
    # The decode server dials the addresses a dns:/// name resolves to, and checks the certificate against
    # the name: the prefill server's certificate need not list its IP (a pod's, unknown when it is issued).
    by_name = {info[4][0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)} == {"127.0.0.1"}
    prefill_cert = ca.issue("prefill", ip_too=not by_name)
    prefill = HealthPortServer("prefill_server", ["--tls-cert", str(prefill_cert.cert), "--tls-key",
                                                  str(prefill_cert.key), "--tls-client-ca", str(ca.path)], server_logs)
    serving = ca.issue("server")
    tls = ["--tls-cert", str(serving.cert), "--tls-key", str(serving.key), "--tls-client-ca", str(ca.path)]
    towards_prefill = ca.issue("decode")
    target = f"dns:///localhost:{prefill.port}" if by_name else prefill.address
    decode = HealthPortServer("decode_server", [*tls, "--prefill-addr", target, "--tls-ca", str(ca.path),
                                                "--tls-client-cert", str(towards_prefill.cert),
                                                "--tls-client-key", str(towards_prefill.key)], server_logs)
    start_all([prefill, decode])
    yield Mtls(decode, prefill, ca, ca.issue("client"), CA(folder, "other").issue("client"))
    stop_all([decode, prefill])


def channel(address: str, ca: Path, client: Issued | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), client.key.read_bytes() if client else None,
                                         client.cert.read_bytes() if client else None)
    return grpc.secure_channel(address, creds)


def test_a_client_with_a_certificate_from_the_ca_gets_a_disaggregated_generate(mtls: Mtls) -> None:
    with channel(mtls.decode.address, mtls.ca.path, mtls.client) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        replies = list(stub.Generate(request(40, 6, prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=30))
    assert [r.index for r in replies] == list(range(6)) and replies[-1].finish_reason == "length"
    proc = subprocess.run([sys.executable, "-m", "client.generate", "--target", mtls.decode.address,
                           "--tls-ca", str(mtls.ca.path), "--tls-client-cert", str(mtls.client.cert),
                           "--tls-client-key", str(mtls.client.key), "--token-ids", "1,2,3,4",
                           "--max-new-tokens", "3", "--ignore-eos"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason=length" in proc.stdout


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_both_servers_refuse_a_client_without_the_cas_certificate(mtls: Mtls, who: str) -> None:
    client = None if who == "no certificate" else mtls.stranger
    with channel(mtls.decode.address, mtls.ca.path, client) as ch, pytest.raises(grpc.RpcError) as e:
        list(decode_pb2_grpc.DecodeStub(ch).Generate(request(10, 2), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with channel(mtls.prefill.address, mtls.ca.path, client) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(ch).Handshake(prefill_pb2.HandshakeRequest(peer_id="intruder"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with grpc.insecure_channel(mtls.prefill.address) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(ch).Handshake(prefill_pb2.HandshakeRequest(peer_id="plaintext"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_the_health_port_answers_health_alone(mtls: Mtls) -> None:
    plain = f"127.0.0.1:{mtls.prefill.health_port}"
    assert health_status(plain) == "SERVING"
    with grpc.insecure_channel(plain) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(ch).Handshake(prefill_pb2.HandshakeRequest(peer_id="probe"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]


@pytest.mark.parametrize(("parse", "argv", "says"), [
    (parse_prefill, ["--tls-client-ca", "ca.crt"], "--tls-client-ca needs --tls-cert"),
    (parse_decode, ["--tls-client-cert", "c.crt", "--tls-ca", "ca.crt"], "--tls-client-cert and --tls-client-key"),
    (parse_decode, ["--tls-client-cert", "c.crt", "--tls-client-key", "c.key"], "--tls-client-cert needs --tls-ca"),
])
def test_incomplete_mutual_tls_flags_are_refused(parse, argv: list[str], says: str,  # type: ignore[no-untyped-def]
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert says in capsys.readouterr().err
