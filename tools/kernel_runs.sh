#!/usr/bin/env bash
# Fused-kernel measurements on a GPU machine, with binaries staged in .gpu/ (see Needs below;
# `gpu-stage --bins "train kernel_bench" --tests cuda`).
#
#   tools/kernel_runs.sh all [STEPS]  # one after another, alone on the GPU: the staged CUDA tests,
#                                     # kernel_bench (bf16, f16, f32), then gpt2_small under bf16 with
#                                     # kernels = reference and = fused (STEPS steps each, default 30),
#                                     # whole-GPU memory sampled every 200 ms
#   tools/kernel_runs.sh status       # what has finished, the tail of each log
#
# Runs in the background (setsid) and touches logs/all.done at the end. Runs and logs live in
# $KERNEL_WORK (default /tmp/kernels), linked from .gpu/, so re-staging .gpu/ does not delete them.
#
# Needs: .gpu/ at the repository root, laid out as the staging tool `gpu-stage` (not in this
# repository) writes it: payload.tgz holding bin/ (train, kernel_bench, the test binaries),
# configs/ and data/, and run.sh, which runs the staged test binaries with --include-ignored.
# Nothing in this repository makes .gpu/ (`tools/cuda-suite --stage` packs only the CUDA test
# binary, in another layout), so without gpu-stage the script does not run as it is. By hand:
# `cargo build --release --bins`, copy train and kernel_bench to .gpu/bin/ and configs/ to
# .gpu/configs/, and run `all` with NOTESTS=1 (there is no run.sh; run the CUDA suite with
# tools/cuda-suite).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top/.gpu"
[ -d bin ] || tar -xzf payload.tgz
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} SHARED_DATA="$PWD/data"
work=${KERNEL_WORK:-/tmp/kernels}
mkdir -p "$work/runs" "$work/logs"
[ -e runs ] || ln -s "$work/runs" runs
[ -e logs ] || ln -s "$work/logs" logs

mode=${1:-}; shift || true
case "$mode" in
all)
  steps=${1:-30}
  setsid bash -c '
    [ "${NOTESTS:-0}" = 1 ] || ./run.sh > logs/tests.log 2>&1
    ./bin/kernel_bench --dtypes bf16,f16,f32 > logs/bench.md 2> logs/bench.err
    for k in reference fused; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > logs/g2_${k}_mem.csv &
      smi=$!
      ./bin/train configs/gpt2_small.toml --set precision=bf16 --set model.kernels=$k --set training.steps='"$steps"' \
        --set training.eval_interval=0 --set training.eval_batches=1 --out runs/g2_$k > logs/g2_$k.log 2>&1
      kill $smi
      echo "g2_$k peak_mib $(sort -n logs/g2_${k}_mem.csv | tail -1)" >> logs/speed_summary.txt
    done
    echo done > logs/all.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "started";;
status)
  ls logs/*.done 2>/dev/null
  for f in logs/*.log logs/*.err; do [ -e "$f" ] && { echo "== $f"; tail -n 3 "$f"; }; done
  cat logs/speed_summary.txt 2>/dev/null;;
*) sed -n 2,14p "$0"; exit 2;;
esac
