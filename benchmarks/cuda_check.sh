#!/usr/bin/env bash
# What to run when a CUDA GPU is at hand, in one go: the GPU tests, then DCFormer against GPT-NeoX of the same shape
# in bf16 and fp32 (Pythia-160M, 4 layers of DCPythia-6.9B, compare_small's training step, attention layers).
#
#     bash benchmarks/cuda_check.sh OUTDIR [SECONDS [STEP,STEP,...]]
#
# Steps run in order of importance, each under its own time limit and all within SECONDS (default 540): a step that
# fails or runs out of time is reported and the next one starts. Everything goes to OUTDIR/cuda_check.log; stdout
# gets each step's result lines. Needs the package installed (pip install -e ".[test]") and a GPU with 24 GB free.
set -u
out=${1:?usage: bash benchmarks/cuda_check.sh OUTDIR [SECONDS]}
budget=${2:-540}
only=${3:-}  # run only these steps (their names below)
mkdir -p "$out"
log="$out/cuda_check.log"
cd "$(dirname "$0")/.."
end=$(($(date +%s) + budget))

step() {  # step NAME LIMIT_SECONDS COMMAND...: run it, its output to the log, its result lines to stdout
    local name=$1 limit=$2 left rc t0
    shift 2
    [[ -n $only && ",$only," != *",$name,"* ]] && return
    left=$((end - $(date +%s)))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped (the time budget is spent)"
        return
    fi
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    t0=$(date +%s)
    PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "   rc $rc in $(($(date +%s) - t0)) s$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$log"
    # result lines: the benchmarks' tables and headers, pytest's summary, failures and errors
    sed -n "/^== $name /,\$p" "$log" | grep -E '^(\| |- |  *(prefill|decode|train|peak|forward|fwd\+bwd)|[a-z0-9.-]+ x[0-9]|training step|  *[0-9]+/[0-9]|size |T=|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|    [a-zA-Z_:]+ .* calls|    total|.*Error:|device|GPU|torch |triton |transformers )' | tail -n 40
}

bench=benchmarks
# Run 1 (2026-11-26): "compiled" (then "auto" on CUDA) launch-bound, 13x GPT-NeoX's prefill time. Run 2 (11-28):
# "triton" 5.6-11x in prefill and training, its kernels nearly all of it; "auto" now runs "triton" for large calls
# and "eager" for decoding steps. So prefill and training time "triton" (the same as "auto" there), decoding times
# "auto" and "triton" side by side (is "eager" or "triton" the better decoding step on a GPU?), and the profile of
# the Triton kernels comes early.
dc="--implementation triton"
step env 30 python3 -c "import torch, triton, transformers; print('GPU', torch.cuda.get_device_name(), '| torch', \
torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")  # a slow test fails, the rest run
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist load")  # compiling is CPU work: 4 at a time
step gpu-tests 220 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $per_test $workers tests/test_gpu.py
# Pythia-160M (12 layers), batch 8 x 1024 tokens: prefill and a training step (no optimizer)
step 160m-bf16 50 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype bf16 --phases prefill,train --seq-len 1024 --batch 8 --repeats 5 $dc
# 4 layers of DCPythia-6.9B's shape (vocabulary 50432): prefill of 2048 tokens and a training step
step 6.9b-bf16 50 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-6.9b --layers 4 \
    --vocab 50432 --dtype bf16 --phases prefill,train --seq-len 2048 --repeats 5 $dc
# 16 new tokens: "auto" (eager decoding steps) against "triton"
step 160m-bf16-decode 45 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype bf16 --phases decode --batch 8 --decode-new 16 --repeats 5 --implementation auto,triton
step 6.9b-bf16-decode 45 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-6.9b --layers 4 \
    --vocab 50432 --dtype bf16 --phases decode --decode-prompt 16 --decode-new 16 --repeats 5 \
    --implementation auto,triton
# where the time goes (torch.profiler's kernel times)
step 160m-bf16-profile 45 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype bf16 --phases prefill,train --seq-len 1024 --batch 8 --repeats 3 --profile --rows 12 $dc
# the Triton kernels' tiles (BLOCK_T queries x BLOCK_S keys; 16 x 16 by default): a tile that does not fit is left out
step 160m-bf16-triton-tiles 60 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m \
    --layers 12 --vocab 50304 --dtype bf16 --phases prefill,train --seq-len 1024 --batch 8 --repeats 3 \
    --implementation triton,triton@32x16,triton@16x32,triton@32x32,triton@64x16
step 6.9b-bf16-triton-tiles 45 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-6.9b \
    --layers 4 --vocab 50432 --dtype bf16 --phases prefill,train --seq-len 2048 --repeats 3 \
    --implementation triton,triton@32x16,triton@16x32
step 160m-fp32 50 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype fp32 --phases prefill,train --seq-len 1024 --batch 8 --repeats 5 $dc
step 6.9b-fp32 50 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-6.9b --layers 4 \
    --vocab 50432 --dtype fp32 --phases prefill,train --seq-len 2048 --repeats 5 $dc
step train-step-small 45 python3 $bench/bench_train_step.py --device cuda --repeats 10
# "compiled" with one chunk a layer, the other candidate: its training step never finished within a limit (Inductor)
step 160m-bf16-compiled 60 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype bf16 --phases train,prefill --seq-len 1024 --batch 8 --repeats 3 \
    --attention-chunk-size 1024 --implementation triton,compiled
# one attention layer, each DCMHA implementation against SDPA
step attention-160m-bf16 60 python3 $bench/bench_attention.py --device cuda --dtype bf16 --seq-lens 1024,4096 \
    --repeats 10
echo "== done; the whole log: $log"
