"""The webhook's serving certificate: a CA of its own and a certificate for its Service's DNS
names (``cryptography``, the ``kubernetes`` extra). The API server trusts the CA through the
MutatingWebhookConfiguration's ``caBundle``; nothing else does, so it is made for this one use.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 3650  # the CA lives as long as its certificate: re-run --make-cert to renew


@dataclass(frozen=True, slots=True)
class ServingCert:
    ca_pem: bytes  # the caBundle
    cert_pem: bytes
    key_pem: bytes


def service_names(service: str, namespace: str) -> list[str]:
    """The names the API server may use for ``service`` in ``namespace``."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
            f"{service}.{namespace}.svc.cluster.local"]  # fmt: skip


def make(names: Sequence[str], *, now: datetime.datetime | None = None) -> ServingCert:
    """A fresh CA and a server certificate for ``names`` (DNS names or IP addresses)."""
    if not names:
        raise ValueError("a serving certificate needs at least one name")
    start = (now or datetime.datetime.now(datetime.UTC)) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aegis-webhook-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return ServingCert(ca.public_bytes(pem), cert.public_bytes(pem), key_pem)


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, key_cert_sign=cert_sign, crl_sign=cert_sign,
        content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
