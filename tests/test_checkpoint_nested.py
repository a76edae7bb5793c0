"""The walk over a nested checkpoint state (aegis.checkpoint.nested): no torch needed."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from typing import Any

from aegis.checkpoint import nested

Pair = namedtuple("Pair", "a b")


def test_rebuild_keeps_container_types_and_order_when_leaves_are_replaced() -> None:
    state = OrderedDict(z=[1, (2, 3)], a={"k": 4}, t=())
    out = nested.rebuild(state, lambda leaf, _: leaf * 10)
    assert out == OrderedDict(z=[10, (20, 30)], a={"k": 40}, t=())
    assert type(out) is OrderedDict and list(out) == ["z", "a", "t"]
    assert type(out["z"]) is list and type(out["z"][1]) is tuple


def test_rebuild_keeps_a_named_tuple_whole_when_it_is_a_leaf() -> None:
    seen: list[Any] = []
    pair = Pair(1, [2])
    out = nested.rebuild({"p": pair}, lambda leaf, _: seen.append(leaf) or leaf)
    assert seen == [pair] and out["p"] is pair


def test_rebuild_pairs_each_leaf_with_the_template_value_at_its_place_when_given_one() -> None:
    state = {"w": 1, "l": [2, 3, 4], "t": (5,), "d": {"x": 6}, "n": 7}
    template = {"w": "W", "l": ("L0", "L1"), "t": ["T0", "extra"], "d": "not a dict"}
    pairs: list[tuple[Any, Any]] = []
    nested.rebuild(state, lambda leaf, like: pairs.append((leaf, like)), template)
    assert pairs == [(1, "W"), (2, "L0"), (3, "L1"), (4, None), (5, "T0"), (6, None), (7, None)]


def test_rebuild_gives_none_as_template_everywhere_when_given_none() -> None:
    likes: list[Any] = []
    nested.rebuild([{"a": 1}, (2,)], lambda leaf, like: likes.append(like))
    assert likes == [None, None]


def test_leaves_are_the_leaves_rebuild_visits_in_the_same_order() -> None:
    state = {"b": [1, {"c": 2}, (3, Pair(4, 5))], "a": 6, "e": []}
    visited: list[Any] = []
    nested.rebuild(state, lambda leaf, _: visited.append(leaf))
    assert list(nested.leaves(state)) == visited == [1, 2, 3, Pair(4, 5), 6]
