"""Aegis's start-up hook for the Python processes of a training job.

The agent puts this directory first on the ``PYTHONPATH`` of the training command, so every
interpreter of the job (a cold start, ``torchrun``'s workers, what a ``bash -c`` wrapper runs)
imports this module at start-up, in place of the ``sitecustomize`` it would otherwise import. It
takes this directory off ``sys.path``, imports the user's own ``sitecustomize`` (if there is one:
exactly as ``site`` would have; its errors reach ``site`` unchanged), then, under an agent only
(``AEGIS_PROGRESS_FILE`` set), installs the progress and dying hooks (:mod:`aegis.autoprogress`).
An interpreter with no ``aegis`` of its own (the job runs in another environment than the agent)
gets the agent's, and only it (:mod:`_aegis_reach`). Nothing here may break a process: when
``aegis`` cannot be imported even so (a Python too old for it), nothing is installed.
"""

import importlib
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop(__name__, None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")  # the user's, now that ours is off the path
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules[__name__] = ours


def _reach() -> None:
    try:
        import _aegis_reach  # beside this file: import it before _chain takes the folder off

        _aegis_reach.install()
    except Exception:
        return


def _install() -> None:
    if not os.environ.get("AEGIS_PROGRESS_FILE"):
        return
    try:
        from aegis import autoprogress

        autoprogress.install()
    except Exception:
        return  # no aegis in this interpreter, or a broken one: never break a process of the job


_reach()
try:
    _chain()
finally:
    _install()
