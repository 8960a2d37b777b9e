"""Optional TLS for the gRPC port: server cert + key; mTLS when a client CA is given.

`--tls-cert`/`--tls-key` (PEM) turn TLS on; both or neither. `--tls-client-ca` (PEM bundle)
additionally requires every client to present a certificate signed by that CA (mTLS).
Files are read once at startup; a missing, unreadable or unparsable file, or a key that is not
the certificate's, is a startup error (grpc's own report of those is a failed bind).
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set: mTLS (client certificates required)

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, client_ca: str | None = None) -> "TlsConfig | None":
        """None when TLS is off; ValueError on a half-given configuration."""
        if not cert and not key:
            if client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (cert and key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        return cls(cert, key, client_ca or None)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert")
        ca = _read(self.client_ca_file, "--tls-client-ca") if self.client_ca_file else None
        self._check_with_openssl()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def _check_with_openssl(self) -> None:
        """What grpc would only report as a port it cannot listen on: the PEMs parse, the key
        is the certificate's, the CA bundle holds certificates."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # judge the files, not their strength: grpc takes weak keys

        def no_passphrase():  # OpenSSL would prompt on a terminal; grpc cannot use an encrypted key
            raise ValueError("the key is encrypted; llmsvc needs an unencrypted key")
        try:
            ctx.load_cert_chain(os.path.expanduser(self.cert_file), os.path.expanduser(self.key_file),
                                password=no_passphrase)
        except (ssl.SSLError, ValueError, OSError) as e:
            raise ValueError(f"--tls-cert {self.cert_file!r} / --tls-key {self.key_file!r}: not a certificate and "
                             f"its private key ({e})") from None
        if self.client_ca_file:
            try:
                ctx.load_verify_locations(cafile=os.path.expanduser(self.client_ca_file))
            except (ssl.SSLError, ValueError, OSError) as e:
                raise ValueError(f"--tls-client-ca {self.client_ca_file!r}: not a PEM bundle of CA certificates "
                                 f"({e})") from None


def _read(path: str, flag: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag}: {path!r} is not a PEM file")
    return data
