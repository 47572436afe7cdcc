"""Optional TLS on both servers (--tls-cert/--tls-key), the decode server's --tls-ca towards the
prefill server, and the clients' --tls-ca: a TLS Generate works end to end; plaintext and clients
that don't trust the certificate are refused."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from launcher.process import start_all, stop_all
from tests.servers import ROOT
from tests.test_reliability_fixtures import Server, request, secure_channel

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

x509 = pytest.importorskip("cryptography.x509")


def self_signed(folder: Path, name: str = "localhost") -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[tuple[Server, Server, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(folder)
    ca = cert.read_bytes()
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    prefill = Server("prefill_server", tls, server_logs, tls_ca=ca)
    decode = Server("decode_server", [*tls, "--prefill-addr", prefill.address, "--tls-ca", str(cert)], server_logs,
                    tls_ca=ca)
    start_all([prefill, decode])
    yield decode, prefill, cert
    stop_all([decode, prefill])


def test_tls_generate_end_to_end(tls_pair: tuple[Server, Server, Path]) -> None:
    decode, _, cert = tls_pair
    with secure_channel(decode.address, cert.read_bytes()) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for mode in (decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED):
            replies = list(stub.Generate(request(40, 6, prefill_mode=mode), timeout=30))
            assert [r.index for r in replies] == list(range(6)) and replies[-1].finish_reason == "length"
    proc = subprocess.run([sys.executable, "-m", "client.generate", "--target", decode.address, "--tls-ca", str(cert),
                           "--token-ids", "1,2,3,4", "--max-new-tokens", "3", "--ignore-eos", "--show-ids"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason=length" in proc.stdout


def test_plaintext_and_untrusting_clients_are_refused(tls_pair: tuple[Server, Server, Path],
                                                      tmp_path: Path) -> None:
    decode, prefill, _ = tls_pair
    with grpc.insecure_channel(decode.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(decode_pb2_grpc.DecodeStub(ch).Generate(request(10, 2), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    other, _ = self_signed(tmp_path)  # a different certificate: not the one the server presents
    with secure_channel(decode.address, other.read_bytes()) as ch, pytest.raises(grpc.RpcError) as e:
        list(decode_pb2_grpc.DecodeStub(ch).Generate(request(10, 2), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with grpc.insecure_channel(prefill.address) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillStub(ch).Handshake(prefill_pb2.HandshakeRequest(peer_id="plain"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
