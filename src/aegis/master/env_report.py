"""Bootcheck's environment report across pods: flags "multiple versions" (seed section 6).

Each pod's runtime check result is its environment line (torch, CUDA, NCCL, cuDNN versions,
devices); when every pod of a bootcheck round has answered, the versions are compared and a
mismatch is logged and kept on the tracker (``warning``) for the status view.
"""

from __future__ import annotations

import logging

from aegis.checks import env
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType
from aegis.master.job_runner import JobRunner
from aegis.wire import messages as m

log = logging.getLogger(__name__)


class EnvironmentReport:
    def __init__(self) -> None:
        self.reports: dict[str, env.EnvReport] = {}
        self.round = -1
        self.warning: str | None = None

    def attach(self, runner: JobRunner) -> None:
        runner.message_listeners.append(self.on_message)

    def on_message(self, runner: JobRunner, msg: m.Message) -> None:
        if msg.phase is not Phase.BOOT_CHECKING or not isinstance(msg.data, m.ChecksData):
            return
        if msg.seq != self.round:
            self.round, self.reports = msg.seq, {}
        for result in msg.data.response.results:
            report = env.parse_report(result.result)
            if result.check_type is CheckType.RUNTIME and report is not None:
                self.reports[msg.pod] = report
        if len(self.reports) == runner.spec.worker_num:
            self.warning = env.multiple_versions(self.reports)
            if self.warning is not None:
                log.warning("job %s: bootcheck: %s", runner.spec.job, self.warning)
