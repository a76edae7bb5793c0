"""Recognise a command the zygote can start warm: ``python [options] script.py args`` or ``-m mod``.

Pure: no I/O except :func:`is_python`'s PATH lookup. Anything else (a shell string, ``torchrun``,
``python -c``, interpreter options the zygote cannot reproduce) is started cold.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Mapping, Sequence

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# Interpreter options a zygote started with the same options reproduces in its children.
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-b", "-bb", "-q", "-I", "-P", "-R"})
_WITH_VALUE = ("-W", "-X")


@dataclasses.dataclass(frozen=True, slots=True)
class PythonCommand:
    interpreter: str
    options: tuple[str, ...]
    script: str | None  # python script.py ...
    module: str | None  # python -m module ...
    args: tuple[str, ...]

    @property
    def target(self) -> str:
        return f"-m {self.module}" if self.module is not None else str(self.script)


def is_python(program: str, env: Mapping[str, str]) -> bool:
    """Whether ``program`` names a CPython interpreter (by its name, after a PATH lookup)."""
    if _PYTHON_NAME.match(os.path.basename(program)):
        return True
    found = shutil.which(program, path=env.get("PATH"))
    return found is not None and bool(_PYTHON_NAME.match(os.path.basename(found)))


def parse(argv: Sequence[str], env: Mapping[str, str]) -> PythonCommand | None:
    """The Python command in ``argv``, or None when it must start cold."""
    if not argv or not is_python(argv[0], env):
        return None
    options: list[str] = []
    index = 1
    while index < len(argv):
        word = argv[index]
        if word in _FLAGS:
            options.append(word)
        elif word in _WITH_VALUE and index + 1 < len(argv):
            options.extend(argv[index : index + 2])
            index += 1
        elif word.startswith(_WITH_VALUE) and len(word) > 2:
            options.append(word)
        elif word == "-m" and index + 1 < len(argv):
            module = argv[index + 1]
            return PythonCommand(argv[0], tuple(options), None, module, tuple(argv[index + 2 :]))
        elif word.startswith("-"):
            return None  # -c, -i, -, --, combined flags: not reproduced
        else:
            return PythonCommand(argv[0], tuple(options), word, None, tuple(argv[index + 1 :]))
        index += 1
    return None  # the interactive interpreter
