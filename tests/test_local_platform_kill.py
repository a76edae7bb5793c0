"""``aegis run``'s second stop signal kills its pods (``LocalPlatform.kill_now``): a pod that
was being started as the kill came starts no agent, and the checkpoint memory the killed agents
left on this host (a killed agent cannot remove its own) is removed once they are gone, and
only theirs. (The whole path: ``tests/test_second_signal_e2e.py``.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from aegis.agent import link_settings, linked
from aegis.core import events as ev
from aegis.platforms import local
from aegis.platforms.local import LocalPlatform, LocalSettings
from aegis.spawn import owners
from tests.waits import async_wait_until


class GatedHost(local.SharedHost):
    """This host, but a node is made only when the test opens the gate."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def prepare(self, node: str) -> None:
        self.entered.set()
        await self.gate.wait()

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        return list(argv)


async def test_a_pod_being_started_as_the_run_kills_its_pods_starts_no_agent(
    tmp_path: Path,
) -> None:
    hosts = GatedHost()
    settings = LocalSettings(nodes=("node-0",), spares=(), command=("true",), log_dir=tmp_path)
    platform = LocalPlatform(settings, hosts)
    events: list[ev.Event] = []
    platform.attach(events.append, namespace="ns", job="k", pods={"k-0": "node-0"},  # type: ignore[dict-item]
                    master="127.0.0.1:1", token="t" * 32)  # fmt: skip
    launching = asyncio.create_task(platform.launch_all())
    await async_wait_until(hosts.entered.is_set, what="the node being made")
    platform.kill_now()  # the second Ctrl-C, while the node is made
    hosts.gate.set()
    await launching
    assert platform.agent_pids() == {}  # no agent started after the kill
    await platform.replace_pod("k", "k-0", "lost")  # nor by a replacement
    await platform.stop_all()
    assert platform.agent_pids() == {} and events == []


def test_a_killed_pods_memory_is_found_by_the_agents_own_name_and_only_its_own(
    tmp_path: Path,
) -> None:
    def made(pod: str, node: str = "node-0") -> Path:
        s = link_settings.LinkSettings(
            grpc_target="127.0.0.1:1", namespace="ns", job="k", pod=pod, token="t-1",
            node=node, ckpt_dir=tmp_path / "ckpt",
        )  # fmt: skip
        daemon = linked._saver_settings(s, shm_root=tmp_path)
        assert daemon is not None
        (daemon.shm_dir / "slot-0").write_bytes(b"state")
        gone = owners.process_name().rsplit("=", 1)[0] + "=1\n"  # its agent killed: another start
        (daemon.shm_dir / owners.OWNER).write_text(gone)
        return daemon.shm_dir

    killed, other_pod, elsewhere = made("k-0"), made("k-1"), made("k-0", node="node-1")
    link_settings.forget_memory(
        tmp_path, link_settings.memory_prefix("ns", "k", "k-0", "node-0"), "k-0's killed agent"
    )
    assert not killed.exists()
    assert other_pod.exists() and elsewhere.exists()
