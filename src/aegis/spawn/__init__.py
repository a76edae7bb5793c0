"""Starting and waiting for child processes, shared by the agent and the layers under it.

- :mod:`aegis.spawn.spawner`: the :class:`~aegis.spawn.spawner.Spawner` port (start a child with
  some descriptors, await its raw wait status; the agent's reaper is one) and
  :class:`~aegis.spawn.spawner.LocalSpawner`, for processes that have no reaper;
- :mod:`aegis.spawn.forkclient`: the agent's side of a forkserver (:mod:`aegis.forking`), used by
  the agent's warm restarts (:mod:`aegis.agent.warm`) and by the warm checks
  (:mod:`aegis.checks.host`);
- :mod:`aegis.spawn.owners`: a process named by boot, pid namespace, pid and start in ticks since
  boot, the owner of what it leaves behind (progress files, checkpoint memory, an embedded NATS
  server's directory, a job's record), and whether it is gone.
"""
