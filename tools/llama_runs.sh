#!/usr/bin/env bash
# The Llama presets beside Hugging Face's LlamaForCausalLM on one GPU, in one call: for each preset
# and recompute mode, our `train` (STEPS steps, default 30) and the peer (tools/peers/llama_hf.py:
# SDPA, torch.compile, bf16 autocast, fused AdamW, torch.utils.checkpoint for "full") at the same
# shape, batch and context; then one table of tokens/s, MFU and peak memory reserved.
#
#   tools/llama_runs.sh TRAIN_BINARY [PRESET[:BATCH] ...]     (default: llama_1b:4)
#   MODES="none full" STEPS=30 PEER=1 tools/llama_runs.sh ...  (PEER=0 skips the peer)
#   OURS_GPU=0 PEER_GPU=1 tools/llama_runs.sh ...  (two GPUs: ours and the peer's runs side by side,
#                                                  each alone on its GPU; default both on GPU 0,
#                                                  one after another)
#
# Runs on a GPU machine with the repository's configs/ and tools/ (and a `train` binary built with
# `cargo build --release -p trainer --bin train`); each run in its own directory under
# ${LLAMA_WORK:-/tmp/llama} with a CubeCL kernel cache of its own. MFU is against 989.5 TFLOP/s,
# the H100/H200 SXM dense BF16 peak.
set -u
train=$(realpath "$1"); shift
top=$(cd "$(dirname "$0")/.." && pwd)
work=${LLAMA_WORK:-/tmp/llama}
steps=${STEPS:-30}
modes=${MODES:-"none full"}
mkdir -p "$work"
rows="$work/rows.jsonl"
: > "$rows"
ours() { # preset mode batch
  local preset=$1 mode=$2 batch=$3 dir="$work/$1-$2"
  rm -rf "$dir"; mkdir -p "$dir"
  printf '[compilation]\ncache = "target"\n\n[autotune]\ncache = "target"\n' > "$dir/cubecl.toml"
  ( cd "$dir" && CUDA_VISIBLE_DEVICES=${OURS_GPU:-0} "$train" "$top/configs/$preset.toml" --out run \
      --set training.steps=$steps --set training.batch_size=$batch \
      --set training.eval_interval=0 --set training.eval_batches=1 \
      --set training.checkpoint_interval=0 --set model.recompute=\"$mode\" > log.txt 2>&1 )
  echo "ours $preset $mode exit $?" >> "$work/status.txt"
  python3 - "$dir" "$preset" "$mode" "$batch" > "$dir/row.json" <<'PY'
import json, sys
d, preset, mode, batch = sys.argv[1:]
try:
    s = json.load(open(f"{d}/run/summary.json"))
    print(json.dumps({"who": "burnmix", "preset": preset, "recompute": mode, "batch": int(batch),
                      "params": s["params"], "tokens_per_s": s["median_tokens_per_s"],
                      "peak_reserved_gib": (s.get("peak_memory_reserved") or 0) / 2**30}))
except Exception as e:
    tail = open(f"{d}/log.txt").read().strip().splitlines()[-1:] or ["(no log)"]
    print(json.dumps({"who": "burnmix", "preset": preset, "recompute": mode, "error": tail[0][:300]}))
PY
}
peer() { # preset mode batch
  local preset=$1 mode=$2 batch=$3 dir="$work/$1-$2-peer"
  rm -rf "$dir"; mkdir -p "$dir"
  if CUDA_VISIBLE_DEVICES=${PEER_GPU:-0} python3 "$top/tools/peers/llama_hf.py" --preset "$preset" \
      --batch "$batch" --recompute "$mode" --steps "$steps" --warmup 10 > "$dir/peer.txt" 2> "$dir/log.txt"; then
    tail -1 "$dir/peer.txt" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["who"]="transformers"; print(json.dumps(r))' > "$dir/row.json"
  else
    python3 -c 'import json,sys; print(json.dumps({"who": "transformers", "preset": sys.argv[1], "recompute": sys.argv[2], "error": sys.argv[3][:300]}))' \
      "$preset" "$mode" "$(tail -1 "$dir/log.txt")" > "$dir/row.json"
  fi
}
runs() { # ours|peer
  for spec in "${specs[@]}"; do
    local preset=${spec%%:*} batch=${spec#*:}
    [ "$batch" = "$spec" ] && batch=4
    for mode in $modes; do "$1" "$preset" "$mode" "$batch"; done
  done
}
specs=("${@:-llama_1b:4}")
if [ "${PEER:-1}" = 1 ] && [ "${OURS_GPU:-0}" != "${PEER_GPU:-0}" ]; then
  runs ours & runs peer & wait
else
  runs ours
  [ "${PEER:-1}" = 1 ] && runs peer
fi
cat "$work"/*/row.json > "$rows"
python3 - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| preset | recompute | who | batch | tokens/s | MFU | peak reserved (GiB) | vs peer |")
print("|---|---|---|---|---|---|---|---|")
peer = {(r["preset"], r["recompute"]): r for r in rows if r["who"] == "transformers" and "error" not in r}
for r in rows:
    if "error" in r:
        print(f"| {r['preset']} | {r['recompute']} | {r['who']} | | failed: {r['error']} | | | |")
        continue
    p = peer.get((r["preset"], r["recompute"]))
    ratio = f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" if p and r["who"] == "burnmix" else ""
    mfu = r.get("mfu")
    if mfu is None and p:
        # The same FLOPs per token as the peer's line (the same shape).
        mfu = p["mfu"] * r["tokens_per_s"] / p["tokens_per_s"]
    mfu = f"{100 * mfu:.1f}%" if mfu is not None else ""
    print(f"| {r['preset']} | {r['recompute']} | {r['who']} | {r.get('batch', '')} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_reserved_gib']:.1f} | {ratio} |")
PY
