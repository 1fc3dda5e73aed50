#!/usr/bin/env bash
# Precision-recipe measurements on a GPU machine, with binaries staged in .gpu/ (see Needs below).
#
#   tools/precision_runs.sh quality [RUN...]  # shakespeare_char to step 2500, the runs side by side,
#                                             # plus the CUDA test binary unless NOTESTS=1. RUN is
#                                             # fp32 | bf16 | fp16 | fp16_noscale (default: all four)
#   tools/precision_runs.sh speed [RECIPE...] # gpt2_small, 40 steps per recipe, one run at a time,
#                                             # whole-GPU memory sampled every 200 ms
#   tools/precision_runs.sh timing [RECIPE...] # shakespeare_char, 300 steps per recipe, one at a time
#   tools/precision_runs.sh status            # what has finished, the tail of each log
#
# Each mode runs in the background (setsid) and touches logs/MODE.done at the end. Runs and logs are
# kept in $PRECISION_WORK (default /tmp/precision), linked from .gpu/, so that re-staging .gpu/ does
# not delete them mid-run.
#
# shakespeare_char's schedule ends at schedule.decay_steps = 5000 whatever training.steps is, so a
# run stopped at 2500 (--stop-at) follows the full run's trajectory; its best validation loss comes
# at about step 1500-1750.
#
# Needs: .gpu/ at the repository root, laid out as the staging tool `gpu-stage` (not in this
# repository) writes it: payload.tgz holding bin/ (train, the test binaries), configs/ and
# data/tinyshakespeare.txt, and run.sh, which runs the staged test binaries with
# --include-ignored (`quality` runs it unless NOTESTS=1). Nothing in this repository makes .gpu/
# (`tools/cuda-suite --stage` packs only the CUDA test binary, in another layout), so without
# gpu-stage the script does not run as it is. By hand: `cargo build --release --bin train`, copy
# it to .gpu/bin/, configs/ to .gpu/configs/ and the text to .gpu/data/tinyshakespeare.txt, and
# run `quality` with NOTESTS=1 (there is no run.sh; run the CUDA suite with tools/cuda-suite).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top/.gpu"
[ -d bin ] || tar -xzf payload.tgz
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} SHARED_DATA="$PWD/data"
work=${PRECISION_WORK:-/tmp/precision}
mkdir -p "$work/runs" "$work/logs"
[ -e runs ] || ln -s "$work/runs" runs
[ -e logs ] || ln -s "$work/logs" logs

mode=${1:-}; shift || true
case "$mode" in
quality)
  runs=${*:-fp32 bf16 fp16 fp16_noscale}
  setsid bash -c '
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader -lms 1000 > logs/quality_mem.csv &
    smi=$!
    pids=""
    for r in '"$runs"'; do
      a=$(case $r in fp16_noscale) echo "--set precision=fp16 --set loss_scale.mode=off";; *) echo "--set precision=$r";; esac)
      ./bin/train configs/shakespeare_char.toml $a --stop-at 2500 --out runs/sh_$r > logs/sh_$r.log 2>&1 &
      pids="$pids $!"; echo "$! sh_$r" >> logs/pids
    done
    if [ "${NOTESTS:-0}" != 1 ]; then ./run.sh > logs/tests.log 2>&1 & pids="$pids $!"; fi
    wait $pids
    kill $smi
    echo done > logs/quality.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "quality runs started: $runs";;
speed)
  recipes=${*:-fp32 bf16 fp16}
  setsid bash -c '
    for p in '"$recipes"'; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > logs/g2_${p}_mem.csv &
      smi=$!
      ./bin/train configs/gpt2_small.toml --set precision=$p --set training.steps=40 --set training.eval_interval=0 \
        --set training.eval_batches=1 --out runs/g2_$p > logs/g2_$p.log 2>&1
      kill $smi
      echo "g2_$p peak_mib $(sort -n logs/g2_${p}_mem.csv | tail -1)" >> logs/speed_summary.txt
    done
    echo done > logs/speed.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "speed runs started: $recipes";;
timing)
  recipes=${*:-fp32 bf16 fp16}
  setsid bash -c '
    for p in '"$recipes"'; do
      ./bin/train configs/shakespeare_char.toml --set precision=$p --set training.steps=300 --set training.eval_interval=0 \
        --set training.eval_batches=1 --out runs/tm_$p > logs/tm_$p.log 2>&1
    done
    echo done > logs/timing.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "timing runs started: $recipes";;
status)
  ls logs/*.done 2>/dev/null
  for f in logs/*.log; do echo "== $f"; tail -n 2 "$f"; done
  cat logs/speed_summary.txt 2>/dev/null;;
*) sed -n 2,20p "$0"; exit 2;;
esac
