#!/usr/bin/env bash
# FlashAttention measurements on a GPU machine, with binaries staged in .gpu/ (see Needs below;
# `gpu-stage --bins "train attention_bench" --tests cuda`).
#
#   tools/attention_runs.sh all [STEPS]  # one after another, alone on the GPU: the staged CUDA
#                                        # tests, attention_bench (bf16; memory at S=16384), then
#                                        # gpt2_small under bf16 with attention = plain and = flash
#                                        # (STEPS steps each, default 30), GPU memory sampled
#   tools/attention_runs.sh status       # what has finished, the tail of each log
#
# Runs in the background (setsid) and touches logs/all.done at the end. Runs and logs live in
# $ATTN_WORK (default /tmp/attention), linked from .gpu/, so re-staging .gpu/ does not delete them.
#
# Needs: .gpu/ at the repository root, laid out as the staging tool `gpu-stage` (not in this
# repository) writes it: payload.tgz holding bin/ (train, attention_bench, the test binaries),
# configs/ and data/, and run.sh, which runs the staged test binaries with --include-ignored.
# Nothing in this repository makes .gpu/ (`tools/cuda-suite --stage` packs only the CUDA test
# binary, in another layout), so without gpu-stage the script does not run as it is. By hand:
# `cargo build --release --bins`, copy train and attention_bench to .gpu/bin/ and configs/ to
# .gpu/configs/, and run `all` with NOTESTS=1 (there is no run.sh; run the CUDA suite with
# tools/cuda-suite).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top/.gpu"
[ -d bin ] || tar -xzf payload.tgz
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} SHARED_DATA="$PWD/data"
work=${ATTN_WORK:-/tmp/attention}
mkdir -p "$work/runs" "$work/logs"
[ -e runs ] || ln -s "$work/runs" runs
[ -e logs ] || ln -s "$work/logs" logs

mode=${1:-}; shift || true
case "$mode" in
all)
  steps=${1:-30}
  setsid bash -c '
    [ "${NOTESTS:-0}" = 1 ] || ./run.sh > logs/tests.log 2>&1
    ./bin/attention_bench --memory > logs/memory.md 2> logs/memory.err
    ./bin/attention_bench ${BENCH_ARGS:-} > logs/bench.md 2> logs/bench.err
    for a in plain flash; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > logs/g2_${a}_mem.csv &
      smi=$!
      ./bin/train configs/gpt2_small.toml --set precision=bf16 --set model.attention=$a --set training.steps='"$steps"' \
        --set training.eval_interval=0 --set training.eval_batches=1 --out runs/g2_$a > logs/g2_$a.log 2>&1
      kill $smi
      echo "g2_$a peak_mib $(sort -n logs/g2_${a}_mem.csv | tail -1)" >> logs/speed_summary.txt
    done
    echo done > logs/all.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "started";;
status)
  ls logs/*.done 2>/dev/null
  for f in logs/*.log logs/*.err logs/*.md; do [ -e "$f" ] && { echo "== $f"; tail -n 4 "$f"; }; done
  cat logs/speed_summary.txt 2>/dev/null;;
*) sed -n 2,12p "$0"; exit 2;;
esac
