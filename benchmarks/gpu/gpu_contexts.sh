#!/usr/bin/env bash
# Which processes of an `aegis run` hold a CUDA context on the GPU (nvidia-smi's compute apps,
# sampled every second beside the run, matched to their command lines), after a probe of what
# each step of torch's start does (import, is_available, get_device_name: libcuda mapped, CUDA
# initialised, a context). Then two ranks under torchrun in one pod (gloo on the one GPU) with
# DCP saves of CUDA tensors into shared memory and a crash of rank 1. Same set-up as
# cuda_recovery.sh (.whl/ on a lent machine).
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || exit 9
    export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
fi
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr '\n' ' '; }
DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-nccl}
[ "$DEVICE" = cuda ] && $PY - <<'PY'
import os, subprocess
def apps():
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"], capture_output=True, text=True).stdout
    return out.strip().replace("\n", "; ") or "none"
def mapped():
    with open("/proc/self/maps") as maps:
        return any("libcuda.so" in line for line in maps)
print("probe pid", os.getpid())
import torch
print("import torch: libcuda mapped", mapped(), "initialized", torch.cuda.is_initialized(), "contexts:", apps())
torch.cuda.is_available()
print("is_available: libcuda mapped", mapped(), "initialized", torch.cuda.is_initialized(), "contexts:", apps())
torch.cuda.device_count(); torch.cuda.nccl.version(); torch.backends.cudnn.version()
print("count/nccl/cudnn: initialized", torch.cuda.is_initialized(), "contexts:", apps())
torch.cuda.get_device_name(0)
print("get_device_name: initialized", torch.cuda.is_initialized(), "contexts:", apps())
torch.zeros(1, device="cuda")
print("a tensor: contexts:", apps())
PY
runs=$(mktemp -d /tmp/aegis-ctx-XXXXXX)
mkdir -p "$runs/warm" "$runs/torchrun"
( while :; do
    echo "t $(date +%s.%N) $(apps)"
    ps -eo pid=,ppid=,rss=,args= | grep -E "aegis|zygote|cuda_train|torchrun|forkserver" | grep -v grep
    sleep 1
  done >"$runs/samples.txt" 2>&1 ) &
sampler=$!
timeout 240 $PY -m aegis run --nodes 1 --spare-nodes 0 --view plain --log-dir "$runs/warm/logs" -- \
    $PY benchmarks/gpu/cuda_train.py "$runs/warm" "$runs/warm/ckpt" --steps 200 --crash-at 150 \
    --ckpt-every 25 --device "$DEVICE" --backend "$BACKEND" >"$runs/warm/run.log" 2>&1
echo "warm: exit $?; $(tail -1 "$runs/warm/run.log")"
kill $sampler
$PY - "$runs/samples.txt" <<'PY'
import re, sys
held, commands = {}, {}
for line in open(sys.argv[1]):
    if line.startswith("t "):
        for pid, mib in re.findall(r"(\d+), (\d+) MiB", line):
            held[pid] = max(held.get(pid, 0), int(mib))
    else:
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[0].isdigit() and parts[2].isdigit():
            commands[parts[0]] = f"ppid {parts[1]} rss {int(parts[2]) // 1024} MiB: {parts[3].strip()[:150]}"
print("processes that held GPU memory during the run:")
for pid, mib in sorted(held.items()):
    print(f"  {pid}: {mib} MiB; {commands.get(pid, '?')}")
print("aegis processes seen (pid: command):")
for pid, what in sorted(commands.items(), key=lambda kv: int(kv[0])):
    if pid not in held:
        print(f"  {pid}: {what}")
PY
timeout 240 $PY -m aegis run --nodes 1 --spare-nodes 0 --view plain --log-dir "$runs/torchrun/logs" -- \
    $PY -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu/cuda_train.py "$runs/torchrun" \
    "$runs/torchrun/ckpt" --backend gloo --dcp --crash-rank 1 --steps 200 --crash-at 150 \
    --ckpt-every 25 --device "$DEVICE" >"$runs/torchrun/run.log" 2>&1
echo "torchrun: exit $?; $(tail -1 "$runs/torchrun/run.log")"
$PY benchmarks/gpu/summarize_cuda.py "$runs"
rm -rf "$runs"/*/ckpt "$runs"/*/logs/checkpoints
tar -czf "${OUT:-/tmp}/contexts.tar.gz" -C "$runs" .
