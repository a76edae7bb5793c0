"""The bytes of a ``torch.save`` file of one tensor, planned before its data is read (no torch).

DCP's own filesystem format stores each tensor as a ``torch.save`` archive: an uncompressed zip
whose records are the pickled skeleton, a few small text records and ``data/0``, the raw bytes of
the tensor. Everything but the data and its CRC32 depends only on the names and sizes, so the
training side plans the whole file image (offsets and lengths known at once, as DCP's metadata
needs them) and the saver daemon fills in the data and its CRC from shared memory.

:func:`plan` returns the image as pieces: literal bytes, the data, or the 4-byte CRC32 of the
data. Records are aligned to 64 bytes (as ``torch.save`` does, with padding in an ``FB`` extra
field); ZIP64 fields are used where a size or an offset needs them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 64
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, fixed: the image depends on the sizes only
_MAX32 = 0xFFFFFFFF
ZIP64_FROM = _MAX32  # sizes or offsets from here on take ZIP64 fields (tests lower it)
_PAD_ID = 0x4246  # "FB", the padding field torch.save writes


@dataclass(frozen=True, slots=True)
class Literal:
    data: bytes


@dataclass(frozen=True, slots=True)
class Data:
    """The external data (``nbytes`` of it)."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class Crc:
    """The CRC32 of the external data, 4 bytes little-endian."""


Piece = Literal | Data | Crc


@dataclass(frozen=True, slots=True)
class Record:
    name: str
    content: bytes | None  # None: the external data, of ``size`` bytes
    size: int = 0


def plan(archive: str, records: Sequence[Record]) -> list[Piece]:
    """The image of a zip of ``records`` under ``<archive>/``, as pieces in file order."""
    pieces: list[Piece] = []
    central: list[bytes] = []
    pos = 0

    def emit(piece: Piece) -> None:
        nonlocal pos
        if isinstance(piece, Literal) and pieces and isinstance(pieces[-1], Literal):
            pieces[-1] = Literal(pieces[-1].data + piece.data)
        else:
            pieces.append(piece)
        pos += len(piece.data) if isinstance(piece, Literal) else _size(piece)

    for record in records:
        name = f"{archive}/{record.name}".encode()
        size = record.size if record.content is None else len(record.content)
        crc = None if record.content is None else zlib.crc32(record.content)
        offset = pos
        big = size >= ZIP64_FROM or offset >= ZIP64_FROM
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        start = offset + _LOCAL.size + len(name) + len(extra) + 4
        extra += struct.pack("<HH", _PAD_ID, -start % ALIGN) + bytes(-start % ALIGN)
        version = 45 if big else 20
        sized = _MAX32 if big else size
        header = _LOCAL.pack(0x04034B50, version, 0, 0, 0, _DOS_DATE, 0, sized, sized,
                             len(name), len(extra))  # fmt: skip
        if crc is None:
            emit(Literal(header[:14]))
            emit(Crc())
            emit(Literal(header[18:] + name + extra))
            emit(Data(size))
        else:
            emit(Literal(header[:14] + struct.pack("<I", crc) + header[18:] + name + extra))
            emit(Literal(record.content or b""))
        central.append(_central_entry(name, size, offset, crc))
    cd_offset, cd_size = pos, 0
    entries: list[Piece] = []
    for entry, record in zip(central, records, strict=True):
        if record.content is None:  # the CRC of the data goes at bytes 16..20
            entries += [Literal(entry[:16]), Crc(), Literal(entry[20:])]
        else:
            entries.append(Literal(entry))
        cd_size += len(entry)
    for piece in entries:
        emit(piece)
    emit(Literal(_end(len(records), cd_offset, cd_size)))
    return pieces


def _central_entry(name: bytes, size: int, offset: int, crc: int | None) -> bytes:
    big = size >= ZIP64_FROM or offset >= ZIP64_FROM
    extra = struct.pack("<HHQQQ", 1, 24, size, size, offset) if big else b""
    sized, where = (_MAX32, _MAX32) if big else (size, offset)
    version = 45 if big else 20
    fields = (version, version, 0, 0, 0, _DOS_DATE, crc or 0, sized, sized, len(name), len(extra))
    return _CENTRAL.pack(0x02014B50, *fields, 0, 0, 0, 0, where) + name + extra


def _end(count: int, cd_offset: int, cd_size: int) -> bytes:
    if cd_offset + cd_size < ZIP64_FROM and count < 0xFFFF:
        return _EOCD.pack(0x06054B50, 0, 0, count, count, cd_size, cd_offset, 0)
    eocd64_at = cd_offset + cd_size
    return (
        _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        + _LOCATOR64.pack(0x07064B50, 0, eocd64_at, 1)
        + _EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _MAX32, _MAX32, 0)
    )


def _size(piece: Piece) -> int:
    match piece:
        case Literal(data):
            return len(data)
        case Data(nbytes):
            return nbytes
        case Crc():
            return 4


def length(pieces: Sequence[Piece]) -> int:
    return sum(_size(p) for p in pieces)
