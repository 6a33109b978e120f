#!/usr/bin/env bash
# A load-test scenario with each party on cores of its own, for a machine with 8 cores or more:
# hydrant on cores 0-1, the floor (`loadtest floor`, 2 threads) on cores 2-3, and the load tester on
# the rest. On a 2-core machine the load tester competes with the server it measures; here it cannot,
# so the hydrant/floor ratio is the servers' alone. Uses the embedded store (the hot path never
# reaches the store after its warm-up).
#   scripts/bench-pinned.sh [SCENARIO.toml [loadtest run args...]]   (default loadtest/scenarios/hot-path.toml)
#   BIN=DIR scripts/bench-pinned.sh ...         prebuilt hydrant and loadtest in DIR
set -euo pipefail
cd "$(dirname "$0")/.."
scenario="${1:-loadtest/scenarios/hot-path.toml}"
shift $(($# > 0 ? 1 : 0))
cores="$(nproc)"
[ "$cores" -ge 8 ] || { echo "bench-pinned.sh needs 8 cores or more (this machine has $cores)" >&2; exit 2; }
command -v taskset >/dev/null || { echo "bench-pinned.sh needs taskset (util-linux)" >&2; exit 2; }
source scripts/lib.sh
if [ -n "${BIN:-}" ]; then
  bin="$BIN"
else
  build_release
fi

export HYDRANT_STORE__EMBEDDED__PATH="$work/store.redb" HYDRANT_TELEMETRY__LOG_LEVEL=warn
seed_demo
hport="$(free_port)"
HYDRANT_SERVER__BIND="127.0.0.1:$hport" taskset -c 0,1 "$bin/hydrant" serve >"$work/hydrant.log" 2>&1 &
pids+=($!)
fport="$(free_port)"
# The floor's answer holds as many scores as the scenario's largest request, as the in-process floor's does.
scores="$(python3 -c 'import sys, tomllib; c = tomllib.load(open(sys.argv[1], "rb"))["candidates"]; print(c[1] if isinstance(c, list) else c)' "$scenario")"
taskset -c 2,3 "$bin/loadtest" floor --bind "127.0.0.1:$fport" --threads 2 --scores "$scores" --for-s 86400 >"$work/floor.log" 2>&1 &
pids+=($!)
wait_ready "$hport" "$work/hydrant.log"
wait_ready "$fport" "$work/floor.log"
# The scenario, pointed at the pinned floor instead of one spawned inside the load tester.
name="$(basename "$scenario" .toml)"
sed "/^\[floor\]/a url = \"http://127.0.0.1:$fport\"" "$scenario" >"$work/$name.toml"
grep -q "^url = " "$work/$name.toml" || echo -e "\n[floor]\nenabled = true\nurl = \"http://127.0.0.1:$fport\"" >>"$work/$name.toml"
taskset -c "4-$((cores - 1))" "$bin/loadtest" run "$work/$name.toml" --target "http://127.0.0.1:$hport" \
  --out-dir target/loadtest/pinned "$@"
