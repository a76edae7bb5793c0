"""The files a job run by a platform leaves next to its logs: the final status
(``--status-file``) and the control file that ``aegis ctl --log-dir`` reads. Shared by
``aegis run`` (``local_run``, ``replicated_run``, the command line's observers) and a Slurm
job's coordinator."""

from __future__ import annotations

import json
from pathlib import Path

from aegis.core.model import JobSpec, JobStatus
from aegis.master import control, control_file, node_drains
from aegis.master.job_runner import JobRunner
from aegis.wire import status_json


def write_status_file(path: Path, spec: JobSpec, status: JobStatus) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(status_json.to_dict(spec, status), indent=2) + "\n")


async def serve_control(
    runner: JobRunner, platform: node_drains.NodeBlacklist, log_dir: Path
) -> Path | None:
    """Answer ``aegis ctl`` for the one job of ``runner`` on its bus (stop, taint, hang, drain
    and undrain, what ``platform`` can do of them) and write the control file in ``log_dir``;
    returns its path (None: the bus has no address to write)."""
    spec = runner.spec

    def resolve(namespace: str, job: str) -> JobRunner | None:
        return runner if (namespace, job) == (spec.namespace, spec.job) else None

    serving = await control.serve_control(runner.bus, resolve, lambda: [platform],
                                          lambda: [runner])  # fmt: skip
    target = control_file.bus_target(runner.bus, spec.namespace, spec.job, serving.subject)
    if target is None:
        return None
    path = log_dir / control_file.CONTROL_FILE
    control_file.write_control_file(path, target)
    return path
