#!/usr/bin/env bash
# Precision-recipe measurements on a GPU machine, with binaries staged by `gpu-stage` in .gpu/.
#
#   tools/precision_runs.sh quality   # shakespeare_char to step 2500 under fp32, bf16, fp16 and
#                                     # fp16 without loss scaling, the four runs side by side,
#                                     # plus the CUDA test binary; in the background
#   tools/precision_runs.sh speed     # gpt2_small, 40 steps per recipe, one run at a time, with
#                                     # whole-GPU memory sampled every 200 ms; in the background
#   tools/precision_runs.sh status    # what is running, the tail of each log
#   tools/precision_runs.sh collect D # copy logs, metrics, summaries and plots into D
#
# shakespeare_char's schedule ends at schedule.decay_steps = 5000 whatever training.steps is, so a
# run stopped at 2500 (--stop-at) follows the full run's trajectory; its best validation loss comes
# at about step 1750.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top/.gpu"
[ -d bin ] || tar -xzf payload.tgz
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} SHARED_DATA="$PWD/data"
# Runs and logs live outside .gpu/ so that re-staging .gpu/ does not delete them mid-run.
work=${PRECISION_WORK:-/tmp/precision}
mkdir -p "$work/runs" "$work/logs"
ln -sfn "$work/runs" runs
ln -sfn "$work/logs" logs

case "${1:-}" in
quality)
  setsid bash -c '
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader -lms 1000 > logs/quality_mem.csv &
    smi=$!
    for p in fp32 bf16 fp16; do
      ./bin/train configs/shakespeare_char.toml --set precision=$p --stop-at 2500 --out runs/sh_$p > logs/sh_$p.log 2>&1 &
      echo "$! sh_$p" >> logs/pids
    done
    ./bin/train configs/shakespeare_char.toml --set precision=fp16 --set loss_scale.mode=off --stop-at 2500 \
      --out runs/sh_fp16_noscale > logs/sh_fp16_noscale.log 2>&1 &
    echo "$! sh_fp16_noscale" >> logs/pids
    ./run.sh > logs/tests.log 2>&1 &
    wait $(jobs -p | grep -v "^$smi$")
    kill $smi
    echo done > logs/quality.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "quality runs started";;
speed)
  setsid bash -c '
    for p in fp32 bf16 fp16; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > logs/g2_${p}_mem.csv &
      smi=$!
      ./bin/train configs/gpt2_small.toml --set precision=$p --set training.steps=40 --set training.eval_interval=0 \
        --set training.eval_batches=1 --out runs/g2_$p > logs/g2_$p.log 2>&1
      kill $smi
      echo "g2_$p peak_mib $(sort -n logs/g2_${p}_mem.csv | tail -1)" >> logs/speed_summary.txt
    done
    echo done > logs/speed.done
  ' > /dev/null 2>&1 < /dev/null &
  echo "speed runs started";;
status)
  ls logs/*.done 2>/dev/null
  for f in logs/*.log; do echo "== $f"; tail -n 3 "$f"; done
  cat logs/speed_summary.txt 2>/dev/null;;
collect)
  out=$2; mkdir -p "$out"
  cp -r logs "$out/"
  for d in runs/*/; do
    n=$(basename "$d"); mkdir -p "$out/$n"
    cp "$d"/metrics.jsonl "$d"/summary.json "$d"/loss.svg "$d"/precision.json "$out/$n/" 2>/dev/null
  done;;
*) sed -n 2,16p "$0"; exit 2;;
esac
