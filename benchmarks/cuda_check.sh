#!/usr/bin/env bash
# What to run when a CUDA GPU is at hand, in one short run (at most SECONDS, default 540: 9 minutes):
#   a. the machine's ceilings: device-to-device copy and bf16 / fp32 GEMM rates (beside the cost model's H200's);
#   b. the correctness gate: `pytest -m gpu tests/test_gpu.py`, then tests/test_dcmha_triton.py on CUDA;
#   c. one attention call at the Pythia-160M shape (8 x 1024 tokens, 12 heads of 64) and the DCPythia-6.9B shape
#      (1 x 2048, 32 heads of 128), global and with a window of 256: SDPA against "triton" in chunks of 128, 256,
#      512 and T queries, forward and fwd+bwd, with benchmarks/cost_model.py's prediction (at the rates of a) and
#      the peak memory;
#   d. the whole model at both shapes (12 layers of 160M, 4 layers of 6.9B) against GPT-NeoX: prefill and fwd+bwd
#      with "triton", decoding with "auto" (eager decoding steps), plainly and with the static cache through a
#      compiled forward;
#   e. where the 6.9B shape's attention time goes: the cuBLAS products against each Triton kernel (torch.profiler's
#      kernel names), beside the cost model's prediction of each.
#
#     bash benchmarks/cuda_check.sh OUTDIR [SECONDS [STEP,STEP,...]]
#
# Each step runs under its own time limit (their sum fits the default budget): a step that fails or runs out of
# time is reported and the next one starts. Everything goes to OUTDIR/cuda_check.log; stdout gets each step's result
# lines (its tables). JSON under OUTDIR: ceilings.json, attention.json, attention-split.json, model-160m.json,
# model-6.9b.json, the tests' JUnit XML (gpu-tests.xml, triton-tests.xml), and steps.json (each step's exit code and
# seconds). Needs the package installed (pip install -e ".[test]") and a GPU with 24 GB free.
set -u
out=${1:?usage: bash benchmarks/cuda_check.sh OUTDIR [SECONDS [STEP,STEP,...]]}
budget=${2:-540}
only=${3:-}  # run only these steps (their names below)
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/cuda_check.log"
cd "$(dirname "$0")/.."
end=$(($(date +%s) + budget))
records=()

record() {  # record NAME RC SECONDS LIMIT: OUTDIR/steps.json rewritten with one more step
    records+=("{\"step\": \"$1\", \"rc\": $2, \"seconds\": $3, \"limit\": $4}")
    local IFS=,
    echo "[${records[*]}]" >"$out/steps.json"
}

step() {  # step NAME LIMIT_SECONDS COMMAND...: run it, its output to the log, its result lines to stdout
    local name=$1 limit=$2 left rc t0
    shift 2
    [[ -n $only && ",$only," != *",$name,"* ]] && return
    left=$((end - $(date +%s)))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped (the time budget is spent)"
        record "$name" null 0 0
        return
    fi
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    t0=$(date +%s)
    PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "   rc $rc in $(($(date +%s) - t0)) s$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$log"
    record "$name" "$rc" "$(($(date +%s) - t0))" "$limit"
    sed -n "/^== $name /,\$p" "$log" | grep -E "$results" | tail -n 60
}
# result lines: the benchmarks' tables and headers, their notes, pytest's summary, failures and errors
results='^(\| |- | *(prefill|decode|train|step|peak)|[a-z0-9.-]+ x[0-9]|max \|output|first calls'
results+='|FAILED|ERROR|SKIPPED|[0-9]+ (passed|failed)|.*Error:)'

bench=benchmarks
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 100")  # a slow test fails, the rest run
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist load")  # compiling is CPU work: 4 at a time
shapes="--shapes pythia-160m,dcpythia-6.9b,dcpythia-6.9b@w256"
# a. (also the versions: GPU, torch, triton, transformers)
step ceilings 25 python3 $bench/bench_attention.py --device cuda --measure-ceilings --json "$out/ceilings.json"
# b. the GPU tests (every backend on CUDA), then the Triton kernels against the oracle on CUDA (the resource gate,
# which compiles for sm_90 without a GPU, is left to the CPU runs)
step gpu-tests 125 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $per_test $workers \
    --junitxml "$out/gpu-tests.xml" tests/test_gpu.py
step triton-tests 70 python3 -m pytest -q -rfE -p no:cacheprovider $per_test $workers -k "not resource_gate" \
    --junitxml "$out/triton-tests.xml" tests/test_dcmha_triton.py
# c. the attention call alone: SDPA against "triton" at each chunk size, measured against predicted
step attention 100 python3 $bench/bench_attention.py --device cuda --dtype bf16 --scope attention $shapes \
    --implementations triton --chunks 128,256,512,T --repeats 10 --ceilings "$out/ceilings.json" \
    --json "$out/attention.json"
# d. the whole model against GPT-NeoX (decode-static last: its compilation is the slowest part)
step model-160m 90 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-160m --layers 12 \
    --vocab 50304 --dtype bf16 --phases prefill,train,decode,decode-static --seq-len 1024 --batch 8 \
    --decode-new 16 --repeats 5 --implementation triton --decode-implementation auto --json "$out/model-160m.json"
step model-6.9b 90 python3 $bench/profile_shapes.py --device cuda --preset dcpythia-pythia-6.9b --layers 4 \
    --vocab 50432 --dtype bf16 --phases prefill,train,decode,decode-static --seq-len 2048 --decode-prompt 16 \
    --decode-new 16 --repeats 5 --implementation triton --decode-implementation auto --json "$out/model-6.9b.json"
# e. the 6.9B shape's attention by kernel: cuBLAS products against the Triton kernels (the budget's chunks)
step attention-split 30 python3 $bench/bench_attention.py --device cuda --dtype bf16 --scope attention \
    --shapes dcpythia-6.9b --implementations triton --repeats 3 --profile --ceilings "$out/ceilings.json" \
    --json "$out/attention-split.json"
echo "== done; the whole log: $log; the steps: $out/steps.json"
