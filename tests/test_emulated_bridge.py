"""The emulated cluster's bridge keeps its MAC address when a node is lost.

A Linux bridge left to itself takes the lowest MAC of its ports. When a node's namespaces went
(a node lost: its holder killed), the bridge's MAC could change, and every other node's ARP
entry for the bridge's address (where the master and NATS listen) went stale for seconds: their
agents' heartbeats were lost, and a pod that had just moved off a failing node was lost again
(the health-drain benchmark counted a fault in 2 of 9 runs with the watch on). Real namespaces:
the cluster is made in a network namespace of the test's own (``unshare --net``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.platforms import emulated
from tests.cluster import require_namespaces

pytestmark = pytest.mark.timeout(120)

PROBE = """
import asyncio, re, subprocess, sys
from pathlib import Path
from aegis.platforms import emulated
from tests.waits import async_wait_until

def mac(link):
    out = subprocess.run(["ip", "-o", "link", "show", link], capture_output=True, text=True)
    found = re.search(r"link/ether ([0-9a-f:]+)", out.stdout)
    return found[1] if found else None

async def main():
    nodes = ["node-0", "node-1", "node-2"]
    cluster = emulated.EmulatedCluster(nodes, Path(sys.argv[1]))
    await cluster.start()
    for node in nodes:
        await cluster.prepare(node)
    seen = [mac(emulated.BRIDGE)]
    ports = sorted((mac(f"aegis-n{i}"), i) for i in range(3))
    for _, i in ports:  # the lowest port MAC first: the one a bridge would have taken
        cluster.nodes[nodes[i]].holder.kill()
        await cluster.nodes[nodes[i]].holder.wait()
        gone = lambda: mac(f"aegis-n{i}") is None  # the namespace goes with its last process
        await async_wait_until(gone, 30, "the node's namespace gone")
        seen.append(mac(emulated.BRIDGE))
    await cluster.close()
    print(" ".join(str(m) for m in seen))

asyncio.run(main())
"""


def test_the_bridge_keeps_its_mac_when_nodes_are_lost(tmp_path: Path) -> None:
    require_namespaces()
    out = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", PROBE, str(tmp_path)],
        check=False,
        env={**os.environ, emulated.CLUSTER_ENV: emulated.INSIDE},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    seen = out.stdout.split()
    assert seen == [emulated.BRIDGE_MAC] * 4, seen  # before each loss, and after each
