#!/usr/bin/env bash
# Builds libcupti_trace.so (trace.c) against the CUDA toolkit's CUPTI, with the newest kernel, copy
# and memset record versions its header declares.
#   tools/cupti-trace/build.sh [OUT_DIR]     (default: this folder)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
cuda=${CUDA_PATH:-/usr/local/cuda}
# Each root ends in "/": the toolkit's path is often a symbolic link, which find does not enter
# otherwise.
roots=(); for d in "$cuda/extras/CUPTI" "$cuda"; do [ -d "$d" ] && roots+=("$d/"); done
[ ${#roots[@]} -gt 0 ] || { echo "no CUDA toolkit at $cuda (set CUDA_PATH)" >&2; exit 1; }
header=$({ find "${roots[@]}" -name cupti_activity.h 2>/dev/null || true; } | head -1)
[ -n "$header" ] || { echo "no cupti_activity.h under $cuda" >&2; exit 1; }
include=$(dirname "$header")
library=$({ find "${roots[@]}" -name 'libcupti.so*' 2>/dev/null || true; } | head -1)
[ -n "$library" ] || { echo "no libcupti.so under $cuda" >&2; exit 1; }
lib=$(dirname "$library")
newest() { { grep -ho "} $1[0-9]*;" "$include"/cupti_activity*.h || true; } | tr -d '}; ' | sort -V | tail -1; }
kernel=$(newest CUpti_ActivityKernel); memcpy=$(newest CUpti_ActivityMemcpy); memset=$(newest CUpti_ActivityMemset)
for r in "$kernel" "$memcpy" "$memset"; do
  [ -n "$r" ] || { echo "$include/cupti_activity*.h declares no kernel, copy or memset record" >&2; exit 1; }
done
echo "CUPTI from $include and $lib: $kernel, $memcpy, $memset"
cc -O2 -Wall -shared -fPIC "$here/trace.c" -I"$include" -I"$cuda/include" -L"$lib" -Wl,-rpath,"$lib" -lcupti -lpthread \
  -DKERNEL_RECORD="$kernel" -DMEMCPY_RECORD="$memcpy" -DMEMSET_RECORD="$memset" \
  -o "$out/libcupti_trace.so"
echo "built $out/libcupti_trace.so"
