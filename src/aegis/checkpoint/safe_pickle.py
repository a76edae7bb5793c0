"""Unpickling a saved state's skeleton with only the globals a checkpoint may name.

A step's skeleton (``meta.pkl`` on disk, ``slot-<step>.pkl`` in shared memory) is the state
with its tensors taken out. Plain ``pickle`` calls whatever a file names, so anyone who can
write to the checkpoint directory (a volume every pod of the job mounts) could make every rank
that resumes run code. :func:`loads` admits what a state holds besides its tensors (Python's
containers and scalars, ``OrderedDict``, ``defaultdict``, ``deque``, ``Counter``, paths, dates,
``torch.Size``, dtypes, devices and layouts) and what the training allowed with
``torch.serialization.add_safe_globals``, as ``torch.load(weights_only=True)`` does; any other
global raises :class:`UnsafeCheckpointError`, naming it. Saving loads the skeleton it wrote
the same way, so a state that could not be loaded fails at its first save, not at the resume
after a node was lost.

torch is imported when a skeleton is read, not with this module (the saver daemon imports
``store``, which imports this, and never loads torch).
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

from aegis.core.errors import AegisError

_BUILTINS = frozenset(
    {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
     "range", "set", "slice", "str", "tuple"}
)  # fmt: skip
_CLASSES = frozenset(
    {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("datetime", "date"),
        ("datetime", "datetime"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("aegis.checkpoint.layout", "TensorRef"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.serialization", "_get_layout"),  # how torch pickles torch.strided and the like
    }
)


class UnsafeCheckpointError(AegisError, pickle.UnpicklingError):
    """A checkpoint's state names a global that loading it may not call."""

    def __init__(self, qualified: str) -> None:
        short = qualified.rsplit(".", 1)[-1]
        super().__init__(
            f"{qualified} is not allowed in a checkpoint's state (unpickling other globals could "
            f"run code); if you trust it, call torch.serialization.add_safe_globals([{short}]) "
            f"in the training script before it saves or loads"
        )
        self.qualified = qualified


def loads(data: bytes) -> Any:
    """The object pickled in ``data``; :class:`UnsafeCheckpointError` if it names a global
    outside the allowed ones."""
    return _Unpickler(io.BytesIO(data), _user_allowed()).load()


def _user_allowed() -> dict[str, Any]:
    """What the training allowed with ``torch.serialization.add_safe_globals``, by the
    qualified name a pickle names it with."""
    import torch.serialization

    allowed: dict[str, Any] = {}
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            obj, name = entry
            allowed[name] = obj
        else:
            allowed[f"{entry.__module__}.{entry.__qualname__}"] = entry
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, src: io.BytesIO, user: dict[str, Any]) -> None:
        super().__init__(src)
        self._user = user

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in self._user:
            return self._user[qualified]
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if (module, name) in _CLASSES:
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier():
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeCheckpointError(qualified)
