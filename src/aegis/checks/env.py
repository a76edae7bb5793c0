"""The environment report of bootcheck (DESIGN section 6) and the "multiple versions" verdict.

A pod's report travels to the master inside the runtime check's ``CheckResult.result`` as one
line ``key=value; key=value; ...`` (:func:`format_report`); the master parses every pod's line
with :func:`parse_report` and calls :func:`multiple_versions` (a pure function) on them.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass, fields

NONE = "none"

# Fields whose difference across pods is flagged "multiple versions".
VERSION_FIELDS: tuple[str, ...] = ("python", "torch", "cuda", "nccl", "cudnn")


@dataclass(frozen=True, slots=True)
class EnvReport:
    python: str = NONE
    torch: str = NONE
    cuda: str = NONE
    nccl: str = NONE
    cudnn: str = NONE
    cuda_available: bool = False
    device_count: int = 0
    device_name: str = NONE


def environment_report() -> EnvReport:
    """This process's runtime. It imports torch and may initialise CUDA: the agent never calls
    it, its check child does (:mod:`aegis.checks.collective`)."""
    import torch

    cuda_available = bool(torch.cuda.is_available())
    nccl = NONE
    if cuda_available and hasattr(torch.cuda, "nccl"):
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    cudnn = torch.backends.cudnn.version() if cuda_available else None  # type: ignore[no-untyped-call]
    count = int(torch.cuda.device_count()) if cuda_available else 0
    return EnvReport(
        python=platform.python_version(),
        torch=str(torch.__version__),
        cuda=str(torch.version.cuda or NONE),
        nccl=nccl,
        cudnn=str(cudnn) if cudnn else NONE,
        cuda_available=cuda_available,
        device_count=count,
        device_name=str(torch.cuda.get_device_name(0)) if count else "cpu",
    )


def runtime_verdict(report: EnvReport, expect_cuda: bool | None) -> tuple[bool, str]:
    """(passed, result line) of the runtime check: the report as the line (the master parses it
    with :func:`parse_report`); failed when CUDA's availability is not what was expected
    (``expect_cuda`` None: either is fine)."""
    line = format_report(report)
    if expect_cuda is True and not report.cuda_available:
        return False, f"CUDA not available, expected; {line}"
    if expect_cuda is False and report.cuda_available:
        return False, f"CUDA available, not expected; {line}"
    return True, line


def format_report(report: EnvReport) -> str:
    parts = []
    for f in fields(report):
        value = getattr(report, f.name)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        parts.append(f"{f.name}={text.replace(';', ',')}")
    return "; ".join(parts)


def parse_report(line: str) -> EnvReport | None:
    """The report in a runtime check's result line, or None when the line carries none."""
    values: dict[str, str] = {}
    for part in line.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep:
            values[key] = value
    if "torch" not in values:
        return None
    try:
        return EnvReport(
            python=values.get("python", NONE),
            torch=values["torch"],
            cuda=values.get("cuda", NONE),
            nccl=values.get("nccl", NONE),
            cudnn=values.get("cudnn", NONE),
            cuda_available=values.get("cuda_available", "false") == "true",
            device_count=int(values.get("device_count", "0")),
            device_name=values.get("device_name", NONE),
        )
    except ValueError:
        return None


def multiple_versions(reports: Mapping[str, EnvReport]) -> str | None:
    """None when every pod runs the same versions, else one line naming each differing field.

    Example: ``multiple versions: torch 2.13.0 (pod-0, pod-2) / 2.12.1 (pod-1)``.
    """
    problems = []
    for name in (*VERSION_FIELDS, "device_name"):
        by_value: dict[str, list[str]] = {}
        for pod, report in sorted(reports.items()):
            by_value.setdefault(str(getattr(report, name)), []).append(pod)
        if len(by_value) > 1:
            variants = " / ".join(
                f"{value} ({', '.join(pods)})" for value, pods in sorted(by_value.items())
            )
            problems.append(f"{name} {variants}")
    if not problems:
        return None
    return "multiple versions: " + "; ".join(problems)
