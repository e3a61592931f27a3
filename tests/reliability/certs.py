"""Self-signed test PKI written at test time: a CA, a server certificate for 127.0.0.1 /
localhost, and a client certificate (mTLS), all signed by the CA."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        # The server certificate may also act as the gateway's client certificate (specsplit up).
        b = b.add_extension(x509.ExtendedKeyUsage([usage, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [usage]), critical=False)
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("specsplit test CA", ca_key, _name("specsplit test CA"), ca_key, ca=True)
    out = {}
    for role, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"specsplit test {role}", key, ca.subject, ca_key, server=server)
        (directory / f"{role}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, directory / f"{role}.key")
        out[role] = (directory / f"{role}.pem", directory / f"{role}.key")
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return Pki(directory / "ca.pem", *out["server"], *out["client"])
