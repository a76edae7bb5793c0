"""Recognise a command the zygote can start warm: ``python [options] script.py args`` or ``-m mod``;
and the interpreter a command trains in (:func:`job_interpreter`: the node checks run there).

Pure: no I/O except PATH lookups, the first line of a script run by name and (in
:func:`warm_command`) a look at the script. Anything else (a shell string, ``torchrun``,
``python -c``, interpreter options the zygote cannot reproduce, a script that is not a plain
source file) is started cold.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Mapping, Sequence

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# Interpreter options a zygote started with the same options reproduces in its children.
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-b", "-bb", "-q", "-I", "-P", "-R"})
_WITH_VALUE = ("-W", "-X")
CHECK_PYTHON_VAR = "AEGIS_CHECK_PYTHON"  # the interpreter the checks run in, when said


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


def warm_command(
    argv: Sequence[str], env: Mapping[str, str], is_source: Callable[[str], bool] | None = None
) -> PythonCommand | None:
    """The command in ``argv`` when the zygote can start it warm, else None (start it cold).

    The zygote compiles a script as source: a zipapp (``app.pyz``, a PEX, a shiv build), a
    directory with a ``__main__.py`` or a missing script (cold, CPython says "can't open file"
    and exits 2) is left to CPython. ``is_source(path)``: whether the script is a plain source
    file (relative to the cwd)."""
    command = parse(argv, env)
    if command is None or command.script is None:
        return command
    return command if (is_source or is_plain_source)(command.script) else None


def is_plain_source(path: str) -> bool:
    """Whether ``path`` is a regular file that CPython runs as source (not as a zip archive)."""
    return os.path.isfile(path) and not zipfile.is_zipfile(path)


def job_interpreter(
    argv: Sequence[str], env: Mapping[str, str], head: Callable[[str], bytes] | None = None
) -> str | None:
    """The interpreter the command ``argv`` trains in, as a path: the one ``AEGIS_CHECK_PYTHON``
    names; ``python ...``'s; the one on the ``#!`` line of a program run by name (``torchrun``,
    a console script, a script with ``#!/usr/bin/env python3``). None when the command does not
    say (a shell, ``conda run``): the caller's own then. ``head(path)``: a file's first bytes."""
    path = env.get("PATH")
    named = env.get(CHECK_PYTHON_VAR, "").strip()
    if named:
        return shutil.which(named, path=path) or named
    program = shutil.which(argv[0], path=path) if argv else None
    if program is None:
        return None
    if is_python(program, env):
        return program
    return _shebang_python((head or _head)(program), env)


def _head(program: str) -> bytes:
    try:
        with open(program, "rb") as f:
            return f.read(256)
    except OSError:
        return b""


def _shebang_python(head: bytes, env: Mapping[str, str]) -> str | None:
    """The Python interpreter a script's ``#!`` line names (through ``env``, ``env -S``)."""
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    if not words or not _PYTHON_NAME.match(os.path.basename(words[0])):
        return None
    if os.path.isabs(words[0]):
        return words[0]
    return shutil.which(words[0], path=env.get("PATH"))
