"""How long the CPU limit of this process's cgroup has held it back (CFS bandwidth throttling).

A throttled thread waits as runnable, and the kernel counts that wait in its run delay
(``/proc/thread-self/schedstat``) as it counts a wait for a busy CPU. allreduce_perf leaves the
second out of its compute figure (load is not slowness) and must count the first in: a pod held
to a fifth of a CPU by its limit is slow. Measured here: a loop in a cgroup capped at 20 % ran
0.40 s of 2.00 s, and its run delay was 1.60 s; without this, it rated at full speed.

The limit may sit on the process's cgroup or on any above it (a Kubernetes pod's cgroup above
its containers'), so every ``cpu.stat`` from the process's cgroup up to its hierarchy's mount is
read: ``throttled_time`` (ns, cgroup v1's cpu controller) or ``throttled_usec`` (v2).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath


def _own_path(cgroup_text: str) -> tuple[str, str] | None:
    """(``"v1"`` or ``"v2"``, this process's cgroup path) on the hierarchy the cpu controller
    is on (``/proc/self/cgroup``), the v1 cpu hierarchy first (on a hybrid host it holds the
    controller, the unified one none)."""
    unified = None
    for line in cgroup_text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "cpu" in controllers.split(","):
            return "v1", path
        if hierarchy == "0" and controllers == "":
            unified = path
    return None if unified is None else ("v2", unified)


def _mount(mountinfo_text: str, version: str) -> tuple[str, str] | None:
    """(the cgroup path at the mount's root, the mount point) of the hierarchy ``version``
    names (``/proc/self/mountinfo``: inside a container the root is the container's cgroup)."""
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[dash + 1], fields[dash + 3]
        if version == "v2" and fstype == "cgroup2":
            return root, point
        if version == "v1" and fstype == "cgroup" and "cpu" in options.split(","):
            return root, point
    return None


def stat_files(cgroup_text: str, mountinfo_text: str) -> list[Path]:
    """Every ``cpu.stat`` from this process's cgroup up to its hierarchy's mount point, as seen
    here; [] where there is no cpu hierarchy or the cgroup is outside the mount."""
    own = _own_path(cgroup_text)
    mount = None if own is None else _mount(mountinfo_text, own[0])
    if own is None or mount is None:
        return []
    root, point = PurePosixPath(mount[0]), PurePosixPath(mount[1])
    path = PurePosixPath(own[1])
    if not path.is_relative_to(root):
        return []
    relative = path.relative_to(root)
    levels = [relative, *relative.parents] if str(relative) != "." else [relative]
    return [Path(point / level / "cpu.stat") for level in levels]


def own_stat_files() -> list[Path]:
    """:func:`stat_files` of this process; [] where /proc cannot be read."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    return stat_files(cgroup, mountinfo)


def throttled_s(files: Sequence[Path]) -> float:
    """Seconds the cgroups of ``files`` have been throttled, summed (0 for a file that cannot be
    read)."""
    total = 0.0
    for file in files:
        try:
            text = file.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            scale = {"throttled_time": 1e-9, "throttled_usec": 1e-6}.get(key)
            if scale is not None and value.strip().isdigit():
                total += int(value) * scale
    return total


def busy_s(elapsed: float, run_delay: float, throttled: float) -> float:
    """The seconds a window counts: its ``elapsed`` less the run delay that was not throttling
    (a wait for a busy CPU), at least 5 % of it."""
    waited_for_cpu = max(run_delay - throttled, 0.0)
    return max(elapsed - waited_for_cpu, elapsed * 0.05)
