"""The agent: PID-1 supervisor of the training command (DESIGN section 5).

Modules, outside in:

- :mod:`aegis.agent.runner` — ``aegis agent`` without a master: subreaper, signal forwarding
  (SIGTERM = stop with grace), independent mode when ``--master`` does not answer, exit status.
- :mod:`aegis.agent.supervisor` — :class:`~aegis.agent.supervisor.Supervisor`, the object a master
  link drives: ``start(env)``, ``stop()``, ``restart(env)``, ``send_signal(sig)``, ``wait()``;
  properties ``pid``, ``running``, ``restart_count``, ``hung``, ``last_step``.
- :mod:`aegis.agent.ports` — :class:`~aegis.agent.ports.AgentReports`, the port the agent reports
  through (``child_exited``, ``hang_detected``, ``fault_seen``), its evidence types, and the
  in-memory :class:`~aegis.agent.ports.RecordingReports`.
- :mod:`aegis.agent.reaper` — the one owner of ``waitpid``; every child is spawned through it.
- :mod:`aegis.agent.signatures` — the log signature table and scanner.
- :mod:`aegis.agent.watchdog`, :mod:`aegis.agent.stacks` — hang detection and py-spy dumps.
- :mod:`aegis.training` (outside this package, so that :mod:`aegis.checkpoint` may use it) — the
  training side of ``aegis.progress(step)`` and of checkpoint requests (keep it light).
"""
