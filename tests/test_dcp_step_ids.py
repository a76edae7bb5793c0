"""Which ``checkpoint_id`` of ``dcp.save``/``dcp.load`` names a step (``parse_step``): anything
else is a directory or not Aegis' id, never a crash or a step the user did not name."""

from __future__ import annotations

import pytest

from aegis.checkpoint.dcp.writer import parse_step


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
