"""The warm check interpreter: forks check children that have torch imported already.

The agent starts it (through its reaper, see :mod:`aegis.checks.host`) as ``python -m
aegis.checks.forkserver --fd N --agent PID`` in a process group of its own; it dies with the
agent. It imports torch, ``torch.distributed`` and :mod:`aegis.checks.collective`, and then
serves the agent as :func:`aegis.forking.run_server` says: a request is ``{"argv": [collective
arguments]}``, one child at a time, for as long as the agent lives. The child runs
:func:`aegis.checks.collective.main`, exactly what ``python -m aegis.checks.collective`` runs
(the runtime check's environment report, then the collective rounds). The forkserver itself
never creates a thread, a process group (torch.distributed) or a CUDA context (only a child asks
whether CUDA is available), so every fork is safe.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from aegis import forking


def prewarm(options: dict[str, str]) -> dict[str, Any]:
    """Import what a check child needs; ``failed`` with the reason when an import fails
    (:func:`aegis.forking.run_server` checks that the imports left the fork safe)."""
    try:
        import torch
        import torch.distributed  # noqa: F401

        from aegis.checks import collective  # noqa: F401
    except BaseException as exc:  # torch that does not import: the agent starts children cold
        return {"failed": f"import failed: {type(exc).__name__}: {exc}"}
    return {}


def run_child(argv: list[str]) -> int:
    """In the forked child: what ``python -m aegis.checks.collective ARGV`` runs."""
    from aegis.checks import collective

    sys.argv[:] = ["-m", *argv]
    try:
        code = collective.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main(argv: list[str]) -> int:
    _, request = forking.run_server(
        argv, prewarm, name=b"aegis-checkhost", child_name=b"aegis-check"
    )
    return run_child([str(a) for a in request["argv"]])


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # a child: no lingering gloo threads at interpreter exit
