"""Master failover time: SIGKILL the leading ``aegis master`` replica of a running job and time
how long until the standby leads the job again, against the lease length (the baseline: a
standby may not take over before the dead leader's lease has expired).

Usage: python benchmarks/failover.py [--trials 3] [--kill-after-s S]

Each trial is ``aegis run --masters 2``'s set-up (``ReplicatedRun``: a real nats-server, two
``aegis master`` processes, real agents, a 3-rank gloo job). The leader is SIGKILLed once the job
trains (the early kill), or ``--kill-after-s S`` seconds after the job began to train (the late
kill: the job is given S + 30 s of steps, so it still trains then). Measured from the kill: the
standby holds the lease (polled every 10 ms on the lease bucket), and the standby has taken the
job over (its log line ``leads job``, which it writes after re-sending the round's orders; from
the line's own timestamp). The goal: led within lease + 1 s. Printed after: the job's phase
a second after the takeover (RunCommand; its recover count unchanged: not restarted), then the
job is stopped from outside (its platform's quit, handled by the new leader) and its end phase,
so a late trial lasts S plus a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aegis.core import events as ev
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.master.lease import LeaseSettings
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
STEP_TIME_S = 0.05
EARLY_STEPS = 400  # the early kill's job: 20 s of steps
LATE_TAIL_S = 30.0  # steps left after a late kill (at least: a step sleeps STEP_TIME_S)
STEP = re.compile(r" step (\d+) loss ")


@dataclass(frozen=True, slots=True)
class Trial:
    killed_after_s: float  # since the job began to train
    step: int  # rank 0's last logged step at the kill
    consumers: dict[str, int]  # on the lease and status streams, at the kill
    lease_taken_s: float
    led_s: float
    phase: Phase  # after the takeover
    recover_count: tuple[int, int]  # before the kill, after the takeover
    end: Phase  # once stopped from outside (a quit), after the takeover
    stop_s: float  # from that quit to the end
    log_dir: Path


async def _consumers(run: ReplicatedRun) -> dict[str, int]:
    js = run.bus.client.jetstream()
    counts = {}
    for bucket in (LeaseSettings().bucket, STATUS_BUCKET):
        try:
            counts[bucket] = (await js.stream_info(f"KV_{bucket}")).state.consumer_count
        except Exception:
            counts[bucket] = -1
    return counts


def _last_step(log: Path) -> int:
    found = STEP.findall(log.read_text(errors="replace")) if log.exists() else []
    return int(found[-1]) if found else -1


async def one_trial(kill_after_s: float) -> Trial:
    tmp = Path(tempfile.mkdtemp(prefix="aegis-failover-"))
    steps = math.ceil((kill_after_s + LATE_TAIL_S) / STEP_TIME_S) if kill_after_s else EARLY_STEPS
    settings = RunSettings(
        command=(sys.executable, str(TRAIN), "--steps", str(steps), "--step-time-s",
                 str(STEP_TIME_S), "--ckpt-every", "20", "--ckpt-dir", str(tmp / "ckpt")),
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
        training = time.monotonic()
        await asyncio.sleep(max(0.0, training + kill_after_s - time.monotonic()))
        before = await run.status()
        if before.phase is not Phase.RUN_COMMAND or await run.leader() != leader:
            raise SystemExit(f"at the kill: phase {before.phase.value}, leader {leader} changed")
        consumers = await _consumers(run)
        step = _last_step(tmp / "pods" / "failover-0.log")
        standby = 1 - leader
        killed = time.time()
        killed_after = time.monotonic() - training
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
        await asyncio.sleep(1.0)  # the new leader's first writes
        after = await run.status()
        stopped = time.monotonic()  # the job stopped from outside, through the new leader
        run.served.server.sink(ev.QuitRequested("failover benchmark: the trial is over"))
        while (end := await run.status()).phase not in TERMINAL_PHASES:
            if time.monotonic() > stopped + 60:
                raise SystemExit(f"the job did not stop within 60 s: {end.phase.value}")
            await asyncio.sleep(0.1)
        return Trial(
            killed_after, step, consumers, lease_taken, led, after.phase,
            (before.recover_count, after.recover_count), end.phase,
            time.monotonic() - stopped, tmp,
        )  # fmt: skip
    finally:
        for proc in run.masters:
            if proc.poll() is None:
                proc.kill()
        await run.finish()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kill-after-s", type=float, default=0.0,
                   help="SIGKILL the leader this long after the job began to train "
                        "(0: as soon as it trains)")  # fmt: skip
    args = p.parse_args()
    lease = LeaseSettings().lease_s
    goal = lease + 1
    now = datetime.datetime.now(datetime.UTC)
    when = f"{args.kill_after_s:g} s after the job began to train" if args.kill_after_s else (
        "as soon as the job trains"
    )  # fmt: skip
    print(f"# failover, {now:%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; lease {lease:g} s (single nats-server); "
          f"leader killed {when}", flush=True)  # fmt: skip
    rows = []
    for trial in range(args.trials):
        t = await one_trial(args.kill_after_s)
        rows.append(t)
        ok = "yes" if t.led_s <= goal else "NO"
        print(f"trial {trial}: killed {t.killed_after_s:.1f} s after training began (step "
              f"{t.step}, consumers {t.consumers}); lease taken {t.lease_taken_s:.2f} s "
              f"({t.lease_taken_s / lease:.2f}x lease), job led {t.led_s:.2f} s "
              f"({t.led_s / lease:.2f}x lease); led <= lease + 1 s ({goal:g} s): {ok}; then "
              f"{t.phase.value}, recover count {t.recover_count[0]} -> {t.recover_count[1]}, "
              f"quit: {t.end.value} in {t.stop_s:.1f} s; logs {t.log_dir}", flush=True)  # fmt: skip
    taken = statistics.mean(r.lease_taken_s for r in rows)
    led = statistics.mean(r.led_s for r in rows)
    met = sum(r.led_s <= goal for r in rows)
    print(f"\nmean: lease taken {taken:.2f} s, job led {led:.2f} s (max "
          f"{max(r.led_s for r in rows):.2f} s); goal: within lease + 1 s = {goal:g} s: met "
          f"{met}/{len(rows)}; lease {lease:g} s")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
