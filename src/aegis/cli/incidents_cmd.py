"""``aegis incidents JOB [--log-dir D] [--json]``: every fault as an incident, with its
timeline, evidence, classification, decisions and recovery time."""

from __future__ import annotations

import datetime
import json
from typing import Annotated

import typer

from aegis.cli import render, status_cmd
from aegis.tools import incidents as incidents_tool
from aegis.tools import joblog

MAX_LINES = 12  # evidence lines shown per report (all of them in --json)


def register(app: typer.Typer) -> None:
    app.command("incidents")(incidents)


def clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def describe(incident: incidents_tool.Incident) -> list[str]:
    """The human text of one incident (plain lines)."""
    node = f" on {incident.node}" if incident.node else ""
    lines = [
        f"incident {incident.id}: {incident.reason}",
        f"  detected {clock(incident.detected_ts)} in {incident.phase.value} by "
        f"{incident.detected_by}: {incident.pod}{node}"
        f"{' (counted)' if incident.counted else ' (not counted)'}",
    ]
    if incident.suspect:
        lines.append(f"  suspect: {incident.suspect}")
    if incident.evidence:
        lines.append("  evidence:")
    for item in incident.evidence:
        lines.append(f"    {item.pod} {item.kind}: {item.summary}")
        if item.kind == "checks" and not item.summary.startswith("failed"):
            continue  # passing checks: the summary says it (all lines in --json)
        shown = item.lines[-MAX_LINES:]
        if len(item.lines) > len(shown):
            lines.append(f"      ... {len(item.lines) - len(shown)} more lines")
        lines.extend(f"      | {text}" for text in shown)
    if incident.classification:
        verdicts = ", ".join(f"{pod} {cls}" for pod, cls in sorted(incident.classification.items()))
        lines.append(f"  classification: {verdicts}")
    lines.append("  decisions:")
    for step in incident.decisions:
        offset = step.ts - incident.detected_ts
        lines.append(f"    +{offset:6.2f} s  {step.text}")
    level = incident.level_name or "none"
    if incident.recovery_s is None:
        lines.append(f"  level: {level}; still open")
    else:
        outcome = incident.outcome.value if incident.outcome else "?"
        lines.append(f"  level: {level}; {outcome} after {incident.recovery_s:.2f} s")
    return lines


def describe_outage(outage: incidents_tool.StoreOutage) -> str:
    """One line of a checkpoint store outage."""
    where = f"{outage.pod}: [Errno {outage.errno}] {outage.strerror}: {outage.directory}"
    tried = f", {outage.failures} failed attempts" if outage.failures else ""
    if outage.down_s is None:
        return (
            f"checkpoint store down {clock(outage.began_ts)} {where}; still down "
            f"(step {outage.step} kept in memory{tried})"
        )
    return (
        f"checkpoint store down {clock(outage.began_ts)} {where}; back after "
        f"{outage.down_s:.1f} s (training went on from memory{tried})"
    )


def incidents(
    job: Annotated[str, typer.Argument(help="Job name.")],
    log_dir: status_cmd.LogDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="A JSON array.")] = False,
) -> None:
    """Show every fault of the job: detection, evidence, classification, decision, recovery."""
    log = status_cmd.load_or_exit(job, log_dir)
    found = incidents_tool.incidents(log.spec.job, log.initial, log.steps)
    with (log.log_dir / joblog.EVENTS).open(errors="replace") as lines:
        outages = incidents_tool.store_outages(lines)
    if as_json:
        records = [i.to_dict() for i in found] + [o.to_dict() for o in outages]
        print(json.dumps(records, indent=2))
        raise typer.Exit(0)
    out = render.make_console()
    if not found and not outages:
        out.print(f"job {job}: no incidents")
    for incident in found:
        out.print("\n".join(describe(incident)), markup=False)
    for outage in outages:
        out.print(describe_outage(outage), markup=False)
    raise typer.Exit(0)
