"""Which signals the agent passes on to the command's group (tini's set)."""

from __future__ import annotations

import signal

from aegis.agent import pid1

S = signal.Signals


def test_every_catchable_signal_but_the_agents_own_is_forwarded() -> None:
    forwarded = set(pid1.FORWARDED_SIGNALS)
    for sig in (S.SIGINT, S.SIGHUP, S.SIGQUIT, S.SIGUSR1, S.SIGUSR2, S.SIGALRM, S.SIGPWR,
                S.SIGXCPU, S.SIGVTALRM, S.SIGPROF, S.SIGWINCH, S.SIGCONT, S.SIGURG, S.SIGIO,
                S.SIGRTMIN, S.SIGRTMIN + 3, S.SIGRTMAX):  # fmt: skip
        assert sig in forwarded, sig
    for sig in (S.SIGTERM, S.SIGCHLD, S.SIGKILL, S.SIGSTOP, S.SIGSEGV, S.SIGBUS, S.SIGFPE,
                S.SIGILL, S.SIGTRAP, S.SIGABRT, S.SIGSYS, S.SIGTSTP, S.SIGTTIN, S.SIGTTOU,
                S.SIGPIPE, S.SIGXFSZ):  # fmt: skip
        assert sig not in forwarded, sig
    assert forwarded | pid1.KEPT_SIGNALS == set(signal.valid_signals())


def test_forwarded_leaves_out_only_the_kept_when_given_signals() -> None:
    given = [S.SIGPIPE, S.SIGPWR, 40, S.SIGHUP, S.SIGCHLD]
    assert pid1.forwarded(given) == tuple(sorted((S.SIGHUP, S.SIGPWR, 40)))
