#!/usr/bin/env bash
# Aegis GPU-only paths on a real GPU: the gpu check (NVML), runtime (CUDA), allreduce_connect and
# allreduce_perf with NCCL (one rank on the one GPU), through the same code the agent runs.
# Needs the msgspec wheel for the machine's Python in .whl/ (pip download ... -d .whl msgspec).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD/src
{
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,temperature.gpu,ecc.errors.uncorrected.volatile.total,retired_pages.pending --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'avail', torch.cuda.is_available())"
python3 - <<'PY'
import asyncio
from aegis.checks import base, gpu, group, local
need = base.CheckSettings(require_gpu=True, expect_cuda=True)
print("gpu:", asyncio.run(gpu.gpu_check(need)))
print("gpu, 2 expected:", asyncio.run(gpu.gpu_check(base.CheckSettings(require_gpu=True, gpu_count=2))))
print("runtime:", asyncio.run(local.runtime_check(need)))
print("runtime, no CUDA expected:", asyncio.run(local.runtime_check(base.CheckSettings(expect_cuda=False))))
solo = base.CheckSettings(require_gpu=True, expect_cuda=True, group=group.solo_group())
print("allreduce_connect:", asyncio.run(group.allreduce_connect_check(solo)))
print("allreduce_perf:", asyncio.run(group.allreduce_perf_check(solo)))
reader = gpu.RealNvml()
snap = reader.read()
print("snapshot:", snap)
PY
port=$(python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
python3 -m aegis.checks.collective connect,perf --rank 0 --world-size 1 --master-addr 127.0.0.1 --master-port "$port"
echo "collective exit $?"
} 2>&1 | tee "$OUT/gpu_check.log"
