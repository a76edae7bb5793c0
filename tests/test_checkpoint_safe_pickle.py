"""A checkpoint's skeleton is unpickled with only the globals a state may name: what a training
state holds loads as it was, anything that could run code is refused by name before it is
called, and a class the training allowed with torch.serialization loads."""

from __future__ import annotations

import collections
import datetime
import decimal
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import pytest
import torch

from aegis.checkpoint import layout as lay
from aegis.checkpoint import safe_pickle


@dataclass(frozen=True)
class Tag:  # a class of the training's own
    name: str


class Reduces:
    """Pickles as a call of ``target(*args)``: what a hostile file would hold."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.target, self.args = target, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.target, self.args


def test_what_a_training_state_holds_loads_as_it_was_when_unpickled() -> None:
    sd = torch.nn.Linear(2, 2).state_dict()
    skeleton = collections.OrderedDict((k, lay.TensorRef(i)) for i, k in enumerate(sd))
    skeleton._metadata = sd._metadata  # type: ignore[attr-defined]  # as state_dict() has it
    state = {
        "model": skeleton,
        "opt": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
        "scalars": [None, True, 3, 2.5, 1 + 2j, "s", b"b", bytearray(b"ba")],
        "sets": ({1, 2}, frozenset({3})),
        "counts": collections.Counter("aab"),
        "groups": collections.defaultdict(list, {"a": [1]}),
        "recent": collections.deque([1, 2], maxlen=5),
        "where": (Path("/data/x"), PurePosixPath("rel/y")),
        "when": (datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC), datetime.date(2026, 1, 2)),
        "delay": datetime.timedelta(seconds=5),
        "torch": (torch.Size([2, 3]), torch.bfloat16, torch.device("cpu"), torch.strided),
        "ranges": (range(0, 10, 2), slice(1, None)),
        "rng": __import__("random").Random(5).getstate(),
    }
    for protocol in (4, 5):  # the saver writes 5
        got = safe_pickle.loads(pickle.dumps(state, protocol=protocol))
        assert got == state, protocol
        assert got["model"]._metadata == sd._metadata  # type: ignore[attr-defined]
        assert type(got["groups"]) is collections.defaultdict and got["groups"]["new"] == []


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (lambda p: Reduces(os.mkdir, str(p)), "posix.mkdir"),
        (lambda p: Reduces(eval, f"__import__('os').mkdir({str(p)!r})"), "builtins.eval"),
        (lambda p: Reduces(getattr, Path, "cwd"), "builtins.getattr"),
        (lambda p: Reduces(torch.save, {}, str(p)), "torch.serialization.save"),
        (lambda p: [1, {"deep": (Reduces(os.mkdir, str(p)),)}], "posix.mkdir"),
    ],
)
def test_a_global_that_could_run_code_is_refused_by_name_and_never_called(
    tmp_path: Path, payload: Any, named: str
) -> None:
    made = tmp_path / "made"
    data = pickle.dumps(payload(made), protocol=5)
    with pytest.raises(safe_pickle.UnsafeCheckpointError) as err:
        safe_pickle.loads(data)
    assert err.value.qualified == named
    assert f"{named} is not allowed" in str(err.value)
    assert "torch.serialization.add_safe_globals" in str(err.value)
    assert not made.exists()
    assert isinstance(err.value, pickle.UnpicklingError)  # what a caller of pickle expects


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (b"ctorch\nload\n.", "torch.load"),  # a torch name that is no dtype
        (b"ccollections\nOrderedDict.fromkeys\n.", "collections.OrderedDict.fromkeys"),
        (b"ccopyreg\n_reconstructor\n.", "copyreg._reconstructor"),
        (b"cbuiltins\n__import__\n.", "builtins.__import__"),
    ],
)
def test_a_global_written_by_hand_is_refused_when_not_a_state_type(data: bytes, named: str) -> None:
    with pytest.raises(safe_pickle.UnsafeCheckpointError, match=re.escape(named)):
        safe_pickle.loads(data)


def test_a_class_of_the_training_loads_only_once_allowed_through_torch() -> None:
    data = pickle.dumps({"tag": Tag("x")}, protocol=5)
    with pytest.raises(safe_pickle.UnsafeCheckpointError) as err:
        safe_pickle.loads(data)
    assert err.value.qualified == f"{__name__}.Tag"
    assert "add_safe_globals([Tag])" in str(err.value)
    with torch.serialization.safe_globals([Tag]):
        assert safe_pickle.loads(data) == {"tag": Tag("x")}
    with torch.serialization.safe_globals([(Tag, f"{__name__}.Tag")]):
        assert safe_pickle.loads(data) == {"tag": Tag("x")}
    with pytest.raises(safe_pickle.UnsafeCheckpointError):
        safe_pickle.loads(data)  # the allowance ended with its block
    amount = pickle.dumps([decimal.Decimal("1.5")], protocol=5)  # a type written in C
    with torch.serialization.safe_globals([decimal.Decimal]):
        assert safe_pickle.loads(amount) == [decimal.Decimal("1.5")]


def test_a_skeleton_pickled_before_tensor_refs_had_their_own_reduce_still_loads() -> None:
    earlier = (  # pickle.dumps({"w": TensorRef(3)}, protocol=5) as written until 2026-12
        b"\x80\x05\x959\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01w\x94\x8c\x17aegis.checkpoint."
        b"layout\x94\x8c\tTensorRef\x94\x93\x94)\x81\x94]\x94K\x03abs."
    )
    assert safe_pickle.loads(earlier) == {"w": lay.TensorRef(3)}
    now = pickle.dumps({"w": lay.TensorRef(3)}, protocol=5)
    assert now != earlier and safe_pickle.loads(now) == {"w": lay.TensorRef(3)}


def glob(module: str, name: str) -> bytes:  # GLOBAL: push module.name
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(s: str) -> bytes:  # SHORT_BINUNICODE
    return b"\x8c" + bytes([len(s.encode())]) + s.encode()


def sets(target: bytes, pairs: dict[str, bytes]) -> bytes:
    """BUILD with a state of (None, {name: value}) on ``target``: setattr for each; then POP."""
    items = b"".join(text(k) + v for k, v in pairs.items())
    return target + b"N}(" + items + b"u\x86b0"


def test_a_load_cannot_redirect_the_files_a_path_names_through_the_classes_it_is_given(
    tmp_path: Path,
) -> None:
    target, evil = tmp_path / "config.txt", tmp_path / "evil.txt"
    target.write_text("genuine")
    evil.write_text("attacker's")
    counter = glob("collections", "Counter")
    layout = glob("torch.serialization", "_get_layout")
    posix = glob("pathlib", "PosixPath")
    # Counter({PosixPath(target): evil}): what the cache would map the path to
    redirect = counter + b"}" + posix + text(str(target)) + b"\x85R" + text(str(evil)) + b"s\x85R"
    data = (
        b"\x80\x04"
        + sets(counter, {"__missing__": glob("builtins", "str")})
        + sets(layout, {"cache": redirect})
        + sets(posix, {"__fspath__": layout, "__str__": glob("builtins", "str")})
        + b"}."
    )
    given = (collections.Counter, torch.serialization._get_layout, PosixPath)
    before = [dict(vars(g)) for g in given]
    assert safe_pickle.loads(data) == {}  # what it set, it set on functions of its own
    assert [dict(vars(g)) for g in given] == before
    assert Path(target).read_text() == "genuine" and str(Path(target)) == str(target)
    assert collections.Counter()["missing"] == 0
    assert safe_pickle.loads(pickle.dumps(torch.strided)) is torch.strided


def test_a_load_that_changes_a_class_it_was_given_is_refused_and_the_change_undone() -> None:
    before = dict(vars(Tag))
    planted = {"__repr__": glob("builtins", "str"), "planted": glob("builtins", "int")}
    data = b"\x80\x04" + sets(glob(__name__, "Tag"), planted) + b"}."
    refused = pytest.raises(safe_pickle.UnsafeCheckpointError, match=r"may not change .*\.Tag")
    with torch.serialization.safe_globals([Tag]), refused:
        safe_pickle.loads(data)
    assert dict(vars(Tag)) == before and repr(Tag("x")) == "Tag(name='x')"
    ref = glob("aegis.checkpoint.layout", "TensorRef")
    with pytest.raises(TypeError):  # its __setstate__, called on the class, takes the BUILD
        safe_pickle.loads(b"\x80\x04" + sets(ref, {"__repr__": glob("builtins", "str")}) + b"}.")
    assert repr(lay.TensorRef(1)) == "TensorRef(index=1)"


def test_a_refused_torch_name_imports_nothing() -> None:
    code = (
        "import sys, torch\n"
        "from aegis.checkpoint import safe_pickle\n"
        "for name in ('_inductor', '_dynamo', 'onnx', 'has_cuda'):\n"
        "    try:\n"
        "        safe_pickle.loads(b'ctorch\\n' + name.encode() + b'\\n.')\n"
        "    except safe_pickle.UnsafeCheckpointError:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
        "(['torch', '_inductor'], ['torch', '_dynamo'], ['torch', 'onnx'])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
