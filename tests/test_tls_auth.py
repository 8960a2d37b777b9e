"""TLS, mTLS and bearer-token auth on a live server (fake-executor engine, loopback).
Certificates are made here with `cryptography` (CN/SAN localhost + 127.0.0.1)."""
from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmsvc.server import cli
from llmsvc.server.auth import BearerTokenInterceptor, load_tokens
from llmsvc.server.tls import TlsConfig
from llmsvc.v1 import llmsvc_pb2 as pb
from llmsvc.v1 import llmsvc_pb2_grpc as pb_grpc
from tests.server_harness import ServerThread, fake_engine_factory
from tests.test_metrics import grpc_count, scrape

SERVING = health_pb2.HealthCheckResponse.SERVING


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key=None, cert=None) -> bytes:
    from cryptography.hazmat.primitives import serialization
    if cert is not None:
        return cert.public_bytes(serialization.Encoding.PEM)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(cn: str, key, issuer_cn: str, issuer_key, *, ca: bool, server: bool = False, client: bool = False,
          dns_only: str | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        names = ([x509.DNSName(dns_only)] if dns_only else
                 [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


class Pki:
    """A CA, a server cert (localhost / 127.0.0.1) and a client cert it signed; plus an unrelated CA."""

    def __init__(self, tmp_path) -> None:
        ca_key, srv_key, cli_key, other_key = _key(), _key(), _key(), _key()
        ca = _cert("llmsvc test CA", ca_key, "llmsvc test CA", ca_key, ca=True)
        other = _cert("another CA", other_key, "another CA", other_key, ca=True)
        srv = _cert("localhost", srv_key, "llmsvc test CA", ca_key, ca=False, server=True)
        client = _cert("client", cli_key, "llmsvc test CA", ca_key, ca=False, client=True)
        named = _cert("llmsvc.internal", srv_key, "llmsvc test CA", ca_key, ca=False, server=True,
                      dns_only="llmsvc.internal")  # a DNS name only: 127.0.0.1 does not match it
        self.ca, self.other_ca = _pem(cert=ca), _pem(cert=other)
        self.client_cert, self.client_key = _pem(cert=client), _pem(cli_key)
        self.files = {}
        for name, data in (("ca.pem", self.ca), ("server.pem", _pem(cert=srv)), ("server.key", _pem(srv_key)),
                           ("named.pem", _pem(cert=named))):
            path = tmp_path / name
            path.write_bytes(data)
            self.files[name] = str(path)

    def tls(self, mutual: bool = False) -> TlsConfig:
        return TlsConfig(self.files["server.pem"], self.files["server.key"],
                         self.files["ca.pem"] if mutual else None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _info(channel, metadata=None) -> pb.GetServerInfoResponse:
    return pb_grpc.LlmServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=metadata)


def _secure(address: str, creds: grpc.ChannelCredentials) -> grpc.Channel:
    return grpc.secure_channel(address, creds)


def test_tls_client_needs_the_right_ca(pki):
    s = ServerThread(fake_engine_factory(), load=False, tls=pki.tls())
    try:
        with _secure(s.address, grpc.ssl_channel_credentials(root_certificates=pki.ca)) as ch:
            assert _health(ch) == SERVING
            assert _info(ch).api_version == "llmsvc.v1"
        with _secure(f"localhost:{s.port}", grpc.ssl_channel_credentials(root_certificates=pki.ca)) as ch:
            assert _health(ch) == SERVING  # the DNS SAN works too
        for roots in (pki.other_ca, None):  # a CA that did not sign it / the system roots
            with _secure(s.address, grpc.ssl_channel_credentials(root_certificates=roots)) as ch:
                with pytest.raises(grpc.RpcError) as ei:
                    _health(ch)
                assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(s.address) as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError):
                _health(ch)
        from llmsvc.__main__ import main  # the container healthcheck probe, over TLS
        assert main(["health", "--server", s.address, "--tls-ca", pki.files["ca.pem"]]) == 0
        assert main(["health", "--server", s.address, "--timeout", "2"]) == 2  # plaintext: the check fails
    finally:
        s.stop()


def test_health_probe_names_the_certificates_server_when_it_dials_an_address(pki):
    # in a container the probe dials 127.0.0.1; a certificate naming only the service's DNS
    # name fails hostname verification unless the probe says which name to expect
    s = ServerThread(fake_engine_factory(), load=False,
                     tls=TlsConfig(pki.files["named.pem"], pki.files["server.key"], None))
    try:
        from llmsvc.__main__ import main
        probe = ["health", "--server", s.address, "--tls-ca", pki.files["ca.pem"], "--timeout", "5"]
        assert main(probe) == 2
        assert main([*probe, "--tls-server-name", "llmsvc.internal"]) == 0
    finally:
        s.stop()


def test_mtls_rejects_a_client_without_a_cert(pki):
    s = ServerThread(fake_engine_factory(), load=False, tls=pki.tls(mutual=True))
    try:
        with_cert = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_cert)
        with _secure(s.address, with_cert) as ch:
            assert _health(ch) == SERVING
        with _secure(s.address, grpc.ssl_channel_credentials(root_certificates=pki.ca)) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                _health(ch)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        from llmsvc.__main__ import main  # the container probe presents a client cert under mTLS
        cert, key = pki.files["ca.pem"].replace("ca.pem", "client.pem"), pki.files["ca.pem"].replace("ca.pem", "client.key")
        open(cert, "wb").write(pki.client_cert)
        open(key, "wb").write(pki.client_key)
        tls = ["--tls-ca", pki.files["ca.pem"]]
        assert main(["health", "--server", s.address, *tls, "--tls-cert", cert, "--tls-key", key]) == 0
        assert main(["health", "--server", s.address, "--timeout", "2", *tls]) == 2
    finally:
        s.stop()


def test_bearer_token_auth_with_open_health(pki):
    s = ServerThread(fake_engine_factory(), tls=pki.tls(), auth_tokens=["good-token", "second"], metrics_port=0)
    try:
        with _secure(s.address, grpc.ssl_channel_credentials(root_certificates=pki.ca)) as ch:
            stub = pb_grpc.LlmServiceStub(ch)
            req = pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_tokens=3))
            for md in (None, (("authorization", "Bearer wrong"),), (("authorization", "good-token"),),
                       (("authorization", "Bearer good-token-and-more"),), (("authorization", "Basic Z29vZA=="),)):
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Generate(req, metadata=md, timeout=10))
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
                with pytest.raises(grpc.RpcError) as ei:
                    _info(ch, md)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            trailers = dict(ei.value.trailing_metadata())
            assert trailers.get("www-authenticate") == "Bearer" and "grpc-status-details-bin" in trailers
            for token in ("good-token", "second"):
                out = list(stub.Generate(req, metadata=(("authorization", f"Bearer {token}"),), timeout=10))
                assert out[-1].num_output_tokens == 3
            assert _health(ch) == SERVING  # probes need no token
            reflection = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
            assert list(reflection(iter([]), timeout=5)) == []
        samples = scrape(s.server.metrics_port)
        assert grpc_count(samples, "UNAUTHENTICATED") == 5 and grpc_count(samples, "OK") == 2
    finally:
        s.stop()


def test_client_library_token_roundtrip():
    from llmsvc.client.client import Client
    from llmsvc.client.errors import Unauthenticated
    s = ServerThread(fake_engine_factory(), auth_tokens=["t0k"])
    try:
        with Client(s.address, token="t0k") as c:
            assert c.health() == "SERVING"
            assert c.server_info().api_version == "llmsvc.v1"
        with Client(s.address) as c:
            assert c.health() == "SERVING"
            with pytest.raises(Unauthenticated):
                c.server_info()
    finally:
        s.stop()


def test_load_tokens_and_cli_security_options(tmp_path, monkeypatch):
    f = tmp_path / "tokens"
    f.write_text("# comment\nalpha\n\n  beta  \nalpha\n")
    assert load_tokens(str(f), "gamma, delta,,") == ["alpha", "beta", "gamma", "delta"]
    assert load_tokens(None, None) == []
    (tmp_path / "empty").write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="--auth-token-file: .* holds no tokens"):
        load_tokens(str(tmp_path / "empty"))
    # a missing file names the flag, as an unreadable TLS file does
    with pytest.raises(ValueError, match="--admin-token-file: cannot read .*nope.*No such file"):
        load_tokens(str(tmp_path / "nope"), flag="--admin-token-file")
    i = BearerTokenInterceptor(["alpha"])
    assert i.check((("authorization", "Bearer alpha"),)) is None
    assert i.check((("authorization", "bearer   alpha "),)) is None
    assert i.check(()) and i.check((("authorization", "Bearer alph"),)) and i.check((("authorization", "alpha"),))

    import argparse
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    monkeypatch.setenv("LLMSVC_AUTH_TOKENS", "from-env")
    opts = cli.security_options(p.parse_args(["--auth-token-file", str(f)]))
    assert opts["tls"] is None and opts["auth_tokens"] == ["alpha", "beta", "from-env"]
    monkeypatch.delenv("LLMSVC_AUTH_TOKENS")
    assert cli.security_options(p.parse_args([])) == {"tls": None, "auth_tokens": None, "admin_tokens": None}
    monkeypatch.setenv("LLMSVC_ADMIN_TOKENS", "root-env")
    opts = cli.security_options(p.parse_args(["--admin-token-file", str(f)]))
    assert opts["admin_tokens"] == ["alpha", "beta", "root-env"] and opts["auth_tokens"] is None
    monkeypatch.delenv("LLMSVC_ADMIN_TOKENS")
    with pytest.raises(ValueError):
        cli.security_options(p.parse_args(["--tls-cert", "x.pem"]))  # no key
    with pytest.raises(ValueError):
        cli.security_options(p.parse_args(["--tls-cert", str(f), "--tls-key", str(f)]))  # not PEM


def test_cli_exits_2_on_bad_tls_config(tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "k"),
                         "--port", "0", "--host", "127.0.0.1"])
    assert cli.main(args) == 2


def test_a_key_that_is_not_the_certificates_is_a_configuration_error(pki, tmp_path):
    # grpc reports a mismatched key or a garbage CA only as a port it cannot listen on (exit 1)
    import argparse
    f = pki.files
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    for cert, key, ca, says in ((f["server.pem"], f["ca.pem"], None, "its private key"),  # a cert as the key
                                (f["server.key"], f["server.pem"], None, "its private key"),  # swapped
                                (f["server.pem"], f["server.key"], str(garbage), "--tls-client-ca")):
        with pytest.raises(ValueError, match=says):
            TlsConfig(cert, key, ca).server_credentials()
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        args = ["--tls-cert", cert, "--tls-key", key, "--port", "0", "--host", "127.0.0.1"]
        assert cli.main(p.parse_args(args + (["--tls-client-ca", ca] if ca else []))) == 2
    TlsConfig(f["server.pem"], f["server.key"], f["ca.pem"]).server_credentials()  # the right ones pass
    # strength is grpc's business: a 1024-bit key it accepts passes; an encrypted key is refused
    # at once (OpenSSL would prompt for its passphrase on a terminal)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    (tmp_path / "weak.pem").write_bytes(_pem(cert=_cert("localhost", weak, "localhost", weak, ca=False, server=True)))
    (tmp_path / "weak.key").write_bytes(_pem(weak))
    (tmp_path / "enc.key").write_bytes(weak.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.BestAvailableEncryption(b"pw")))
    TlsConfig(str(tmp_path / "weak.pem"), str(tmp_path / "weak.key")).server_credentials()
    with pytest.raises(ValueError, match="encrypted"):
        TlsConfig(str(tmp_path / "weak.pem"), str(tmp_path / "enc.key")).server_credentials()


def test_json_logs_stay_json_when_a_plaintext_probe_hits_a_tls_port(pki, tmp_path):
    # gRPC's C core logged each failed handshake as its own (non-JSON) stderr line
    import json
    import subprocess
    import sys

    from tests.server_harness import make_tiny_served_model_dir
    from tests.test_shutdown import ServeProcess
    srv = ServeProcess(make_tiny_served_model_dir(tmp_path), "--log-format", "json",
                       "--tls-cert", pki.files["server.pem"], "--tls-key", pki.files["server.key"])
    try:
        probe = subprocess.run([sys.executable, "-m", "llmsvc", "health", "--server", f"127.0.0.1:{srv._port}",
                                "--timeout", "2"], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 2
    finally:
        srv.proc.terminate()
        srv.proc.wait(60)
        srv.close()
    lines = [line for line in srv.lines if line.strip()]
    assert lines and all(json.loads(line) for line in lines), [x for x in lines if not x.startswith("{")][:3]
