#!/usr/bin/env bash
# The first run on a lent GPU, in one go, within 8 minutes (no network there):
#   1. install the project offline (editable, no dependencies, no build isolation; the fallback
#      for old wheel / setuptools that cannot build an editable wheel: PYTHONPATH over a tree of
#      links laid out as the installed package, kernels/ models/ scheduler/ under hybridkv/);
#   2. print versions (python, torch, triton, transformers, GPU, driver);
#   3. run benchmarks/gpu_kernels.py (warm-ups that compile every variant, checks, timings (the
#      kernels over quantized caches against the float ones among them), the
#      Bamba-9B-width layers, the tiny Bamba engine, and decode steps with CUDA graphs on vs off
#      at batch 1 and 64, CPU and GPU time; each section isolated, JSON after each)
#      under a 7-minute timeout, writing $OUT/gpu_kernels.json and $OUT/gpu_kernels.log.
#   4. run benchmarks/gpu_layer_loads.py (a host-tier hit promoted on the copy stream, layer by
#      layer: tokens against caching off, the hit pass's time against HYBRIDKV_IMMEDIATE_LOADS=1)
#      under a 2-minute timeout, writing $OUT/gpu_layer_loads.json.
# Exits non-zero on a wrong result, a section that raised, or the timeout.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_first.sh                # on the GPU machine
#   OUT=/tmp/dry bash benchmarks/gpu_first.sh --cpu-dry-run  # the same steps on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/hybridkv_gpu_first}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
DRY=""
[ "${1:-}" = "--cpu-dry-run" ] && DRY="--cpu-dry-run"
start=$(date +%s)

echo "== install (offline) =="
if "$PY" -c "import hybridkv, hybridkv.kernels" 2>/dev/null && \
   [ "$("$PY" -c 'import hybridkv, os; print(os.path.realpath(os.path.dirname(hybridkv.__file__)))')" = "$(realpath hybridkv)" ]; then
    echo "hybridkv already importable from this checkout"
elif "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . 2>"$OUT/pip.log"; then
    echo "pip install -e . done"
else
    echo "pip install -e . failed (old wheel / setuptools?): $(tail -1 "$OUT/pip.log")"
    echo "fallback: PYTHONPATH over a link tree laid out as the package (pyproject's package-dir)"
    SRC="$OUT/src/hybridkv"
    rm -rf "$OUT/src" && mkdir -p "$SRC"
    for f in hybridkv/*; do ln -s "$PWD/$f" "$SRC/"; done
    for sub in kernels models scheduler; do ln -s "$PWD/$sub" "$SRC/$sub"; done
    export PYTHONPATH="$OUT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import hybridkv.kernels, hybridkv.models, hybridkv.scheduler" || { echo "import failed"; exit 3; }

echo "== versions =="
"$PY" - <<'EOF'
import sys, torch, triton, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| triton", triton.__version__, "| transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "| sm", f"{p.major}{p.minor}", "| SMs", p.multi_processor_count,
          "| memory", f"{p.total_memory / 2**30:.0f} GiB")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader

echo "== benchmarks/gpu_kernels.py $DRY =="
OUT="$OUT" timeout 420 "$PY" benchmarks/gpu_kernels.py $DRY 2>&1 | tee "$OUT/gpu_kernels.log"
rc=${PIPESTATUS[0]}

echo "== benchmarks/gpu_layer_loads.py $DRY =="  # promotion on the copy stream: tokens, step time vs immediate
OUT="$OUT" timeout 120 "$PY" benchmarks/gpu_layer_loads.py $DRY 2>&1 | tee "$OUT/gpu_layer_loads.log"
loads_rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] && rc=$loads_rc
echo "== done in $(( $(date +%s) - start )) s, exit $rc (124: the 7-minute timeout); $OUT/gpu_kernels.json =="
exit "$rc"
