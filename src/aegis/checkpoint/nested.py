"""The walk over a nested state that a checkpoint saves and loads (no torch).

A state is nested in dicts, lists and tuples; anything else is a leaf: a tensor, a number, a
:class:`aegis.checkpoint.layout.TensorRef` in a skeleton, and a named tuple, kept whole (its
fields are not walked: it is pickled as it is).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def rebuild(value: Any, leaf: Callable[[Any, Any], Any], template: Any = None) -> Any:
    """``value`` with each leaf ``x`` replaced by ``leaf(x, t)``, ``t`` the ``template``'s value at
    the same place (the same key of a dict, the same index of a list or tuple), None where the
    template has none. Each container is rebuilt with its own type, in its own order."""
    if isinstance(value, dict):
        sub = template if isinstance(template, dict) else {}
        return type(value)((k, rebuild(v, leaf, sub.get(k))) for k, v in value.items())
    if _is_sequence(value):
        subs = list(template) if isinstance(template, list | tuple) else []
        subs += [None] * (len(value) - len(subs))
        return type(value)(rebuild(v, leaf, t) for v, t in zip(value, subs, strict=False))
    return leaf(value, template)


def leaves(value: Any) -> Iterator[Any]:
    """The leaves of ``value``, in the order :func:`rebuild` visits them."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif _is_sequence(value):
        for v in value:
            yield from leaves(v)
    else:
        yield value


def _is_sequence(value: Any) -> bool:
    return isinstance(value, list | tuple) and not hasattr(value, "_fields")
