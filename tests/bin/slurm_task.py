"""A trivial training stand-in for the Slurm tests: ``slurm_task.py DIR [--crash-once] [--wait]
[--meet]``.

Records its rank, node, hostname, environment and what it sees of the ranks' shared memory in
DIR (each run leaves a file in its host's ``/dev/shm``; SHM lists this job's files there); with
``--crash-once`` rank 0 exits 3 the first time (a marker file in DIR remembers it), so the job
needs exactly one in-place restart; with ``--meet`` the ranks meet where they were told to, as
a real rendezvous would: rank 0 listens on MASTER_ADDR:MASTER_PORT (so the address must be its
own host's), every other rank connects there and records rank 0's hostname (MET); with
``--wait`` it finishes only once DIR/go exists (the test's "training is done" switch).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

MEET_S = 60.0  # how long a rank waits for the other side of the rendezvous

out = Path(sys.argv[1])
rank = os.environ.get("RANK", "?")
host = socket.gethostname()
shm = Path("/dev/shm")
prefix = f"slurm_task-{out.name}-"
(shm / f"{prefix}{rank}-{host}-{os.getpid()}").write_text(host)


def meet() -> str:
    """Rank 0: serve its hostname to every other rank; the others: read it from rank 0. A
    connection that says nothing is not a rank (the agent's zygote probes the port first)."""
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    print(f"slurm_task: rank {rank} on {host} meets at {addr}", flush=True)
    deadline = time.monotonic() + MEET_S
    if rank == "0":
        peers = int(os.environ["WORLD_SIZE"]) - 1
        with socket.create_server(addr) as server:
            server.settimeout(MEET_S)
            while peers:
                conn, _peer = server.accept()
                with conn:
                    conn.settimeout(MEET_S)
                    if conn.recv(64):
                        conn.sendall(host.encode())
                        peers -= 1
        return host
    while True:
        try:
            with socket.create_connection(addr, timeout=5) as conn:
                conn.sendall(f"rank {rank}".encode())
                return conn.recv(256).decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # rank 0 is not listening yet: try again until the deadline


marker = out / "crashed"
crash = "--crash-once" in sys.argv and rank == "0" and not marker.exists()
record: dict[str, object] = {
    k: os.environ.get(k, "")
    for k in (
        "RANK",
        "WORLD_SIZE",
        "AEGIS_NODE",
        "AEGIS_POD",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_JOB_ID",
    )
}
record["HOSTNAME"] = host
record["SHM"] = sorted(p.name for p in shm.glob(f"{prefix}*"))
if "--meet" in sys.argv and not crash:
    record["MET"] = meet()
with (out / f"rank-{rank}.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
if crash:
    marker.write_text("1")
    print("slurm_task: rank 0 crashing on purpose", flush=True)
    sys.exit(3)
while "--wait" in sys.argv and not (out / "go").exists():
    time.sleep(0.1)
print(f"slurm_task: rank {rank} done", flush=True)
