"""One master process against 1, 100, 1,000 and 5,000 simulated agents beating at 1 Hz.

Usage: python benchmarks/master_scale.py [--levels 1,100,1000,5000] [--pods-per-job 50]
       [--sims 4] [--steady-s 20] [--faults 20] [--storm 1000] [--out FILE]

What runs: one real nats-server (operator-mode auth, JetStream), ONE real ``aegis master``
process (the replica: lease, job runners, the store; ``--metrics-port`` for its histograms), and
``--sims`` simulator processes. A simulated agent speaks the real wire protocol
(``aegis.wire.messages``): it ACKs, answers bootcheck and troubleshoot orders with a Finish
carrying (passing) check results, takes RUN/RESTART orders as its run round, beats at 1 Hz with
its round's phase and seq, and reports an Error (or a Finish) when told. Agents are grouped into
jobs of ``--pods-per-job`` pods (50 by default: a mid-size job of 400 GPUs at 8 per pod, and the
fan-out of one order to 50 agents is what a fault costs); the simulated agents of one job share
one NATS connection (with the master's credentials: a worker's publish on its own pod's subject
only) but each has its own subscription and reports on its own pod's subject, so the server
still delivers every order once per agent. A simulator process owns whole jobs.

Measured, per level, over a steady window of ``--steady-s`` seconds:
- master CPU (utime+stime of the master process from /proc, in % of one core) and RSS; the
  nats-server's and the simulators' CPU beside it, and the load average;
- heartbeat processing lag, p50/p99: from the agent's send timestamp (``Message.ts``) to the
  master handling it (the master's ``aegis_heartbeat_lag_seconds`` histogram, fed from the job
  runner's ``heartbeat_listeners``; percentiles interpolated inside its buckets), and the rate
  of heartbeats the master handled against the rate the agents sent;
- fault-to-order, p50/p99 over ``--faults`` faults one after the other (each in another job):
  from an agent's Error (its send timestamp) to the troubleshoot order having reached every agent
  of that job (the last agent's receipt time; one host, one clock).
Then, at the largest level, a fault storm: every agent of ``--storm``/pods-per-job jobs reports
an Error at once. Checked from the stored status of every job: each storm job recovered exactly
once (recover_count +1, every pod's retries +1), no other job moved; every report accounted for by
the master (counted faults + uncounted faults + drops); master RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aegis.adapters.nats_auth import Authority, job_subject_prefix, worker_subject
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.model import JobSpec
from aegis.core.phases import Order, Phase
from aegis.master.records import submit_job
from aegis.master.service import STATUS_BUCKET
from aegis.spawn.ports import free_port
from aegis.wire import codec, status_json
from aegis.wire import messages as m

NAMESPACE = "bench"
TICKS = os.sysconf("SC_CLK_TCK")


# -- the simulator (one OS process, many agents) ------------------------------------------------


@dataclass
class SimPod:
    job: SimJob
    name: str
    run_round: tuple[Phase, int] = (Phase.PENDING, -1)
    running: bool = False
    executed: set[tuple[int, str]] = field(default_factory=set)
    ids: int = 0


@dataclass
class SimJob:
    name: str
    bus: NatsBus | None = None
    pods: list[SimPod] = field(default_factory=list)
    fault: dict[str, Any] | None = None  # t0, seq, reached (pods), storm

    @property
    def prefix(self) -> str:
        return job_subject_prefix(NAMESPACE, self.name)  # (submitted to replicas: no creation)


class Simulator:
    def __init__(self, url: str, authority: Authority, jobs: list[str], pods: int) -> None:
        self.url, self.authority = url, authority
        self.jobs = {name: SimJob(name) for name in jobs}
        for job in self.jobs.values():
            job.pods = [SimPod(job, f"{job.name}-{i}") for i in range(pods)]
        self.beats = 0
        self.out = sys.stdout

    def emit(self, **fields: Any) -> None:
        self.out.write(json.dumps(fields) + "\n")
        self.out.flush()

    async def send(self, pod: SimPod, kind: m.MessageType, phase: Phase, seq: int,
                   data: m.Payload) -> float:  # fmt: skip
        pod.ids += 1
        ts = time.time()
        msg = m.Message(job=pod.job.name, namespace=NAMESPACE, pod=pod.name, type=kind,
                        phase=phase, seq=seq, ts=ts, data=data,
                        id=f"{pod.name}/sim/{pod.ids}")  # fmt: skip
        assert pod.job.bus is not None
        await pod.job.bus.publish(worker_subject(pod.job.prefix, pod.name), codec.encode(msg))
        return ts

    async def start(self) -> None:
        for job in self.jobs.values():
            creds = self.authority.master_creds()  # (every pod's subject: a worker's has its own)
            job.bus = await NatsBus.connect(self.url, creds, name=f"sim-{job.name}")
            for pod in job.pods:
                await job.bus.client.subscribe(f"{job.prefix}.master", cb=self._order_cb(pod))
            await job.bus.flush()
            for pod in job.pods:
                await self.send(pod, m.MessageType.ACK, Phase.PENDING, 0, m.AckData(pod.name))

    def _order_cb(self, pod: SimPod) -> Any:
        async def on_order(msg: Any) -> None:
            now = time.time()
            order = codec.decode(msg.data)
            if not isinstance(order.data, m.OrderData):
                return
            data = order.data
            if data.pods and pod.name not in data.pods:
                return
            key = (order.seq, data.order.value)
            if key in pod.executed:
                return
            pod.executed.add(key)
            if data.order in (Order.RUN, Order.RESTART):
                pod.run_round, pod.running = (order.phase, order.seq), True
            elif data.order in (Order.BOOTCHECK, Order.TROUBLESHOOT):
                pod.running = False
                if data.order is Order.TROUBLESHOOT:
                    self._order_reached(pod, order.seq, now)
                checks = m.ChecksData(m.CheckResponse([]))
                await self.send(pod, m.MessageType.FINISH, order.phase, order.seq, checks)
            elif data.order is Order.EXIT:
                pod.running = False

        return on_order

    def _order_reached(self, pod: SimPod, seq: int, now: float) -> None:
        fault = pod.job.fault
        if fault is None or seq <= fault["seq"]:
            return
        fault["reached"].add(pod.name)
        fault["last"] = max(fault["last"], now)
        if len(fault["reached"]) == len(pod.job.pods):
            pod.job.fault = None
            self.emit(fault=pod.job.name, latency_s=fault["last"] - fault["t0"],
                      storm=fault["storm"])  # fmt: skip

    async def fault(self, job_name: str, *, storm: bool) -> None:
        job = self.jobs[job_name]
        await self._all_running(job)
        phase, seq = job.pods[0].run_round
        job.fault = {"seq": seq, "reached": set(), "last": 0.0, "storm": storm, "t0": 0.0}
        erring = job.pods if storm else job.pods[:1]
        error = m.ErrorData(reason="exit status 1", fault_class="sim", exit_code=1)
        first = None
        for pod in erring:
            ts = await self.send(pod, m.MessageType.ERROR, phase, seq, error)
            first = ts if first is None else first
        job.fault["t0"] = first

    @staticmethod
    async def _all_running(job: SimJob) -> None:
        """Until the job's last fault is over: every pod has its restart order."""
        async with asyncio.timeout(60):
            while job.fault is not None or not all(pod.running for pod in job.pods):
                await asyncio.sleep(0.005)

    async def beat(self) -> None:
        """Every pod once a second, spread evenly over the second."""
        pods = [pod for job in self.jobs.values() for pod in job.pods]
        period = 1.0 / max(1, len(pods))
        start = time.monotonic()
        index = 0
        while True:
            due = start + index * period
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            while start + index * period <= now:  # every pod due by now (catch up if behind)
                pod = pods[index % len(pods)]
                if pod.running:
                    phase, seq = pod.run_round
                    await self.send(pod, m.MessageType.HEARTBEAT, phase, seq, m.HeartbeatData(1))
                    self.beats += 1
                index += 1

    async def finish(self) -> None:
        for job in self.jobs.values():
            await self._all_running(job)
            for pod in job.pods:
                phase, seq = pod.run_round
                await self.send(pod, m.MessageType.FINISH, phase, seq, m.ExitData(0))
                pod.running = False

    async def serve(self) -> None:  # noqa: PLR0912 (one case per command of the driver)
        await self.start()
        beater = asyncio.create_task(self.beat())
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                cmd = json.loads(line)
                match cmd["cmd"]:
                    case "state":
                        pods = [p for j in self.jobs.values() for p in j.pods]
                        self.emit(state={"running": sum(p.running for p in pods),
                                         "pods": len(pods), "beats": self.beats})  # fmt: skip
                    case "fault":
                        await self.fault(cmd["job"], storm=False)
                    case "storm":
                        for name in cmd["jobs"]:
                            await self.fault(name, storm=True)
                        for job in self.jobs.values():
                            if job.bus is not None:
                                await job.bus.flush()
                        self.emit(storm_sent=len(cmd["jobs"]))
                    case "finish":
                        await self.finish()
                        for job in self.jobs.values():
                            if job.bus is not None:
                                await job.bus.flush()
                        self.emit(finished=True)
                    case "quit":
                        break
        finally:
            beater.cancel()
            for job in self.jobs.values():
                if job.bus is not None:
                    await job.bus.close()


def sim_main(args: argparse.Namespace) -> None:
    authority = Authority.load(Path(args.auth_file))
    sim = Simulator(args.nats, authority, args.jobs.split(","), args.pods_per_job)
    asyncio.run(sim.serve())


# -- the coordinator ----------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def lag_percentiles(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """p50/p99 of the heartbeat lag in a window, interpolated inside the histogram's buckets."""
    pattern = re.compile(r'^aegis_heartbeat_lag_seconds_bucket\{le="([^"]+)"\}$')
    buckets = []
    for name, value in after.items():
        match = pattern.match(name)
        if match:
            bound = float("inf") if match.group(1) == "+Inf" else float(match.group(1))
            buckets.append((bound, value - before.get(name, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    result = {"count": total}
    for q in (0.5, 0.99):
        target, lower, below = q * total, 0.0, 0.0
        for bound, cumulative in buckets:
            if cumulative >= target and total > 0:
                if bound == float("inf"):
                    result[f"p{round(q * 100)}"] = float("inf")
                else:
                    inside = cumulative - below
                    share = (target - below) / inside if inside else 1.0
                    result[f"p{round(q * 100)}"] = lower + share * (bound - lower)
                break
            lower, below = bound, cumulative
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class SimProc:
    def __init__(self, proc: asyncio.subprocess.Process, jobs: list[str]) -> None:
        self.proc, self.jobs = proc, jobs
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.faults: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            (self.faults if "fault" in msg else self.lines).put_nowait(msg)

    async def ask(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def reply(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return await asyncio.wait_for(self.lines.get(), timeout_s)

    async def state(self) -> dict[str, Any]:
        await self.ask(cmd="state")
        state: dict[str, Any] = (await self.reply())["state"]
        return state


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.authority = Authority()
        self.auth_file = workdir / "auth.json"
        self.authority.save(self.auth_file)

    async def start(self) -> None:
        self.server = EmbeddedNats(self.authority)
        await asyncio.to_thread(self.server.start)
        self.bus = await NatsBus.connect(
            self.server.url, self.authority.master_creds(), name="bench"
        )
        self.store = await KvStore.open(self.bus, STATUS_BUCKET)
        self.metrics_port = free_port()
        log = (self.workdir / "master.log").open("ab")
        self.master = subprocess.Popen(
            [sys.executable, "-m", "aegis", "master", "--nats", self.server.url,
             "--auth-file", str(self.auth_file), "--replica-id", "bench-master",
             "--heartbeat-timeout-s", "60", "--log-dir", str(self.workdir),
             "--metrics-port", str(self.metrics_port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                scrape(self.metrics_port)
                break
            except OSError:
                if time.monotonic() > deadline or self.master.poll() is not None:
                    raise RuntimeError("the master did not come up") from None
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self.master.poll() is None:
            self.master.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.master.wait, 10)
            except subprocess.TimeoutExpired:
                self.master.kill()
        await self.bus.close()
        await asyncio.to_thread(self.server.stop)

    async def statuses(self, jobs: list[str]) -> dict[str, Any]:
        out = {}
        for job in jobs:
            got = await self.store.get(f"{NAMESPACE}.{job}")
            assert got is not None
            out[job] = status_json.from_dict(json.loads(got[0]))[1]
        return out

    def cpu(self) -> dict[str, float]:
        pids = {"master": self.master.pid}
        assert self.server.process is not None
        pids["nats"] = self.server.process.pid
        values = {name: proc_cpu_s(pid) for name, pid in pids.items()}
        values["sims"] = sum(proc_cpu_s(s.proc.pid) for s in self.sims)
        values["wall"] = time.monotonic()
        return values

    async def level(self, agents: int, *, storm: int) -> dict[str, Any]:
        a = self.args
        per_job = min(a.pods_per_job, agents)
        jobs = [f"l{agents}-j{i:03d}" for i in range(agents // per_job)]
        nodes = [f"node-{i}" for i in range(per_job)]
        for job in jobs:
            await submit_job(self.store, JobSpec(job, NAMESPACE, per_job, 1000), nodes, "t")
        n_sims = min(a.sims, len(jobs))
        self.sims = []
        for k in range(n_sims):
            mine = jobs[k::n_sims]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--sim", "--nats", self.server.url,
                "--auth-file", str(self.auth_file), "--jobs", ",".join(mine),
                "--pods-per-job", str(per_job),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            )  # fmt: skip
            self.sims.append(SimProc(proc, mine))
        ramp = time.monotonic()
        while True:  # every agent through bootcheck into its run round
            states = [await s.state() for s in self.sims]
            if sum(st["running"] for st in states) == agents:
                break
            if time.monotonic() - ramp > 300:
                raise RuntimeError(f"only {states} running after 300 s")
            await asyncio.sleep(0.5)
        ramp_s = time.monotonic() - ramp
        await asyncio.sleep(3)  # one beat period for every agent before the window opens
        result: dict[str, Any] = {"agents": agents, "jobs": len(jobs), "pods_per_job": per_job,
                                  "sims": n_sims, "ramp_s": ramp_s}  # fmt: skip
        # steady window
        m0, c0, l0 = scrape(self.metrics_port), self.cpu(), os.getloadavg()
        b0 = sum([(await s.state())["beats"] for s in self.sims])
        spy = None
        if a.py_spy and agents == max(int(x) for x in a.levels.split(",")):
            binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen(
                [binary, "record", "--nonblocking", "--format", "raw",
                 "-r", "50", "-d", str(int(a.steady_s)), "-p", str(self.master.pid),
                 "-o", str(a.py_spy)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        await asyncio.sleep(a.steady_s)
        if spy is not None:
            await asyncio.to_thread(spy.wait, 60)
        m1, c1 = scrape(self.metrics_port), self.cpu()
        b1 = sum([(await s.state())["beats"] for s in self.sims])
        wall = c1["wall"] - c0["wall"]
        lag = lag_percentiles(m0, m1)
        result.update(
            master_cpu_pct=100 * (c1["master"] - c0["master"]) / wall,
            nats_cpu_pct=100 * (c1["nats"] - c0["nats"]) / wall,
            sims_cpu_pct=100 * (c1["sims"] - c0["sims"]) / wall,
            load=(l0[0], os.getloadavg()[0]),
            sent_per_s=(b1 - b0) / wall,
            handled_per_s=lag["count"] / wall,
            lag_p50_ms=1000 * lag.get("p50", float("nan")),
            lag_p99_ms=1000 * lag.get("p99", float("nan")),
            master_rss_mb=proc_rss_mb(self.master.pid),
        )
        # faults one after the other, each in the next job
        latencies: list[float] = []
        by_job = {job: sim for sim in self.sims for job in sim.jobs}
        for i in range(a.faults):
            job = jobs[i % len(jobs)]
            sim = by_job[job]
            await self._wait_running(sim, job)
            await sim.ask(cmd="fault", job=job)
            latencies.append((await asyncio.wait_for(sim.faults.get(), 60))["latency_s"])
        result.update(
            faults=len(latencies),
            fault_p50_ms=1000 * percentile(latencies, 0.5),
            fault_p99_ms=1000 * percentile(latencies, 0.99),
            fault_max_ms=1000 * max(latencies),
        )
        if storm:
            result["storm"] = await self.storm(jobs, by_job, storm // per_job)
        for sim in self.sims:  # end the level's jobs cleanly (Succeed), then stop the agents
            await sim.ask(cmd="finish")
            await sim.reply()
            await sim.ask(cmd="quit")
            await sim.proc.wait()
        await self._wait_ended(jobs)
        return result

    async def _wait_running(self, sim: SimProc, job: str) -> None:
        """Until the job's last fault is over (every pod back in a run round)."""
        deadline = time.monotonic() + 60
        while (await self.statuses([job]))[job].phase is not Phase.RUN_COMMAND:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job} not back in RunCommand")
            await asyncio.sleep(0.05)

    async def _wait_ended(self, jobs: list[str]) -> None:
        deadline = time.monotonic() + 120
        while True:
            phases = {s.phase for s in (await self.statuses(jobs)).values()}
            if phases <= {Phase.SUCCEED}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs not ended: {phases}")
            await asyncio.sleep(0.5)

    async def storm(
        self, jobs: list[str], by_job: dict[str, SimProc], count: int
    ) -> dict[str, Any]:
        storm_jobs = jobs[:count]
        for job in jobs:
            await self._wait_running(by_job[job], job)
        before = await self.statuses(jobs)
        m0 = scrape(self.metrics_port)
        rss0 = proc_rss_mb(self.master.pid)
        reports = sum(len(before[j].pod_infos) for j in storm_jobs)
        started = time.monotonic()
        for sim in self.sims:
            mine = [j for j in storm_jobs if j in sim.jobs]
            if mine:
                await sim.ask(cmd="storm", jobs=mine)
                await sim.reply()
        latencies = []
        for _ in storm_jobs:  # every storm job's troubleshoot order reached all its agents
            got = await asyncio.wait_for(self._any_fault(), 120)
            latencies.append(got["latency_s"])
        for job in storm_jobs:
            await self._wait_running(by_job[job], job)
        recovered_s = time.monotonic() - started
        after = await self.statuses(jobs)
        m1 = scrape(self.metrics_port)
        rss1 = proc_rss_mb(self.master.pid)

        def delta(prefix: str) -> float:
            return sum(v - m0.get(k, 0.0) for k, v in m1.items() if k.startswith(prefix))

        once = all(
            after[j].recover_count == before[j].recover_count + 1
            and all(
                after[j].pod_infos[p].retries == before[j].pod_infos[p].retries + 1
                for p in after[j].pod_infos
            )
            for j in storm_jobs
        )
        untouched = all(
            after[j].recover_count == before[j].recover_count for j in jobs if j not in storm_jobs
        )
        counted = delta('aegis_faults_total{counted="true",detector="error"}')
        uncounted = delta('aegis_faults_total{counted="false",detector="error"}')
        drops = {
            k: v - m0.get(k, 0.0) for k, v in m1.items()
            if k.startswith("aegis_messages_dropped") and v - m0.get(k, 0.0)
        }  # fmt: skip
        return {
            "reports": reports,
            "jobs": len(storm_jobs),
            "recovered_once": once,
            "other_jobs_untouched": untouched,
            "faults_counted": counted,
            "faults_uncounted": uncounted,
            "drops": drops,
            "accounted": counted + uncounted + sum(drops.values()),
            "order_p50_ms": 1000 * percentile(latencies, 0.5),
            "order_p99_ms": 1000 * percentile(latencies, 0.99),
            "all_back_s": recovered_s,
            "rss_before_mb": rss0,
            "rss_after_mb": rss1,
        }

    async def _any_fault(self) -> dict[str, Any]:
        getters = [asyncio.ensure_future(s.faults.get()) for s in self.sims]
        done, pending = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
        for future in pending:
            future.cancel()
        first = done.pop().result()
        for future in done:  # another arrived at the same moment: put it back
            for sim in self.sims:
                if future.result()["fault"] in sim.jobs:
                    sim.faults.put_nowait(future.result())
        return first


async def bench_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="aegis-scale-"))
    bench = Bench(args, workdir)
    await bench.start()
    results = []
    levels = [int(x) for x in args.levels.split(",")]
    try:
        rss = proc_rss_mb(bench.master.pid)
        print(f"master up, RSS {rss:.0f} MB", flush=True)
        for agents in levels:
            storm = args.storm if agents == max(levels) else 0
            result = await bench.level(agents, storm=min(storm, agents))
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        await bench.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir}")
    return results


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"`python benchmarks/master_scale.py --levels {args.levels} --pods-per-job "
        f"{args.pods_per_job} --sims {args.sims} --steady-s {args.steady_s} --faults "
        f"{args.faults} --storm {args.storm}`",
        "",
        f"{datetime.datetime.now().isoformat(timespec='minutes')}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "| agents | jobs x pods | ramp s | master CPU % | nats CPU % | sims CPU % | load 1m "
        "| beats sent/s | handled/s | lag p50 ms | lag p99 ms | fault->order p50 ms "
        "| p99 ms | master RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['agents']} | {r['jobs']}x{r['pods_per_job']} | {r['ramp_s']:.1f} "
            f"| {r['master_cpu_pct']:.0f} | {r['nats_cpu_pct']:.0f} | {r['sims_cpu_pct']:.0f} "
            f"| {r['load'][0]:.1f}->{r['load'][1]:.1f} | {r['sent_per_s']:.0f} "
            f"| {r['handled_per_s']:.0f} | {r['lag_p50_ms']:.1f} | {r['lag_p99_ms']:.1f} "
            f"| {r['fault_p50_ms']:.0f} | {r['fault_p99_ms']:.0f} | {r['master_rss_mb']:.0f} |"
        )
    for r in results:
        if "storm" in r:
            s = r["storm"]
            lines += ["", f"Storm at {r['agents']} agents: " + json.dumps(s)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,100,1000,5000")
    parser.add_argument("--pods-per-job", type=int, default=50)
    parser.add_argument("--sims", type=int, default=4)
    parser.add_argument("--steady-s", type=float, default=20.0)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--storm", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (master log)")
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="profile the master over the largest level's"
        " steady window (py-spy raw collapsed stacks to this file)",
    )  # fmt: skip
    parser.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--auth-file", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sim:
        sim_main(args)
        return
    results = asyncio.run(bench_main(args))
    text = render(results, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
