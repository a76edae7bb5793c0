"""Unpickling a saved state's skeleton with only the globals a checkpoint may name.

A step's skeleton (``meta.pkl`` on disk, ``slot-<step>.pkl`` in shared memory) is the state
with its tensors taken out. Plain ``pickle`` calls whatever a file names, so anyone who can
write to the checkpoint directory (a volume every pod of the job mounts) could make every rank
that resumes run code. :func:`loads` admits what a state holds besides its tensors (Python's
containers and scalars, ``OrderedDict``, ``defaultdict``, ``deque``, ``Counter``, paths, dates,
``torch.Size``, dtypes, devices and layouts) and what the training allowed with
``torch.serialization.add_safe_globals``, as ``torch.load(weights_only=True)`` does; any other
global raises :class:`UnsafeCheckpointError`, naming it, before anything of it is called.
A pickle can also set attributes on what it is given (BUILD on a class), which would outlive the
load (a path class that opens another file): the classes written in Python that a state only
calls (paths, ``Counter``, torch's layout lookup) are given as functions of the load's own, the
types written in C are immutable, and a class allowed through torch that a load changed is put
back as it was and the load refused. Saving loads the skeleton it wrote the same way, so a
state that could not be loaded fails at its first save, not at the resume after a node was lost.

torch is imported when a skeleton is read, not with this module (the saver daemon imports
``store``, which imports this, and never loads torch).
"""

from __future__ import annotations

import builtins
import functools
import io
import pickle
import types
from typing import Any

from aegis.core.errors import AegisError

_BUILTINS = frozenset(
    {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
     "range", "set", "slice", "str", "tuple"}
)  # fmt: skip
# Types written in C: no load can set an attribute of theirs (BUILD on a global sets them).
_FIXED_TYPES = frozenset(
    {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("datetime", "date"),
        ("datetime", "datetime"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("torch", "Size"),
        ("torch", "device"),
    }
)
# Classes written in Python, which a pickle only calls: each load gets a function of its own
# that makes one, so that what a load sets on it goes with it.
_MADE_BY_CALL = frozenset(
    {
        ("collections", "Counter"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)
_TENSOR_REF = ("aegis.checkpoint.layout", "TensorRef")
_GET_LAYOUT = ("torch.serialization", "_get_layout")  # how torch pickles torch.strided and such
# What a function or a class written in Python holds besides its __dict__; a load that changed
# any of these, or the __dict__, of a global it was given is refused (and undone).
_SLOTS = ("__bases__", "__name__", "__qualname__", "__module__", "__defaults__", "__kwdefaults__")


class UnsafeCheckpointError(AegisError, pickle.UnpicklingError):
    """A checkpoint's state names a global that loading it may not call."""

    def __init__(self, qualified: str, *, changed: bool = False) -> None:
        short = qualified.rsplit(".", 1)[-1]
        super().__init__(
            f"a checkpoint's state may not change {qualified} (undone)"
            if changed
            else f"{qualified} is not allowed in a checkpoint's state (unpickling other globals "
            f"could run code); if you trust it, call "
            f"torch.serialization.add_safe_globals([{short}]) in the training script before it "
            f"saves or loads"
        )
        self.qualified = qualified


def loads(data: bytes) -> Any:
    """The object pickled in ``data``; :class:`UnsafeCheckpointError` if it names a global
    outside the allowed ones, or changes one (a BUILD on a class sets its attributes)."""
    unpickler = _Unpickler(io.BytesIO(data), _user_allowed())
    try:
        return unpickler.load()
    finally:
        unpickler.undo_changes()


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


@functools.cache
def _torch_values() -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's dtypes by their name, and its layouts by ``torch.<name>``, from its module's
    own names (never through ``torch.__getattr__``, which imports on demand)."""
    import torch

    names = dict(vars(torch))
    dtypes = {n: v for n, v in names.items() if isinstance(v, torch.dtype)}
    layouts = {f"torch.{n}": v for n, v in names.items() if isinstance(v, torch.layout)}
    return dtypes, layouts


def _maker(cls: type) -> Any:
    def make(*args: Any) -> Any:
        return cls(*args)

    return make


def _layout_getter() -> Any:
    def get_layout(name: str) -> Any:
        return _torch_values()[1][name]

    return get_layout


class _Unpickler(pickle.Unpickler):
    def __init__(self, src: io.BytesIO, user: dict[str, Any]) -> None:
        super().__init__(src)
        self._user = user
        self._given: dict[int, tuple[str, Any, dict[str, Any]]] = {}  # id -> name, obj, before

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if (module, name) in _FIXED_TYPES:
            return super().find_class(module, name)
        if (module, name) in _MADE_BY_CALL:
            return _maker(super().find_class(module, name))
        if (module, name) == _GET_LAYOUT:
            return _layout_getter()  # one of its own, as for _MADE_BY_CALL
        if module == "torch" and name in _torch_values()[0]:
            return _torch_values()[0][name]
        if (module, name) == _TENSOR_REF:
            return self._watched(qualified, super().find_class(module, name))
        if qualified in self._user:
            return self._watched(qualified, self._user[qualified])
        raise UnsafeCheckpointError(qualified)

    def _watched(self, qualified: str, obj: Any) -> Any:
        if id(obj) not in self._given and _settable(obj):
            self._given[id(obj)] = (qualified, obj, _attributes(obj))
        return obj

    def undo_changes(self) -> None:
        """Put back what the load changed on a global it was given; raise if it changed one."""
        changed = [q for q, obj, before in self._given.values() if _restore(obj, before)]
        if changed:
            raise UnsafeCheckpointError(changed[0], changed=True)


def _settable(obj: Any) -> bool:
    """Whether a BUILD could set attributes of ``obj``: a class or function written in Python
    (a type written in C is immutable; a C function has no attributes to set)."""
    if isinstance(obj, type):
        return not obj.__flags__ & _IMMUTABLE_TYPE
    return isinstance(obj, types.FunctionType)


def _attributes(obj: Any) -> dict[str, Any]:
    attrs = {f"dict:{k}": v for k, v in getattr(obj, "__dict__", {}).items()}
    attrs.update({slot: getattr(obj, slot) for slot in _SLOTS if hasattr(obj, slot)})
    if not isinstance(obj, type) and hasattr(obj, "__dict__"):
        attrs["__dict__"] = obj.__dict__  # a function's: the load may put another in its place
    return attrs


def _restore(obj: Any, before: dict[str, Any]) -> bool:
    """Whether ``obj`` differs from ``before``; each difference undone."""
    now = _attributes(obj)  # compared by identity: never an __eq__ the load may have set
    if now.keys() == before.keys() and all(now[k] is before[k] for k in now):
        return False
    if "__dict__" in before and obj.__dict__ is not before["__dict__"]:
        obj.__dict__ = before["__dict__"]
    own = getattr(obj, "__dict__", {})
    for key in (set(now) | set(before)) - {"__dict__"}:
        attr = key.removeprefix("dict:")
        current = own.get(attr, _GONE) if key.startswith("dict:") else getattr(obj, attr, _GONE)
        if key not in before:
            delattr(obj, attr)
        elif current is not before[key]:
            setattr(obj, attr, before[key])
    return True


_GONE = object()
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE
