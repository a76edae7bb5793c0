"""The agent: PID-1 supervisor of the training command (DESIGN section 5).

Modules, outside in:

- :mod:`aegis.agent.runner` — ``aegis agent``: subreaper, independent mode when ``--master``
  does not answer, exit status; :mod:`aegis.agent.pid1` — tini's signal duties (forwarding,
  SIGTERM = stop with grace); :mod:`aegis.agent.linked` — the agent under a master, wired.
- Under a master, one way: the supervisor reports facts to :mod:`aegis.agent.link` (through
  ``ports.AgentReports``), which sends them and takes the master's orders; it never reads nor
  drives the supervisor. :mod:`aegis.agent.executor` carries the orders out on the supervisor
  through the narrow ``ports.Training`` port and sends the heartbeats. Below the link:
  :mod:`aegis.agent.transport` (credentials, NATS, reconnects), and pure decisions:
  :mod:`aegis.agent.encode` (reports as wire messages), :mod:`aegis.agent.order_policy` (which
  orders are taken, what each means), :mod:`aegis.agent.exit_rule`,
  :mod:`aegis.agent.decline_rule`.
- :mod:`aegis.agent.supervisor` — :class:`~aegis.agent.supervisor.Supervisor`: ``start(env)``,
  ``stop()``, ``restart(env)``, ``send_signal(sig)``, ``wait()``, ``progress()``; properties
  ``pid``, ``running``, ``restart_count``, ``hung``, ``last_step``. An incarnation's record,
  environment and exit report: :mod:`aegis.agent.incarnation`; its cold or warm start:
  :mod:`aegis.agent.launch`.
- :mod:`aegis.agent.ports` — the two ports (``AgentReports``, ``Training``), the evidence types,
  and the in-memory :class:`~aegis.agent.ports.RecordingReports`.
- :mod:`aegis.agent.reaper` — the one owner of ``waitpid``; every child is spawned through it.
- :mod:`aegis.agent.signatures` — the log signature table and scanner.
- :mod:`aegis.agent.watchdog`, :mod:`aegis.agent.stacks` — hang detection and py-spy dumps.
- :mod:`aegis.agent.tasks` — background tasks, named and guarded.
- :mod:`aegis.training` (outside this package, so that :mod:`aegis.checkpoint` may use it) — the
  training side of ``aegis.progress(step)`` and of checkpoint requests (keep it light).
"""
