#!/usr/bin/env bash
# FP8 recipes, ours beside torchao's, at one model width in one GPU call: the table of issue 54's
# deliverable 5 (tokens/s of every recipe, its ratio to our bf16, peak memory, and the share of the
# step's kernel time spent quantizing).
#
#   tools/fp8_widths.sh WIDTH        # WIDTH: 768 | 2048 | 4096
#
# The model is GPT-2's block (4x GELU MLP) at the record's shapes: 768 is `gpt2_small` (12 layers,
# 12 heads), 2048 has 12 layers and 16 heads, 4096 four layers and 32 heads (Llama 3 8B's width and
# heads with fewer layers, so that it fits one GPU), batch 16 x 1024 tokens. Ours: `train
# configs/gpt2_small.toml` with bf16, FP8 with 1x128 / 128x128 block scales, and FP8 per tensor
# with delayed scaling. Theirs: `tools/peers/nanogpt_char.py` with bf16 autocast and torchao's
# tensorwise, rowwise and blockwise recipes (`torch.compile`).
#
# Speed and memory come from untraced runs. The quantization share comes from a second, traced run
# of each FP8 recipe (CUPTI timeline of three steps through tools/cupti-trace, kinds from
# tools/step_kernels.py); torchao's quantization is fused into `torch.compile`'s kernels, so its
# share counts only the kernels named for amaxes and may be low.
#
# Environment: TRAIN (the release `train` binary; default target/release/train), WORK (scratch;
# default /tmp/fp8_widths), OUT (where logs and the table go; default $WORK), PEER=0 to skip the
# PyTorch runs, TRACE=0 to skip the traced runs, RUNS to run only the runs it names (of ours_bf16,
# ours_fp8_tile, ours_fp8_tensor_delayed, torch_bf16, torchao_tensorwise, torchao_rowwise,
# torchao_blockwise; space-separated; ratios need ours_bf16), STEPS (ours; default 30), PEER_STEPS
# (default 60, the first 20 not timed). torchao must be importable for the peer's FP8 rows (the
# device machines have no torchao: install its wheel first, as the device notes describe).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
width=${1:-}
case "$width" in
768) heads=12; layers=12 ;;
2048) heads=16; layers=12 ;;
4096) heads=32; layers=4 ;;
*) echo "usage: tools/fp8_widths.sh 768|2048|4096" >&2; exit 2 ;;
esac
train=${TRAIN:-$top/target/release/train}
[ -x "$train" ] || { echo "no train binary at $train (cargo build --release --bin train, or set TRAIN)" >&2; exit 2; }
work=${WORK:-/tmp/fp8_widths}
out=${OUT:-$work}
steps=${STEPS:-30}
peer_steps=${PEER_STEPS:-60}
mkdir -p "$work" "$out"
table="$out/fp8_width_$width.md"

shape="--set model.d_model=$width --set model.n_head=$heads --set model.n_layer=$layers"
quiet="--set training.eval_interval=0 --set training.checkpoint_interval=100000"
tensor="--set fp8.scaling=tensor --set fp8.amax_history=16"
peer_shape="--preset gpt2_small --d-model $width --n-head $heads --n-layer $layers"

cupti=""
if [ "${TRACE:-1}" != 0 ]; then
  if tools/cupti-trace/build.sh "$work" > "$work/cupti-build.log" 2>&1; then
    cupti="$work/libcupti_trace.so"
  else
    echo "no CUPTI trace (tools/cupti-trace/build.sh failed; see $work/cupti-build.log): no quantization share"
  fi
fi

# The quantization share of a traced run's kernel time, from step_kernels.py's table.
quant_share() {
  python3 tools/step_kernels.py "$1" --steps 3 --top 0 2>/dev/null |
    awk -F'|' '/FP8 quantization/ { gsub(/ /, "", $4); print $4; found = 1 } END { if (!found) print "0%" }'
}

# Whether RUNS (if set) names this run.
want() { [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $1 "* ]]; }

rows=()
bf16_tps=""
row() { # name tokens/s memory share
  local ratio=""
  [ -n "$bf16_tps" ] && [ -n "$2" ] && ratio=$(python3 -c "print(f'{$2 / $bf16_tps:.3f}x')")
  rows+=("| $1 | ${2:-failed} | $ratio | ${3:-} | ${4:-} |")
}

ours() { # name precision-settings...
  local name=ours_$1; shift
  want "$name" || return 0
  rm -rf "$work/runs"
  timeout 400 "$train" configs/gpt2_small.toml $shape $quiet --set training.steps=$steps "$@" \
    --out "$work/runs/$name" > "$out/$name.log" 2>&1
  local rc=$?
  local tps mem share=""
  tps=$(grep -o 'median [0-9]* tokens/s' "$out/$name.log" | grep -o '[0-9]*' | tail -1)
  mem=$(grep -o 'peak memory [0-9.]* GiB' "$out/$name.log" | grep -o '[0-9.]*' | tail -1)
  [ $rc -ne 0 ] && { echo "$name: rc $rc"; tail -3 "$out/$name.log"; }
  [ "$name" = ours_bf16 ] && bf16_tps=$tps
  if [ -n "$cupti" ] && [ "$name" != ours_bf16 ]; then
    rm -rf "$work/runs"
    CUDA_INJECTION64_PATH=$cupti CUPTI_TRACE_OUT=$work/$name.csv BURNMIX_PROFILE_STEPS=7-9 \
      timeout 300 "$train" configs/gpt2_small.toml $shape $quiet --set training.steps=10 "$@" \
      --out "$work/runs/$name" > "$out/$name.traced.log" 2>&1 &&
      python3 tools/step_kernels.py "$work/$name.csv" --steps 3 --top 8 > "$out/$name.kinds.md" 2>&1 &&
      share=$(quant_share "$work/$name.csv")
    rm -f "$work/$name.csv"
  fi
  row "${name/ours_/ours, }" "$tps" "${mem:+$mem GiB}" "$share"
  echo "$name: ${tps:-failed} tokens/s, peak ${mem:-?} GiB, quantization ${share:-not traced}"
}

peer() { # name nanogpt-flags...
  local name=$1; shift
  want "$name" || return 0
  PYTHONUNBUFFERED=1 timeout 500 python3 tools/peers/nanogpt_char.py $peer_shape \
    --steps "$peer_steps" --warmup 20 "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local tps mem
  tps=$(grep -o '[0-9]* tokens/s' "$out/$name.log" | grep -o '[0-9]*' | tail -1)
  mem=$(grep -o 'peak memory [0-9.]* GiB allocated, [0-9.]* GiB reserved' "$out/$name.log" | tail -1 |
    sed 's/peak memory //')
  [ $rc -ne 0 ] && { echo "$name: rc $rc"; tail -3 "$out/$name.log"; }
  row "$name" "$tps" "$mem" ""
  echo "$name: ${tps:-failed} tokens/s, peak ${mem:-?}"
}

echo "width $width ($layers layers, $heads heads), $train"
ours bf16 --set precision=bf16
ours fp8_tile --set precision=fp8
ours fp8_tensor_delayed --set precision=fp8 $tensor
if [ "${PEER:-1}" != 0 ]; then
  peer torch_bf16
  peer torchao_tensorwise --fp8 tensorwise --fp8-impl torchao
  peer torchao_rowwise --fp8 rowwise --fp8-impl torchao
  peer torchao_blockwise --fp8 blockwise --fp8-impl torchao
fi
rm -rf "$work/runs"
{
  echo "Width $width ($layers layers, $heads heads, 16 x 1024 tokens a step), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| run | tokens/s | against our bf16 | peak memory | quantization, share of kernel time |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$table"
cat "$table"
