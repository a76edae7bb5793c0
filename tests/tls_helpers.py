"""A throwaway CA and certificates for tests, made with the ``openssl`` command line (the
``cryptography`` package is not a dependency). A directory per certificate, named as a
Kubernetes TLS Secret (cert-manager) mounts them: ``tls.crt``, ``tls.key``, ``ca.crt``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def need_openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        pytest.skip("the openssl command line is needed to make a test CA")
    return found


def _openssl(*args: str) -> None:
    subprocess.run([need_openssl(), *args], check=True, capture_output=True, timeout=60)


def make_ca(root: Path, name: str = "test-ca") -> Path:
    """A self-signed CA in ``root/<name>/`` (``ca.crt``, ``ca.key``); returns that directory."""
    out = root / name
    out.mkdir(parents=True)
    _openssl("req", "-x509", *_EC, "-keyout", str(out / "ca.key"), "-out", str(out / "ca.crt"),
             "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    return out


def issue(ca: Path, out: Path, names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:
    """A server certificate for ``names`` (IP addresses or DNS names) signed by ``ca``, in
    ``out/`` as ``tls.crt``, ``tls.key`` and ``ca.crt``; returns ``out``."""
    out.mkdir(parents=True)
    sans = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in names)
    ext = out / "ext.cnf"
    ext.write_text(
        f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl("req", *_EC, "-keyout", str(out / "tls.key"), "-out", str(out / "tls.csr"),
             "-subj", f"/CN={names[0]}")  # fmt: skip
    _openssl("x509", "-req", "-in", str(out / "tls.csr"), "-CA", str(ca / "ca.crt"),
             "-CAkey", str(ca / "ca.key"), "-CAcreateserial", "-out", str(out / "tls.crt"),
             "-days", "2", "-extfile", str(ext))  # fmt: skip
    shutil.copyfile(ca / "ca.crt", out / "ca.crt")
    return out
