"""Strict decoding: a malformed, oversized or wrong-typed message raises one ``WireError``."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from aegis.core.errors import RemoteError
from aegis.wire.messages import PAYLOAD_FOR_TYPE, Message

MAX_MESSAGE_BYTES = 256 * 1024

_decoder = msgspec.json.Decoder(Message)
_encoder = msgspec.json.Encoder()


class WireError(RemoteError):
    """A message that cannot be accepted. ``reason`` is a short label for counting."""


def decode(raw: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    if len(raw) > max_bytes:
        raise WireError("oversized", detail=f"{len(raw)} bytes > {max_bytes}")
    try:
        msg = _decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise WireError("schema", detail=str(exc)) from None
    except msgspec.DecodeError as exc:
        raise WireError("malformed", detail=str(exc)) from None
    if not isinstance(msg.data, PAYLOAD_FOR_TYPE[msg.type]):
        kind = type(msg.data).__struct_config__.tag
        raise WireError("schema", detail=f"{msg.type} cannot carry data of kind {kind!r}")
    return msg


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def signed_part(msg: Message) -> bytes:
    """What an order's signature covers: the message encoded without its signature (decoding
    and encoding again gives the same bytes, so the receiver computes it too)."""
    return _encoder.encode(msgspec.structs.replace(msg, sig=""))


def encode_signed(msg: Message, sign: Callable[[bytes], str] | None) -> bytes:
    """``msg`` with its signature (``sign`` None: unsigned, a server without auth)."""
    if sign is None:
        return encode(msg)
    return encode(msgspec.structs.replace(msg, sig=sign(signed_part(msg))))
