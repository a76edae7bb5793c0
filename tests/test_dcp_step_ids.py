"""Which ``checkpoint_id`` of ``dcp.save``/``dcp.load`` names a step (``parse_step``): anything
else is a directory or not Aegis' id, never a crash or a step the user did not name."""

from __future__ import annotations

import pytest

from aegis.checkpoint.dcp.reader import Reader
from aegis.checkpoint.dcp.writer import checked_id, parse_step


@pytest.mark.parametrize(
    ("checkpoint_id", "step"),
    [
        (0, 0),
        (120, 120),
        ("120", 120),
        ("0007", 7),
        (-3, None),  # no step is negative
        (True, None),  # a bool is an int to Python, not a step to a user
        (False, None),
        ("²", None),  # str.isdigit() says yes, int() raises
        ("٣", None),  # other scripts' digits: a directory name, not a step
        ("12a", None),
        ("", None),
        ("/ckpt/step-12", None),
        (None, None),
        (1.0, None),
    ],
)
def test_parse_step(checkpoint_id: object, step: int | None) -> None:
    assert parse_step(checkpoint_id) == step


@pytest.mark.parametrize("checkpoint_id", [-3, True, False])
def test_an_int_that_names_no_step_is_refused_with_a_clear_error(checkpoint_id: object) -> None:
    """Not taken for a directory's name (DCP's ``Path(True)`` raises a ``TypeError``)."""
    with pytest.raises(ValueError, match="a step is an int of 0 or more"):
        checked_id(checkpoint_id)
    with pytest.raises(ValueError, match="a step is an int of 0 or more"):
        Reader(environ={}).reset(checkpoint_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpoint_id", [None, 0, 12, "12", "/ckpt/here", "²"])
def test_a_step_a_directory_or_none_is_taken_as_given(checkpoint_id: object) -> None:
    assert checked_id(checkpoint_id) == checkpoint_id
