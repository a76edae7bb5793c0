"""Log signature scanner: classify known faults in the training output, line by line.

The patterns are data (:data:`DEFAULT_SIGNATURES`); a TOML file adds more, checked first::

    [[signature]]
    name = "lustre_eio"
    fault_class = "io_error"
    pattern = "LustreError: .* rc = -5"

A Python traceback is followed across lines: its match carries the exception line and, as detail,
the last ``File ...`` frame line.

Several ranks in one command (``torchrun --nproc-per-node N``): each match is attributed to the
rank whose line it is (torch's ``[rank1]: `` prefix, or the entry of torchrun's failure report it
sits in). When torchrun names the root cause (its first observed failure) and that rank's own
lines matched, what the other ranks show when a peer dies (:data:`CONSEQUENCES`: their broken
connections, their SIGTERM from torchrun, their tracebacks, their collective timeouts) is not
evidence: one rank's plain exception stays a software fault (restarted at once) rather than a
``connection`` fault from its peers' sockets (the checks first). Whatever else they show counts.
torchrun names the first worker it saw exit, and a rank slow to exit (a loaded host) loses that
race to the peer its exception broke. So when the first exception any rank raised was a plain
one, and torchrun named another rank, that first rank is the root cause
(:func:`first_raise_evidence`).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

import msgspec

from aegis.agent import ports
from aegis.core import errors
from aegis.core.recovery import FaultClass, fault_rank

FC = FaultClass


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    name: str
    fault_class: str
    pattern: re.Pattern[str]


# How much of a line the patterns search: the first 4 KiB (what a fault says comes early). A line
# can be one of the pump's 64 KiB pieces, and the scan runs on the agent's event loop: a pattern
# with a gap (``a.*b``, a file's too) backtracks over every start, quadratic in what it searches.
# The defaults bound their gaps (``.{0,200}``) as well.
SCAN_CHARS = 4096


def _sig(name: str, fault_class: str, pattern: str) -> Signature:
    return Signature(name, fault_class, re.compile(pattern))


# Order matters: the first signature that matches a line classifies it (most specific first).
DEFAULT_SIGNATURES: tuple[Signature, ...] = (
    _sig("nvrm_xid", FC.GPU_XID, r"NVRM: Xid \(|\bXid\b.{0,200}\b(?:79|48|63|64|74|94|95)\b,"),
    _sig("fallen_off_bus", FC.GPU_XID, r"fallen off the bus"),
    _sig("ecc", FC.GPU_ECC, r"(?i)uncorrectable ECC error|ECC_UNCORRECTABLE|double bit error"),
    _sig("cuda_oom", FC.CUDA_OOM, r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError"),
    _sig(
        "nccl_watchdog",
        FC.NCCL_TIMEOUT,
        r"Watchdog caught collective operation timeout|NCCL watchdog thread terminated"
        r"|NCCL communicator was aborted|NCCL.{0,200}timed out",
    ),
    _sig(
        "nccl_error",
        FC.NCCL_ERROR,
        r"NCCL error|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|ncclRemoteError"
        r"|NCCL WARN",
    ),
    _sig(
        "cuda_error", FC.CUDA_ERROR, r"CUDA error: |cudaError\w+|CUDA_ERROR_\w+|CUBLAS_STATUS_\w+"
    ),
    _sig(
        "host_oom",
        FC.HOST_OOM,
        r"Out of memory: Kill(?:ed)? process|oom-kill|\bMemoryError\b|Cannot allocate memory",
    ),
    _sig(
        "io_error",
        FC.IO_ERROR,
        r"Input/output error|No space left on device|Stale file handle|Disk quota exceeded"
        r"|Read-only file system|\b(?:EIO|ENOSPC|ESTALE|EDQUOT|EROFS)\b",
    ),
    _sig(
        "connection",
        FC.CONNECTION,
        r"Connection reset by peer|Connection refused|ConnectionResetError|ConnectionRefusedError"
        r"|Connection closed by peer|Broken pipe"
        # a collective that timed out or failed underneath (gloo, c10d): a peer or the network
        r"|Timed out waiting \d+ms for (?:recv|send) operation|DistBackendError|DistNetworkError"
        r"|DistStoreError|\bDistError\b",
    ),
    _sig(
        "segfault",
        FC.SEGFAULT,
        r"Segmentation fault|SIGSEGV|Fatal Python error: Segmentation|Signal 11 \(SIGSEGV\)",
    ),
    # a launcher (torchrun) reporting that a worker was killed by a signal (the OOM killer, ...)
    _sig("killed", FC.KILLED, r"Signal \d+ \(SIG\w+\) received by PID|exitcode\s*: -\d+"),
)


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    fault_class: str
    pattern: str


class _File(msgspec.Struct, forbid_unknown_fields=True):
    signature: list[_Entry] = msgspec.field(default_factory=list)


class SignatureConfigError(errors.RemoteError):
    """A signature file that cannot be read, decoded or compiled."""


def load(path: Path) -> tuple[Signature, ...]:
    """The signatures of a TOML file followed by the defaults."""
    try:
        decoded = msgspec.toml.decode(path.read_bytes(), type=_File)
    except OSError as exc:
        raise SignatureConfigError("cannot read signature file", detail=f"{path}: {exc}") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # not TOML, or not our schema
        raise SignatureConfigError("bad signature file", detail=f"{path}: {exc}") from exc
    extra = []
    for entry in decoded.signature:
        try:
            extra.append(_sig(entry.name, entry.fault_class, entry.pattern))
        except re.error as exc:
            raise SignatureConfigError("bad pattern", detail=f"{entry.name}: {exc}") from exc
    return (*extra, *DEFAULT_SIGNATURES)


_FRAME = re.compile(r'^\s+File "')
_TRACEBACK_START = "Traceback (most recent call last):"
# torch.distributed prefixes an uncaught exception's lines with the rank ("[rank1]: ").
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ")
# torchrun's failure report: an entry ("[0]:") per failed worker naming its rank, the first
# observed failure under "Root Cause", between rules of dashes or equal signs.
_ROOT_CAUSE = "Root Cause (first observed failure):"
_REPORT_ENTRY = re.compile(r"^\[\d+\]:\s*$")
_REPORT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")
_REPORT_RULE = re.compile(r"^(?:-{20,}|={20,})\s*$")
# What a rank shows when a peer dies: not evidence of its own once the root cause is known.
CONSEQUENCES = frozenset({FC.CONNECTION, FC.KILLED, FC.PYTHON_TRACEBACK, FC.NCCL_TIMEOUT})


@dataclasses.dataclass(slots=True)
class _Report:
    """Where the scanner is in torchrun's failure report."""

    entry_rank: int | None = None  # the rank of the entry being read
    in_root: bool = False
    root: int | None = None  # the rank of the newest report's root cause

    def attribute(self, line: str) -> int | None:
        """The rank ``line`` belongs to, if any (and follow the report)."""
        prefixed = _RANK_PREFIX.match(line)
        if prefixed:
            return int(prefixed.group(1))
        if line.startswith(_ROOT_CAUSE):
            self.in_root, self.entry_rank = True, None
        elif _REPORT_RULE.match(line) or _REPORT_ENTRY.match(line):
            self.entry_rank = None
            self.in_root = self.in_root and not line.startswith("=")
        elif ranked := _REPORT_RANK.match(line):
            self.entry_rank = int(ranked.group(1))
            if self.in_root:
                self.root = self.entry_rank
        return self.entry_rank


def root_cause_evidence(
    matches: Iterable[tuple[ports.SignatureMatch, int | None]], root: int | None
) -> list[ports.SignatureMatch]:
    """The matches that are evidence, given torchrun's root-cause rank: all of them, unless the
    root cause's own lines matched; then not what the other ranks show when a peer dies."""
    attributed = list(matches)
    if root is None or not any(rank == root for _, rank in attributed):
        return [m for m, _ in attributed]
    return [m for m, rank in attributed
            if rank in (None, root) or m.fault_class not in CONSEQUENCES]  # fmt: skip


def first_raise_evidence(
    matches: Iterable[tuple[ports.SignatureMatch, int | None]], first: int
) -> list[ports.SignatureMatch]:
    """Rank ``first`` raised a plain exception before any other rank raised anything: its
    traceback is the evidence, with whatever is no consequence of a dead peer (its own kill
    by torchrun, the peers' broken connections and torchrun's own traceback are)."""
    return [m for m, rank in matches
            if m.fault_class not in CONSEQUENCES
            or (rank == first and m.fault_class == FC.PYTHON_TRACEBACK)]  # fmt: skip


@dataclasses.dataclass(slots=True)
class _TracebackState:
    open: bool = False
    last_frame: str = ""


class Scanner:
    """Feeds on output lines; keeps the last lines and the matches as evidence."""

    def __init__(
        self,
        signatures: tuple[Signature, ...] = DEFAULT_SIGNATURES,
        *,
        keep_lines: int = 50,
        max_matches: int = 50,
    ) -> None:
        self._signatures = signatures
        self._last: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._matches: collections.deque[tuple[ports.SignatureMatch, int | None]] = (
            collections.deque(maxlen=max_matches)
        )
        self._tracebacks: dict[tuple[str, int | None], _TracebackState] = {}
        self._report = _Report()
        self._first_raise: tuple[int, bool] | None = None  # (rank, a plain exception)

    def feed(self, stream: str, line: str) -> tuple[ports.SignatureMatch, ...]:
        """Record one line (without its newline); return what it matched."""
        self._last.append(line)
        rank = self._report.attribute(line)
        found: list[ports.SignatureMatch] = []
        head = line[:SCAN_CHARS]
        for signature in self._signatures:
            if signature.pattern.search(head):
                found.append(
                    ports.SignatureMatch(signature.fault_class, signature.name, stream, line)
                )
                break
        traceback = self._follow_traceback(stream, line, rank)
        if traceback is not None:
            if rank is not None and self._first_raise is None:  # plain: nothing else matched
                self._first_raise = (rank, not found)
            found.append(traceback)
        self._matches.extend((match, rank) for match in found)
        return tuple(found)

    def _follow_traceback(
        self, stream: str, line: str, rank: int | None
    ) -> ports.SignatureMatch | None:
        state = self._tracebacks.setdefault((stream, rank), _TracebackState())
        line = _RANK_PREFIX.sub("", line, count=1)
        if line.startswith(_TRACEBACK_START):
            state.open, state.last_frame = True, ""
            return None
        if not state.open:
            return None
        if _FRAME.match(line):
            state.last_frame = line.strip()
            return None
        if not line or line[0].isspace():
            return None  # source line, caret line, or a blank between chained tracebacks
        state.open = False
        return ports.SignatureMatch(
            FC.PYTHON_TRACEBACK, "python_traceback", stream, line, detail=state.last_frame
        )

    def evidence(self, *, fallback_class: str | None = None) -> ports.Evidence:
        root, first = self._report.root, self._first_raise
        if root is not None and first is not None and first[1] and first[0] != root:
            matches = tuple(first_raise_evidence(self._matches, first[0]))
        else:
            matches = tuple(root_cause_evidence(self._matches, root))
        classes = [m.fault_class for m in matches]
        if fallback_class is not None:
            classes.append(fallback_class)
        best = min(classes, key=fault_rank, default=None)
        return ports.Evidence(fault_class=best, matches=matches, last_lines=tuple(self._last))
