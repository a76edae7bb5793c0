"""Master failover time: SIGKILL the leading ``aegis master`` replica of a running job and time
how long until the standby leads the job again, against the lease length (the baseline: a
standby may not take over before the dead leader's lease has expired).

Usage: python benchmarks/failover.py [--trials 3]

Each trial is ``aegis run --masters 2``'s set-up (``ReplicatedRun``: a real nats-server, two
``aegis master`` processes, real agents, a 3-rank gloo job). Once the job trains, the leader is
SIGKILLed. Measured from the kill: the standby holds the lease (polled every 10 ms on the lease
bucket), and the standby has taken the job over (its log line ``leads job``, which it writes
after re-sending the round's orders; from the line's own timestamp).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aegis.core.phases import Phase
from aegis.master.lease import LeaseSettings
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"


async def one_trial() -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(prefix="aegis-failover-"))
    settings = RunSettings(
        command=(sys.executable, str(TRAIN), "--steps", "400", "--step-time-s", "0.05",
                 "--ckpt-every", "20", "--ckpt-dir", str(tmp / "ckpt")),
        nodes=3, spare_nodes=1, max_retry=2, job="failover", heartbeat_timeout_s=4.0,
        grace_s=3.0, log_dir=tmp,
    )  # fmt: skip
    run = ReplicatedRun(settings, 2, tmp)
    await run.start()
    try:
        deadline = time.monotonic() + 120
        leader = None
        while leader is None or (await run.status()).phase is not Phase.RUN_COMMAND:
            if time.monotonic() > deadline:
                raise SystemExit("the job never trained")
            await asyncio.sleep(0.1)
            leader = await run.leader()
        standby = 1 - leader
        killed = time.time()
        run.masters[leader].send_signal(signal.SIGKILL)
        while await run.leader() != standby:
            await asyncio.sleep(0.01)
        lease_taken = time.time() - killed
        log = tmp / f"master-{standby}.log"
        while "leads job" not in log.read_text():
            await asyncio.sleep(0.05)
        line = next(x for x in log.read_text().splitlines() if "leads job" in x)
        stamp = " ".join(line.split()[:2]).replace(",", ".")
        led = datetime.datetime.fromisoformat(stamp).timestamp() - killed
        return lease_taken, led
    finally:
        for proc in run.masters:
            if proc.poll() is None:
                proc.kill()
        await run.finish()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    lease = LeaseSettings().lease_s
    now = datetime.datetime.now(datetime.UTC)
    print(f"# failover, {now:%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; lease {lease:g} s (single nats-server)")  # fmt: skip
    rows = []
    for trial in range(args.trials):
        taken, led = await one_trial()
        rows.append((taken, led))
        print(f"trial {trial}: lease taken {taken:.2f} s ({taken / lease:.2f}x lease), "
              f"job led {led:.2f} s ({led / lease:.2f}x lease)", flush=True)  # fmt: skip
    taken = statistics.mean(r[0] for r in rows)
    led = statistics.mean(r[1] for r in rows)
    print(f"\nmean: lease taken {taken:.2f} s, job led {led:.2f} s; "
          f"goal: within lease + 1 s = {lease + 1:g} s")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
