#!/usr/bin/env bash
# CUDA training under `aegis run` on a real GPU (benchmarks/gpu/cuda_train.py, a script that never
# imports aegis): a warm restart after a crash (the zygote never initialises CUDA; its child
# does) beside a cold one, NCCL, and DCP saves of CUDA tensors into shared memory that the
# restarted ranks load back bit for bit, also from two ranks of one pod under torchrun (gloo:
# two NCCL ranks cannot share the one GPU). RUNS="1 4" runs only those. Prints one summary line a run
# (benchmarks/gpu/summarize_cuda.py) and leaves every record in $OUT/cuda-runs.tar.gz.
# On a lent machine: the wheels of Aegis's dependencies that it lacks in .whl/ (RESULTS.md says
# which). Here, for a try on the CPU: DEVICE=cpu BACKEND=gloo WIDTH=256 PY=.venv/bin/python.
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 9
    export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH
fi
DEVICE=${DEVICE:-cuda} BACKEND=${BACKEND:-nccl} WIDTH=${WIDTH:-2048}
runs=$(mktemp -d /tmp/aegis-cuda-XXXXXX)
command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

run() {  # NAME NODES PREWARM ARGS...: one `aegis run` of cuda_train.py ($LAUNCH: how)
    local name=$1 nodes=$2 prewarm=$3
    shift 3
    [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" ${name%%-*} "* ]] || return 0
    mkdir -p "$runs/$name"
    timeout 240 $PY -m aegis run --nodes "$nodes" --spare-nodes 0 --view plain -v \
        --prewarm "$prewarm" --log-dir "$runs/$name/logs" -- \
        ${LAUNCH:-$PY} benchmarks/gpu/cuda_train.py "$runs/$name" "$runs/$name/ckpt" \
        --device "$DEVICE" --width "$WIDTH" --steps 200 --ckpt-every 25 --crash-at 150 "$@" \
        >"$runs/$name/run.log" 2>&1
    echo "$name: aegis run exit $?; $(tail -1 "$runs/$name/run.log")"
}

run 1-warm 1 auto --backend "$BACKEND"
run 2-cold 1 0 --backend "$BACKEND"
run 3-dcp-warm 1 auto --backend "$BACKEND" --dcp
LAUNCH="$PY -m torch.distributed.run --nproc-per-node 2" \
    run 4-dcp-torchrun-2ranks 1 auto --backend gloo --dcp --crash-rank 1
$PY benchmarks/gpu/summarize_cuda.py "$runs"
rm -rf "$runs"/*/ckpt "$runs"/*/logs/checkpoints
tar -czf "${OUT:-/tmp}/cuda-runs.tar.gz" -C "$runs" .
