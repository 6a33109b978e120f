#!/usr/bin/env bash
# Rows/s with micro-batching vs one request per run, at several concurrencies, and the lone request's
# p50/p99 with batching on vs off: two gateways over the same demo data, driven alternately in one run.
#   scripts/bench-batching.sh [rounds] [ctr|ctr_wide]   -> target/loadtest/batching-<model>.md
# ctr is the demo model (tiny: the HTTP stack dominates); ctr_wide (loadtest/bench/make_wide.py) has the
# same input and a 1024-wide body, so the forward pass dominates and batching has something to amortize.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-2}"
model="${2:-ctr}"
source scripts/lib.sh

build_release
out="target/loadtest/batching-$model"
mkdir -p "$out"
# The schemas (plus ctr_wide when asked for) and the scenario aimed at the model.
mkdir -p "$work/schemas"
cp schemas/*.yaml "$work/schemas/"
if [ "$model" = ctr_wide ]; then
  sed -e 's/^name: ctr$/name: ctr_wide/' -e "s|^file: ctr.onnx .*|file: $PWD/loadtest/bench/ctr_wide.onnx|" \
    schemas/ctr.yaml >"$work/schemas/ctr_wide.yaml"
fi
sed -e "s/^model = \"ctr\"/model = \"$model\"/" loadtest/scenarios/batching.toml >"$work/batching.toml"
export HYDRANT_REGISTRY__SCHEMAS="$work/schemas"

start() { # name batching -> sets $port (not in a subshell, so the trap can stop the gateway)
  port="$(free_port)"
  export HYDRANT_STORE__EMBEDDED__PATH="$work/$1.redb"
  seed_demo
  HYDRANT_SERVER__BIND="127.0.0.1:$port" HYDRANT_INFERENCE__BATCHING="$2" HYDRANT_TELEMETRY__LOG_LEVEL=warn \
    "$bin/hydrant" serve >"$work/$1.log" 2>&1 &
  pids+=($!)
  wait_ready "$port" "$work/$1.log"
}
start on true
on="$port"
start off false
off="$port"
for r in $(seq 1 "$rounds"); do
  for side in on off; do
    port=$([ "$side" = on ] && echo "$on" || echo "$off")
    "$bin/loadtest" run "$work/batching.toml" --quiet --target "http://127.0.0.1:$port" --out-dir "$out/$side-$r" >/dev/null
  done
done
python3 - "$out" "$rounds" "$model" <<'PY'
import json, sys, os
out, rounds, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for side in ("on", "off"):
    for r in range(1, rounds + 1):
        res = json.load(open(os.path.join(out, f"{side}-{r}", "batching.json")))
        for s in res["steps"]:
            c = s["concurrency"]
            h = s["hydrant"]
            if h["p50_us"] is None:  # no answer succeeded at this step: nothing to compare
                continue
            rows.setdefault(c, {}).setdefault(side, []).append((h["achieved_rps"] * 10, h["p50_us"], h["p99_us"]))
def med(xs): xs = sorted(xs); return xs[len(xs) // 2]
lines = ["| concurrency | rows/s batching on | rows/s batching off | ratio | p50 on | p50 off | p99 on | p99 off |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
for c in sorted(rows):
    on, off = rows[c]["on"], rows[c]["off"]
    ron, roff = med([x[0] for x in on]), med([x[0] for x in off])
    lines.append(f"| {c} | {ron:,.0f} | {roff:,.0f} | {ron / roff:.2f} | {med([x[1] for x in on])} µs | {med([x[1] for x in off])} µs | {med([x[2] for x in on])} µs | {med([x[2] for x in off])} µs |")
text = f"model {model}\n\n" + "\n".join(lines) + f"\n\n(1 user x 10 candidates per request; medians of {rounds} alternating rounds; concurrency 1 is the lone request)\n"
open(os.path.join(out, "..", f"batching-{model}.md"), "w").write(text)
print(text)
PY
