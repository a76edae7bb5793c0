"""Progress and early crash reports for a script that never imports aegis.

:func:`install` runs before the user's code in every Python process of a job: the agent puts
:data:`SITE_DIR` (a ``sitecustomize`` that chains to the user's own) first on the ``PYTHONPATH``
of the training command, so cold starts, ``torchrun``'s workers and whatever a ``bash -c``
wrapper starts get it at interpreter start-up; the zygote calls it in each warm child. Without
``AEGIS_PROGRESS_FILE`` in the environment (not under an agent) it does nothing. It installs:

- the dying excepthook (:func:`aegis.training.say_when_dying`): an uncaught exception is reported
  as the interpreter begins to exit, not once it has finished;
- the flight recorder's answering thread (:mod:`aegis.flight`), where torch's recorder is on;
- a global optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``),
  registered only once the process imports ``torch.optim`` (torch is never imported here): a
  :class:`sys.meta_path` entry that only looks at ``sys.modules`` registers it at the next import
  after ``torch.optim.optimizer`` has defined the function (right away in a zygote's child, which
  has torch already).

The step the hook reports is ``AEGIS_RESUME_STEP`` (the step the master had every rank resume
from, when Aegis knows it; else 0) plus the number of ``step()`` calls of the optimizer that has
stepped most in this process (per optimizer, so a script with one optimizer per parameter group
or per parameter still counts iterations; a second optimizer stepping in the same iteration
adds nothing). Only a higher number than the last one is written. An explicit
``aegis.progress(step)`` takes precedence: from the script's first call on the hook writes
nothing and removes itself. Keep this module free of heavy imports (it loads in every process
of the job).

The input time (the master's straggler scores, :mod:`aegis.core.stragglers`): each reported
step also arms torch's global module forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) for one call: the first module
forward after the step (in DDP the wrapper's own) writes the seconds since the step was reported
(data loading and whatever else the rank does before its forward) into the progress file and
removes the hook again, so every other module call of the step takes torch's hook-free path.
A rank that is slow before the collective shows there (its peers' steps end with its own: they
wait for it inside the collective).

The script's own checkpoints: from its first reported step on, ``torch.save`` (to a path or an
open file, not to an in-memory buffer) and ``torch.distributed.checkpoint.save`` are wrapped:
each one that returns writes the step into the progress file
(:func:`aegis.training.report_saved`; a save inside another, in the same thread, counts once).
A script that takes no checkpoint requests still has safe points then: a slow pod leaves right
after the script's next own save (the master's ``SafePoints``). A ``torch.save`` to a file counts
when what it saves holds training state (:func:`holds_state`: a module, an optimizer, a tensor of
more than one element); a metrics dump (numbers, scalar tensors) does not, so no pod leaves at
it to resume from an older checkpoint. A script that bound ``save`` to a name of its own before
its first step is not seen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from aegis import flight, training

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
PATH_VAR = "PYTHONPATH"
RESUME_STEP_VAR = "AEGIS_RESUME_STEP"  # = aegis.wire.messages.RESUME_STEP_ENV
OFF_VAR = "AEGIS_AUTO_PROGRESS"  # 0: the agent leaves PYTHONPATH alone
OPTIMIZER_MODULE = "torch.optim.optimizer"
REGISTER = "register_optimizer_step_post_hook"
FORWARD_MODULE = "torch.nn.modules.module"
FORWARD_REGISTER = "register_module_forward_pre_hook"
_COUNT = "_aegis_steps"  # the per-optimizer count, kept on the optimizer itself
# the script's own saves: (module, function, whether only a save to a file counts)
SAVES = (("torch", "save", True), ("torch.distributed.checkpoint", "save", False))
_OFF = frozenset({"0", "off", "no", "false"})


def pythonpath(env: Mapping[str, str]) -> str | None:
    """The ``PYTHONPATH`` a job's command gets: :data:`SITE_DIR` first, then the job's own; None
    when ``AEGIS_AUTO_PROGRESS=0`` (leave it as it is)."""
    if env.get(OFF_VAR, "").strip().lower() in _OFF:
        return None
    theirs = [p for p in env.get(PATH_VAR, "").split(os.pathsep) if p and p != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *theirs])


class _Steps:
    """The hook's state, one per process (forked children inherit it)."""

    __slots__ = ("base", "first", "handle", "installed", "most")

    def __init__(self) -> None:
        self.base = 0
        self.most = 0  # the highest per-optimizer count so far
        self.handle: Any = None  # torch's RemovableHandle
        self.first: Callable[[], None] | None = None  # called at the first reported step
        self.installed = False


_steps = _Steps()


class _Input:
    """The forward pre-hook's state: armed at each reported step, for one call."""

    __slots__ = ("handle", "register", "since")

    def __init__(self) -> None:
        self.since = 0.0  # time.monotonic() when the last step was reported
        self.handle: Any = None  # torch's RemovableHandle while armed
        self.register: Callable[..., Any] | None = None


_input = _Input()
_monotonic = time.monotonic


def install(first_step: Callable[[], None] | None = None) -> bool:
    """Install both hooks when under an agent (once per process); True when installed.
    ``first_step`` runs at the first step the optimizer hook reports (the zygote learns the
    loaded modules then)."""
    if not os.environ.get(training.ENV_VAR):
        return False
    flight.install()  # its own once-per-process guard (a forked child starts its own thread)
    if _steps.installed:
        return False
    _steps.installed = True
    training.say_when_dying()
    text = os.environ.get(RESUME_STEP_VAR, "")
    _steps.base = int(text) if text.isdigit() else 0
    _steps.first = first_step
    module = sys.modules.get(OPTIMIZER_MODULE)
    if module is None or not _register(module):
        sys.meta_path.insert(0, _Watch())
    return True


def _register(module: ModuleType) -> bool:
    """Register the hook with a (possibly still initialising) ``torch.optim.optimizer``."""
    register = getattr(module, REGISTER, None)
    if register is None:
        return False
    _steps.handle = register(_after_step)
    return True


class _Watch:
    """A ``sys.meta_path`` entry that finds nothing: at each import it looks whether
    ``torch.optim.optimizer`` can take the hook yet, registers it, and leaves ``meta_path``."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> None:
        if self.done:
            return
        module = sys.modules.get(OPTIMIZER_MODULE)
        if module is None:
            return
        self.done = True
        try:
            if not _register(module):
                self.done = False  # not defined yet: at a later import
                return
        except Exception:
            pass  # never break the import that brought us here
        # a new list: the import system may be iterating over the current one
        sys.meta_path = [finder for finder in sys.meta_path if finder is not self]

    def invalidate_caches(self) -> None:
        pass


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global post hook: count the step, report it when it is the highest so far."""
    try:
        seen = optimizer.__dict__
        count = seen.get(_COUNT, 0) + 1
        seen[_COUNT] = count
        if count <= _steps.most:
            return
        _steps.most = count
        first = _steps.first
        if first is not None:
            _steps.first = None
            first()
        if not training.report_step(_steps.base + count):
            _remove()  # the script reports itself, or there is no agent after all
            return
        _arm_input()
        if _wrapping[0]:
            _wrap_saves()
    except Exception:
        pass  # never break a training step


class _Saves(threading.local):
    """Per thread: the wrapped saves in progress (a save inside another counts once)."""

    depth = 0


_saves = _Saves()
_wrapping = [True]  # a save function is not wrapped yet


def _wrap_saves() -> None:
    """Wrap the save functions of :data:`SAVES` that are loaded (and not wrapped yet)."""
    pending = False
    for name, attr, to_file in SAVES:
        module = sys.modules.get(name)
        original = getattr(module, attr, None)
        if original is None:
            pending = True
        elif not getattr(original, "aegis_saves", False):
            setattr(module, attr, _saving(original, to_file))
    _wrapping[0] = pending


def _saving(original: Callable[..., Any], to_file: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        _saves.depth += 1
        try:
            result = original(*args, **kwargs)
        finally:
            _saves.depth -= 1
        if _saves.depth == 0 and (not to_file or _a_checkpoint_file(args, kwargs)):
            with contextlib.suppress(Exception):  # never break a save
                training.report_saved()
        return result

    save.aegis_saves = True  # type: ignore[attr-defined]
    return save


def _a_checkpoint_file(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.save(obj, f)`` saved training state (:func:`holds_state`) to a file (a
    path, or an open file: it has a name), not to an in-memory buffer."""
    f = args[1] if len(args) > 1 else kwargs.get("f")
    to_file = isinstance(f, str | bytes | os.PathLike) or isinstance(getattr(f, "name", None), str)
    return to_file and holds_state(args[0] if args else kwargs.get("obj"))


STATE_LOOKS = 4096  # the objects of a saved structure looked at, at most


def holds_state(obj: Any) -> bool:
    """Whether a saved object holds training state: something with a ``state_dict`` (a module,
    an optimizer) or a tensor of more than one element, among the first STATE_LOOKS objects of
    its dicts, lists and tuples. A metrics dump (numbers, strings, scalar tensors) does not."""
    stack, looked = [obj], 0
    while stack and looked < STATE_LOOKS:
        item = stack.pop()
        looked += 1
        if callable(getattr(item, "state_dict", None)):
            return True
        numel = getattr(item, "numel", None)
        if callable(numel) and hasattr(item, "dtype"):  # a tensor
            if numel() > 1:
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _arm_input() -> None:
    """Time the input of the next step: the forward pre-hook, for its next call."""
    state = _input
    state.since = _monotonic()
    if state.handle is not None:
        return  # no forward since the last step (still armed)
    register = state.register
    if register is None:
        register = getattr(sys.modules.get(FORWARD_MODULE), FORWARD_REGISTER, None)
        if register is None:
            return  # torch.nn not loaded: no forward to time
        state.register = register
    state.handle = register(_before_forward)


def _before_forward(module: Any, args: Any) -> None:
    """torch's global forward pre-hook, armed for one call: the input time, then off (torch
    iterates over a copy of its hooks, so removing this one here is safe)."""
    state = _input
    try:
        training.report_input(_monotonic() - state.since)
        handle, state.handle = state.handle, None
        if handle is not None:
            handle.remove()
    except Exception:
        pass  # never break a forward


def _remove() -> None:
    handle, _steps.handle = _steps.handle, None
    if handle is not None:
        handle.remove()
    armed, _input.handle = _input.handle, None
    if armed is not None:
        armed.remove()
