"""The zygote: a warm interpreter that forks training processes (run by path, stdlib only).

The agent starts it as ``PYTHON [the command's options] zygote.py --fd N --agent PID
(--script S | --module M) [--modules a,b] [--auto 1] [--learned FILE]`` with the job's
environment and cwd, in a process group of its own; it dies with the agent while idle. It puts
the directory a cold start would put first on ``sys.path`` (the script's, or the cwd for ``-m``;
none under ``-P``/``-I``), imports the modules to prewarm (``--modules``; with ``--auto`` also
the modules the script imports and, in import order, those the previous incarnation had loaded at
its first ``aegis.progress()``, listed in ``--learned``), skipping the job's own code (under that
directory, or anywhere but the standard library and site-packages: it may change between
restarts, or read the incarnation's environment as it is imported) and stopping at one that
starts a thread or initialises CUDA. Then it serves the agent as :func:`aegis.forking.run_server`
says, as a *nanny*: its ready message adds ``modules``, ``skipped`` and ``learned``, a failed one
the ``module`` that broke it; a request is ``{"env", "cwd", "args", "orig_argv", "learn"}``; after
its one fork the zygote is the child's nanny (the one process that waits for it), it reports the
child's end and exits.

The child (see :func:`aegis.forking.become_child`) takes the per-incarnation environment, cwd
and OpenBLAS pool, gets the hooks a cold start gets from the agent's ``sitecustomize``
(:func:`aegis.autoprogress.install`: the dying report, the optimizer step hook), and runs the
command as ``__main__`` from the top level of this file, so an uncaught exception,
``SystemExit`` or ``KeyboardInterrupt`` ends it exactly as it ends a cold interpreter, with the
traceback a cold one prints (this file's frames taken off: they are Aegis's, not the user's).
"""

import sys

if __name__ == "__main__" and not sys.flags.safe_path:  # -P, -I, PYTHONSAFEPATH: none there
    del sys.path[0]  # this file's directory: never let it shadow the job's modules

import ast
import builtins
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import os
import runpy
import site
import socket
import sysconfig
import time
import types
from collections.abc import Callable, Mapping
from typing import Any


def _reach_aegis() -> None:
    """This interpreter may have no ``aegis`` of its own (the job's environment is not the
    agent's): import the one this file belongs to, and only it (``aegis/_site/_aegis_reach.py``)."""
    site = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site")
    sys.path.insert(0, site)
    try:
        import _aegis_reach

        _aegis_reach.install()
    finally:
        sys.path.remove(site)


_reach_aegis()

from aegis import autoprogress, forking  # noqa: E402

RENDEZVOUS_WAIT_S = 0.5


def script_imports(path: str) -> list[str]:
    """Absolute imports anywhere in the file, in order of appearance."""
    try:
        with io.open_code(path) as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


def library_roots(path: list[str]) -> tuple[str, ...]:
    """Where installed libraries live: the standard library, the site directories, and any
    ``site-packages``/``dist-packages`` directory on ``path`` (a cluster's ``module load``
    puts one on PYTHONPATH)."""
    paths = sysconfig.get_paths()
    found = [paths.get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += [*site.getsitepackages(), site.getusersitepackages()]
    found += [entry for entry in path if _LIBRARY_DIRS & set(entry.split(os.sep))]
    return tuple(dict.fromkeys(os.path.join(os.path.realpath(p), "") for p in found if p))


_LIBRARY_DIRS = {"site-packages", "dist-packages"}


def is_job_code(name: str, path0: str, libraries: tuple[str, ...]) -> bool:
    """Whether the top-level package of ``name`` is the job's own code (or cannot be found):
    under ``path0``, or anywhere but ``libraries`` (PYTHONPATH=src, an editable install). Such
    code may change between restarts, and may read the incarnation's environment (its
    ``MASTER_PORT``) as it is imported: it is never imported before the fork."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return True
    if spec is None:
        return True
    places = [os.path.realpath(p) for p in (spec.origin or "", *(spec.submodule_search_locations
              or ())) if p and p not in ("built-in", "frozen")]  # fmt: skip
    root = os.path.join(os.path.realpath(path0), "")
    return any(p.startswith(root) or not p.startswith(libraries) for p in places)


def prewarm(names: list[str], path0: str) -> tuple[list[str], list[str], str | None]:
    """Import ``names``; (imported, skipped, the module that broke the single thread or None)."""
    imported: list[str] = []
    skipped: list[str] = []
    libraries = library_roots(sys.path)
    for name in names:
        if name in sys.modules or name == "__future__" or is_job_code(name, path0, libraries):
            (imported if name in sys.modules else skipped).append(name)
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            skipped.append(name)
            continue
        imported.append(name)
        if forking.unsafe() is not None:
            return imported, skipped, name
    return imported, skipped, None


def become_job(request: dict[str, Any]) -> None:
    """In the forked child: what differs from the zygote in a cold start of this incarnation."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    forking.restore_blas()  # the OpenBLAS pool of a cold start with this environment
    sys.orig_argv[:] = request["orig_argv"]
    learn = request.get("learn")
    if learn:
        learn_at_first_progress(learn)
    # what the agent's sitecustomize does in a cold start (torch may be here already)
    autoprogress.install(functools.partial(write_learned, learn) if learn else None)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # as fresh as a cold start's (random reseeds itself after fork)
    await_rendezvous(os.environ)


def await_rendezvous(env: Mapping[str, str], deadline_s: float = RENDEZVOUS_WAIT_S) -> bool:
    """A warm rank starts within milliseconds, maybe before rank 0's store listens on
    MASTER_ADDR:MASTER_PORT; torch's store client then backs off for most of a second
    (measured here: 0.74 s when rank 0 came 50 ms after the others, 0.02 s when it did not).
    So a rank other than 0 waits, at most ``deadline_s``, until the port accepts a connection
    (one it closes at once), then runs the script. True when it does."""
    addr, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT", ""), env.get("RANK", "0")
    if not addr or not port.isdigit() or rank == "0":
        return False
    end = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=0.05):
                return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.002)


def learn_at_first_progress(path: str) -> None:
    """Write the names in ``sys.modules`` (:func:`write_learned`) at the first progress call.

    Through ``aegis.progress``'s own lazy binding, so later calls cost nothing extra; the agent
    prewarms these modules in the next zygote (lazy imports such as ``torch._dynamo`` included).
    """
    aegis = sys.modules.get("aegis")
    if aegis is None or not hasattr(aegis, "_load_report"):
        return

    def first_progress(step: int) -> bool:
        report = aegis._load_report()  # from now on progress() calls it directly
        write_learned(path)
        return bool(report(step))

    aegis._report[:] = [first_progress]  # a private hook, by design


def write_learned(path: str) -> None:
    """The names in ``sys.modules`` (import order) into ``path``, atomically; at the first
    progress call, or at the first optimizer step a script that never calls it reports."""
    try:
        with open(path + ".tmp", "w") as out:
            out.write("\n".join(name for name in list(sys.modules) if name != "__main__"))
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def learned(path: str | None) -> list[str]:
    if not path:
        return []
    try:
        with open(path) as names:
            return names.read().split()
    except OSError:
        return []


def run_script(path: str, args: list[str]) -> None:
    """What ``python path args`` does once the interpreter is up."""
    sys.argv[:] = [path, *args]
    full = os.path.abspath(path)  # since 3.9 ``__main__.__file__`` is absolute
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=full,
        __cached__=None,
        __builtins__=builtins,
        __loader__=importlib.machinery.SourceFileLoader("__main__", full),
    )
    sys.modules["__main__"] = main
    with io.open_code(full) as source:
        code = compile(source.read(), full, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def run_module(module: str, args: list[str]) -> None:
    """What ``python -m module args`` does once the interpreter is up."""
    sys.argv[:] = ["-m", *args]
    runpy._run_module_as_main(module, True)  # type: ignore[attr-defined]  # what -m calls


def prewarm_options(options: dict[str, str]) -> dict[str, Any]:
    """The zygote's prewarm (see the module docstring): the fields of its ready message, or of
    its failed one (``failed`` and the ``module`` that broke the single thread)."""
    script = options.get("--script")
    path0 = os.path.dirname(os.path.realpath(script)) if script else os.getcwd()
    if not sys.flags.safe_path:  # -P, -I, PYTHONSAFEPATH: a cold start puts nothing first
        sys.path.insert(0, path0)
    names = [n for n in options.get("--modules", "").split(",") if n]
    extra: list[str] = []
    if options.get("--auto") == "1":
        names += script_imports(script) if script else []
        extra = learned(options.get("--learned"))
    names = list(dict.fromkeys(names))
    imported, skipped, culprit = prewarm([*names, *(n for n in extra if n not in names)], path0)
    if culprit is not None:
        return {"failed": forking.unsafe() or "threads", "module": culprit}
    chosen = set(names)
    return {"modules": [n for n in imported if n in chosen],
            "skipped": [n for n in skipped if n in chosen], "learned": len(extra)}  # fmt: skip


def main(argv: list[str]) -> Callable[[], None]:
    """Prewarm, serve, and (in the forked child only) return what runs the command."""
    options, request = forking.run_server(argv, prewarm_options, name=b"aegis-zygote", nanny=True)
    become_job(request)
    script, module, args = options.get("--script"), options.get("--module"), request["args"]
    if module is not None:
        return lambda: run_module(module, args)
    assert script is not None
    return lambda: run_script(script, args)


def user_traceback(exc: BaseException) -> types.TracebackType | None:
    """``exc``'s traceback less the launcher's frames (this file's: ``<module>``, ``run_script``)
    that a cold ``python script.py`` never has, so the user's traceback starts at the user's
    code. A traceback with no frame of the user's is a launcher bug and is kept whole, unless
    compiling the user's code raised it (a ``SyntaxError``: cold, no frame at all either)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    if tb is None and not isinstance(exc, SyntaxError):
        return exc.__traceback__
    return tb


if __name__ == "__main__":
    _run = main(sys.argv[1:])
    del main
    try:
        _run()
    except BaseException as _exc:
        _exc.__traceback__ = user_traceback(_exc)
        raise  # a bare raise adds no frame: the interpreter reports it as a cold one would
