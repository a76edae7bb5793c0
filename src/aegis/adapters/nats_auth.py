"""NATS decentralised auth, minted in Python: an operator, a system account, one application
account with JetStream, and user JWTs scoped to one job (DESIGN section 4).

A JWT is ``base64url(header).base64url(claims).base64url(ed25519 signature by the issuer)``.
The server runs in operator mode with a MEMORY resolver preloaded with both account JWTs.
The master's user may use every subject (and JetStream); a worker's user may only publish on
its own pod's worker subject ``aegis.<namespace>.<job>.<creation>.worker.<pod>`` and subscribe
to its job's master subject ``aegis.<namespace>.<job>.<creation>.master`` and its own inbox
``_INBOX_<namespace>_<job>_<pod>.>``: it can never publish an order, nor report as another pod.
Names follow one rule (``core.model.check_names``: no '.', '*', '>', no '_'), so no job's
subjects or inbox are a prefix of another's.

Orders are signed besides (``Authority.sign_order``, checked by ``order_verifier``) with the
account key: the agent knows its public key as the issuer of its own credentials.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nacl.exceptions
import nacl.signing
import nkeys

from aegis.core.model import POD_NAME_MAX, InvalidNameError, check_names, name_problem
from aegis.wire.tokens import pod_token

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def encode_jwt(claims: dict[str, Any], issuer: nkeys.KeyPair) -> str:
    body = dict(claims)
    body["iss"] = issuer.public_key.decode()
    body.setdefault("iat", int(time.time()))
    body["jti"] = ""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    signature = issuer.sign(signing_input.encode())
    return f"{signing_input}.{_b64(signature)}"


def decode_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (no verification: for tests and diagnostics)."""
    part = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    return claims


# a job's creation id (``new_creation``; "": none). \A and \Z: msgspec searches the pattern, and
# a "$" would let a trailing newline through
CREATION_PATTERN = r"\A(?:[0-9a-f]{8})?\Z"


def new_creation() -> str:
    """A new job's creation id: 8 hex digits, part of its subjects (``job_subject_prefix``)."""
    return secrets.token_hex(4)


def job_subject_prefix(namespace: str, job: str, creation: str = "") -> str:
    """``aegis.<namespace>.<job>.<creation>``: each creation of a name by an ``aegis run`` has
    subjects of its own, so a master cut off from NATS while a new run took its job's name,
    and its pods, never share a subject with the new job's. ``aegis.<namespace>.<job>`` for a
    job with no creation id (submitted to replicas, or created by an older version): hex never
    reads ``worker`` or ``master``. ``ValueError`` for an id of another shape."""
    if re.fullmatch(CREATION_PATTERN, creation) is None:
        raise ValueError(f"not a creation id: {creation[:40]!r}")
    return f"aegis.{namespace}.{job}.{creation}" if creation else f"aegis.{namespace}.{job}"


def worker_subject(prefix: str, pod: str) -> str:
    """Where pod ``pod`` of the job of ``prefix`` reports: ``<prefix>.worker.<pod>``."""
    return f"{prefix}.worker.{pod}"


def pod_inbox_prefix(namespace: str, job: str, pod: str) -> str:
    """``_INBOX_<namespace>_<job>_<pod>``: '_' is in no valid name, so the triple is
    unambiguous and no pod's inbox is a prefix of another's."""
    return f"_INBOX_{namespace}_{job}_{pod}"


def write_secret(path: Path, text: str) -> None:
    """``text`` in ``path``, owner-only (0600) from its first byte and replaced atomically, so
    an existing file of any mode (0644) never holds the secret and a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:  # mkstemp creates it 0600
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_pod_token(directory: Path, job_token: str, namespace: str, job: str, pod: str) -> Path:
    """Pod ``pod``'s own bootstrap secret (``wire.tokens.pod_token``) in
    ``<directory>/.bootstrap-tokens/<pod>`` (0600, the folder 0700): the file its agent's
    ``--token-file`` names. Returns the path."""
    folder = directory / ".bootstrap-tokens"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / pod
    write_secret(path, pod_token(job_token, namespace, job, pod))
    return path


_ORDER_DOMAIN = b"aegis-order\0"  # an order's signature can never pass for a JWT's


def order_verifier(user_jwt: str) -> Callable[[bytes, str], bool] | None:
    """Checks an order's signature against the key that issued ``user_jwt`` (the master's
    account key); None when there are no credentials (a server without auth)."""
    if not user_jwt:
        return None
    issuer = str(decode_claims(user_jwt)["iss"])
    raw = base64.b32decode(issuer + "=" * (-len(issuer) % 8))
    key = nacl.signing.VerifyKey(raw[1:33])

    def verify(payload: bytes, signature: str) -> bool:
        try:
            sig = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
            key.verify(_ORDER_DOMAIN + payload, sig)
        except (nacl.exceptions.BadSignatureError, binascii.Error, ValueError):
            return False
        return True

    return verify


@dataclass(frozen=True, slots=True)
class UserCreds:
    """What a client needs to connect: its JWT and the seed that signs the server's nonce."""

    jwt: str
    seed: bytes
    inbox_prefix: str
    expires_at: float | None

    def jwt_bytes(self) -> bytes:
        return self.jwt.encode()

    def sign_nonce(self, nonce: str) -> bytes:
        return base64.b64encode(nkeys.from_seed(self.seed).sign(nonce.encode()))


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
              "wildcards": True, "conn": -1, "leaf": -1}  # fmt: skip


class Authority:
    """Holds the operator and account keys; mints account and user JWTs."""

    def __init__(
        self, *, app_account_name: str = "AEGIS", seeds: dict[str, bytes] | None = None
    ) -> None:
        def key(name: str, prefix: int) -> nkeys.KeyPair:
            return nkeys.from_seed(seeds[name]) if seeds else new_keypair(prefix)

        self.operator = key("operator", nkeys.PREFIX_BYTE_OPERATOR)
        self.system = key("system", nkeys.PREFIX_BYTE_ACCOUNT)
        self.account = key("account", nkeys.PREFIX_BYTE_ACCOUNT)
        self.operator_jwt = encode_jwt(
            {"sub": _pub(self.operator), "name": "aegis-operator",
             "nats": {"type": "operator", "version": 2,
                      "system_account": _pub(self.system)}},
            self.operator,
        )  # fmt: skip
        self.system_jwt = self._account_jwt(self.system, "SYS", jetstream=False)
        self.account_jwt = self._account_jwt(self.account, app_account_name, jetstream=True)

    def _account_jwt(self, account: nkeys.KeyPair, name: str, *, jetstream: bool) -> str:
        limits: dict[str, Any] = dict(_UNLIMITED)
        if jetstream:
            limits.update(mem_storage=-1, disk_storage=-1, streams=-1, consumer=-1)
        claims = {"sub": _pub(account), "name": name,
                  "nats": {"type": "account", "version": 2, "limits": limits,
                           "default_permissions": {"pub": {}, "sub": {}}}}  # fmt: skip
        return encode_jwt(claims, self.operator)

    def save(self, path: Path) -> None:
        """The keys, for master replicas that must mint the same credentials (mode 0600, written
        atomically: an existing file of another mode is replaced, never written into)."""
        seeds = {"operator": self.operator, "system": self.system, "account": self.account}
        write_secret(
            path, json.dumps({name: bytes(kp.seed).decode() for name, kp in seeds.items()})
        )

    def sign_order(self, payload: bytes) -> str:
        """An order's signature (``order_verifier`` checks it)."""
        return _b64(self.account.sign(_ORDER_DOMAIN + payload))

    @classmethod
    def load(cls, path: Path) -> Authority:
        """The keys ``save`` wrote; ``ValueError``, saying why, for any other file."""
        try:
            raw = msgspec.json.decode(path.read_bytes(), type=dict[str, str])
            if raw:  # (no seeds at all would make new keys)
                return cls(seeds={name: value.encode() for name, value in raw.items()})
            why = "no keys in it"
        except msgspec.DecodeError as exc:
            why = str(exc)
        except KeyError as exc:
            why = f"no key {exc}"
        except nkeys.NkeysError:
            why = "a seed that is no nkey seed"
        raise ValueError(f"not the keys `aegis auth init` writes: {why}")

    def server_config(self) -> str:
        """The operator-mode part of a nats-server config file."""
        return (
            f'operator: "{self.operator_jwt}"\n'
            f'system_account: "{_pub(self.system)}"\n'
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f'  "{_pub(self.account)}": "{self.account_jwt}"\n'
            f'  "{_pub(self.system)}": "{self.system_jwt}"\n'
            "}\n"
        )

    def master_creds(self, ttl_s: float | None = None) -> UserCreds:
        return self._user("aegis-master", None, None, ttl_s, inbox="_INBOX")

    def worker_creds(
        self, namespace: str, job: str, pod: str, ttl_s: float | None, creation: str = ""
    ) -> UserCreds:
        """Bound to one pod: publish its own worker subject only (the master takes a report
        from pod P only on P's subject), subscribe its job's master subject and its own inbox
        only (``InvalidNameError`` for a name outside the rule, ``ValueError`` for a creation
        id of another shape)."""
        check_names(namespace, job)
        if (problem := name_problem("pod", pod, POD_NAME_MAX)) is not None:
            raise InvalidNameError(problem)
        prefix = job_subject_prefix(namespace, job, creation)
        inbox = pod_inbox_prefix(namespace, job, pod)
        pub, sub = [worker_subject(prefix, pod)], [f"{prefix}.master", f"{inbox}.>"]
        return self._user(f"{namespace}/{job}/{pod}", pub, sub, ttl_s, inbox=inbox)

    def _user(
        self,
        name: str,
        pub_allow: list[str] | None,
        sub_allow: list[str] | None,
        ttl_s: float | None,
        *,
        inbox: str,
    ) -> UserCreds:
        user = new_keypair(nkeys.PREFIX_BYTE_USER)
        nats_claims: dict[str, Any] = {"type": "user", "version": 2,
                                       "subs": -1, "data": -1, "payload": -1}  # fmt: skip
        if pub_allow is not None:
            nats_claims["pub"] = {"allow": pub_allow}
        if sub_allow is not None:
            nats_claims["sub"] = {"allow": sub_allow}
        claims: dict[str, Any] = {"sub": _pub(user), "name": name, "nats": nats_claims}
        expires_at = None
        if ttl_s is not None:
            expires_at = time.time() + ttl_s
            claims["exp"] = int(expires_at)
        return UserCreds(
            jwt=encode_jwt(claims, self.account),
            seed=bytes(user.seed),
            inbox_prefix=inbox,
            expires_at=expires_at,
        )


def _pub(kp: nkeys.KeyPair) -> str:
    return str(kp.public_key.decode())
