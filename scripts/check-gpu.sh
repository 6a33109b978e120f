#!/usr/bin/env bash
# Checks the CUDA path on a machine with an NVIDIA GPU, then measures it beside the CPU:
#   1. tests/gpu.rs with TEST_HAS_CUDA=1: cuda scores equal cpu scores (alone and batched), V2 infer,
#      and `device: auto` choosing the GPU;
#   2. the ranking scenario at each rate in RATES, for each model in MODELS (default: the demo ctr and
#      the benchmark-only ctr_wide, loadtest/bench/ctr_wide.onnx) on cpu and then on cuda, one after
#      the other on the same machine over the embedded store, and a table of all of them.
# Needs the onnxruntime-gpu libraries in .ort/lib (`make ort-gpu`) and CUDA 13 with cuDNN 9, from the
# system or from pip's nvidia-* packages (found through python3 and put on LD_LIBRARY_PATH).
#   scripts/check-gpu.sh                              builds with cargo
#   BIN=DIR GPU_TEST=FILE scripts/check-gpu.sh        prebuilt hydrant and loadtest in DIR, and the
#                                                     tests/gpu.rs test binary (a machine without Rust)
# RATES (default "200 1000") and DURATION_S (default 15) shape the load; SESSIONS sets
# inference.default_sessions (default: one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
rates="${RATES:-200 1000}" secs="${DURATION_S:-15}" models="${MODELS:-ctr ctr_wide}"
[ -f .ort/lib/libonnxruntime_providers_cuda.so ] ||
  { echo "no CUDA provider in .ort/lib: run \`make ort-gpu\` first" >&2; exit 2; }
source scripts/lib.sh

# CUDA libraries that pip installed (nvidia-cublas, nvidia-cudnn-cu13, ...) are not on the loader path.
pip_cuda="$(python3 - 2>/dev/null <<'PY' || true
import glob, os
import nvidia
print(":".join(sorted(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib")))))
PY
)"
[ -n "$pip_cuda" ] && export LD_LIBRARY_PATH="$pip_cuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [ -n "${BIN:-}" ]; then
  bin="$BIN"
else
  build_release
fi
[ -n "${SESSIONS:-}" ] && export HYDRANT_INFERENCE__DEFAULT_SESSIONS="$SESSIONS"

echo "== tests/gpu.rs" >&2
if [ -n "${GPU_TEST:-}" ]; then
  TEST_HAS_CUDA=1 "$GPU_TEST" --test-threads 1 --nocapture
else
  TEST_HAS_CUDA=1 cargo test --release --test gpu -- --test-threads 1 --nocapture
fi

echo "== ranking, cpu then cuda, models: $models, at ${rates// /, } requests/s for ${secs}s each" >&2
export HYDRANT_STORE__EMBEDDED__PATH="$work/store.redb" HYDRANT_TELEMETRY__LOG_LEVEL=warn
seed_demo
out=target/loadtest/gpu
for model in $models; do
  for device in cpu cuda; do
    dir="$work/schemas-$model-$device"
    mkdir -p "$dir"
    cp schemas/*.yaml "$dir/"
    if [ "$model" = ctr_wide ]; then
      sed -e 's/^name: ctr$/name: ctr_wide/' -e "s|^file: ctr.onnx .*|file: $PWD/loadtest/bench/ctr_wide.onnx|" \
        schemas/ctr.yaml >"$dir/ctr_wide.yaml"
    fi
    sed -i "s/^device: cpu/device: $device/" "$dir"/*.yaml
    port="$(free_port)"
    HYDRANT_REGISTRY__SCHEMAS="$dir" HYDRANT_SERVER__BIND="127.0.0.1:$port" \
      "$bin/hydrant" serve >"$work/hydrant-$model-$device.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    wait_ready "$port" "$work/hydrant-$model-$device.log"
    curl -sf "http://127.0.0.1:$port/v2/models/$model" | grep -q "\"device\":\"$device\"" ||
      { echo "the gateway did not put $model on $device:" >&2; cat "$work/hydrant-$model-$device.log" >&2; exit 1; }
    for rate in $rates; do
      sed -e "s/^rate = .*/rate = $rate/" -e "s/^model = .*/model = \"$model\"/" loadtest/scenarios/ranking.toml \
        >"$work/ranking-$rate.toml"
      "$bin/loadtest" run "$work/ranking-$rate.toml" --target "http://127.0.0.1:$port" \
        --duration-s "$secs" --quiet --out-dir "$out/$model-$device" >/dev/null
    done
    kill "$pid" && wait "$pid" 2>/dev/null || true
  done
done
python3 - "$out" "$models" $rates <<'PY'
import json, sys
out, models, rates = sys.argv[1], sys.argv[2].split(), sys.argv[3:]

def cell(v, width, digits=None):
    # A run that measured nothing (interrupted, or no answer succeeded) has nulls: shown as "-".
    if v is None:
        return f"{'-':>{width}}"
    return f"{v:>{width}.{digits}f}" if digits is not None else f"{v:>{width}}"

print(f"{'model':<10}{'device':<7}{'rate':>6}{'achieved':>10}{'p50 µs':>9}{'p99 µs':>9}{'infer p99':>11}{'queue p99':>11}{'errors':>8}")
for model in models:
    for device in ("cpu", "cuda"):
        for rate in rates:
            r = json.load(open(f"{out}/{model}-{device}/ranking-{rate}.json"))
            s = r.get("stages_p99_us") or {}
            print(f"{model:<10}{device:<7}{rate:>6}{cell(r['achieved_rps'], 10, 0)}{cell(r['p50_us'], 9)}"
                  f"{cell(r['p99_us'], 9)}{cell(s.get('infer'), 11)}{cell(s.get('queue'), 11)}{r['errors']:>8}")
PY
