#!/usr/bin/env bash
# Everything that needs a GPU, in one command for a lent, bare CUDA machine (no network): the profile
# of ten decoding steps beside `generate`, `pytest tests/gpu`, then `make bench-gpu`'s table (and,
# as `static`, the compiled static-cache peer, whose compilation takes minutes, at batch 32). Each
# part has its own time limit, and a part that fails does not stop the next. Outputs go to $OUT
# (default ./gpu-out): logs, the table as JSON, the batch-1 traces.
#
# What it needs beside the checkout, prepared on a machine with network access:
#   .whl/   wheels for the machine's Python that its image lacks, installed with --no-deps into
#           /tmp/site (see bench/README.md, "On a lent GPU": the list and the pip download line);
#   .gpu/   the built-in model's tokenizer folder (smollm2-135m/ without its weights: the GPU tier
#           and the benchmarks build random models with its tokenizer) and optionally gsm8k.jsonl.
#
#   bash bench/gpu_session.sh [profile|tests|bench|static ...]     # default: profile tests bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -d .gpu/smollm2-135m ]; then
    mkdir -p ~/.cache/actq/models && cp -r .gpu/smollm2-135m ~/.cache/actq/models/
fi
GSM8K=()
[ -f .gpu/gsm8k.jsonl ] && GSM8K=(--gsm8k .gpu/gsm8k.jsonl)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(profile tests bench)
status=0
for part in "${parts[@]}"; do
    echo "=== $part"
    case $part in
        profile) timeout "${PROFILE_S:-150}" $PY bench/profile_gpu.py --batch 1 32 "${GSM8K[@]}" --out "$OUT" \
            2>&1 | grep -v "profiler_st" | tee "$OUT/profile.log" ;;
        tests) timeout "${TESTS_S:-200}" $PY -m pytest tests/gpu -q -p no:cacheprovider -x --timeout 150 \
            2>&1 | tee "$OUT/tests.log" ;;
        bench) timeout "${BENCH_S:-300}" $PY bench/bench_gpu.py "${GSM8K[@]}" --json "$OUT/bench_gpu.json" --store /tmp/actq-store \
            ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
        static) timeout "${STATIC_S:-200}" $PY bench/bench_gpu.py "${GSM8K[@]}" --json "$OUT/bench_static.json" \
            --arms generate static graphs ${STATIC_ARGS:---batches 32} 2>&1 | tee "$OUT/static.log" ;;
        *) echo "unknown part $part (profile, tests, bench, static)"; false ;;
    esac
    rc=$?
    echo "=== $part: exit $rc"
    [ $rc -ne 0 ] && status=$rc
done
exit $status
