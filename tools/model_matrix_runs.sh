#!/usr/bin/env bash
# shakespeare_char for every model path on one GPU, with `train` staged in .gpu/ (see Needs below).
#
#   tools/model_matrix_runs.sh matrix [OUTDIR]  # 300 steps, bf16, every kernels x attention
#                                               # combination side by side (flash needs dropout 0,
#                                               # so plain runs with both dropouts), eval every 50
#   tools/model_matrix_runs.sh bar [OUTDIR]     # to step 2000 (best validation loss near 1750),
#                                               # bf16, dropout 0.2: fused + plain against
#                                               # reference + plain, side by side
#   tools/model_matrix_runs.sh gemm [OUTDIR]    # 300 steps, bf16, fused + flash, dropout 0, with
#                                               # model.gemm = burn and = cublaslt, side by side
#
# Runs in the foreground; each run's log and a table (validation loss at every evaluation, best
# validation loss, median tokens/s) go to OUTDIR (default ./matrix-out). Runs that share the GPU
# slow each other down: the tokens/s here are not speed figures.
#
# Needs: .gpu/ at the repository root, laid out as the staging tool `gpu-stage` (not in this
# repository) writes it: payload.tgz holding bin/train, configs/ and data/tinyshakespeare.txt.
# Nothing in this repository makes .gpu/ (`tools/cuda-suite --stage` packs only the CUDA test
# binary, in another layout), so without gpu-stage the script does not run as it is. By hand:
# `cargo build --release --bin train`, copy it to .gpu/bin/, configs/ to .gpu/configs/ and the
# text to .gpu/data/tinyshakespeare.txt.
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top/.gpu"
[ -d bin ] || tar -xzf payload.tgz
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
mode=${1:-}
out=$(realpath -m "${2:-matrix-out}")
mkdir -p "$out" runs
data="$PWD/data/tinyshakespeare.txt"
[ -f "$data" ] || { echo "model_matrix_runs: $data missing (gpu-stage copies ../shared/data)" >&2; exit 2; }

common=(--set precision=bf16 --set data.path="$data")
declare -a names args
case "$mode" in
matrix)
  steps=(--set training.steps=300 --set training.eval_interval=50 --set training.eval_batches=40 --set training.checkpoint_interval=0)
  names=(ref_plain_d02 fused_plain_d02 ref_plain_d0 fused_plain_d0 ref_flash_d0 fused_flash_d0)
  args=(
    "--set model.kernels=reference --set model.attention=plain --set model.dropout=0.2"
    "--set model.kernels=fused --set model.attention=plain --set model.dropout=0.2"
    "--set model.kernels=reference --set model.attention=plain --set model.dropout=0"
    "--set model.kernels=fused --set model.attention=plain --set model.dropout=0"
    "--set model.kernels=reference --set model.attention=flash --set model.dropout=0"
    "--set model.kernels=fused --set model.attention=flash --set model.dropout=0"
  )
  ;;
bar)
  steps=(--stop-at 2000)
  names=(bar_ref_plain bar_fused_plain)
  args=(
    "--set model.kernels=reference --set model.attention=plain --set model.dropout=0.2"
    "--set model.kernels=fused --set model.attention=plain --set model.dropout=0.2"
  )
  ;;
gemm)
  steps=(--set training.steps=300 --set training.eval_interval=50 --set training.eval_batches=40 --set training.checkpoint_interval=0)
  names=(gemm_burn gemm_cublaslt)
  args=(
    "--set model.kernels=fused --set model.attention=flash --set model.dropout=0 --set model.gemm=burn"
    "--set model.kernels=fused --set model.attention=flash --set model.dropout=0 --set model.gemm=cublaslt"
  )
  ;;
*)
  sed -n 2,17p "$0"
  exit 2
  ;;
esac

pids=()
for i in "${!names[@]}"; do
  n=${names[$i]}
  rm -rf "runs/$n"
  # shellcheck disable=SC2086
  ./bin/train configs/shakespeare_char.toml "${common[@]}" ${args[$i]} "${steps[@]}" --out "runs/$n" >"$out/$n.log" 2>&1 &
  pids+=($!)
done
fail=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "${names[$i]} failed: tail of $out/${names[$i]}.log" >&2; tail -5 "$out/${names[$i]}.log" >&2; fail=1; }
done

python3 - "$out" "${names[@]}" <<'PY' | tee "$out/$(basename "$0" .sh)-$mode.md"
import json, os, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
rows, steps = {}, set()
for n in names:
    path = os.path.join("runs", n, "metrics.jsonl")
    if not os.path.exists(path):
        rows[n] = None
        continue
    recs = [json.loads(l) for l in open(path) if l.strip()]
    vals = {r["step"]: r["val_loss"] for r in recs if r.get("val_loss") is not None}
    steps.update(vals)
    tps = [r["tokens_per_s"] for r in recs[5:]] or [0]
    rows[n] = (vals, statistics.median(tps))
steps = sorted(steps)
print("| run | " + " | ".join(f"val @{s}" for s in steps) + " | best val | median tokens/s (shared GPU) |")
print("|---|" + "---|" * (len(steps) + 2))
for n in names:
    if rows[n] is None:
        print(f"| {n} | no metrics |")
        continue
    vals, tps = rows[n]
    best = min(vals.values()) if vals else float("nan")
    print(f"| {n} | " + " | ".join(f"{vals[s]:.4f}" if s in vals else "-" for s in steps) + f" | {best:.4f} | {tps:,.0f} |")
PY
exit $fail
