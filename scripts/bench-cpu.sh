#!/usr/bin/env bash
# Gateway CPU per request on the hot path, beside the floor's: the steadiest figure on a shared, noisy
# machine, where throughput swings from minute to minute. Starts redis-server, seeds the demo rows, runs
# the gateway and the floor (`loadtest floor`), then alternates `wrk` runs against each and reads each
# server's CPU time from /proc. Prints medians of requests/s and of CPU µs per request.
#   scripts/bench-cpu.sh [ROUNDS] [CONNECTIONS] [SECONDS]      (default 5 64 4; needs wrk: apt-get install wrk)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}" conns="${2:-64}" secs="${3:-4}"
command -v wrk >/dev/null || { echo "bench-cpu.sh needs wrk (apt-get install -y wrk)" >&2; exit 2; }
source scripts/lib.sh

build_release

start_redis
seed_demo

hport="$(free_port)"
HYDRANT_SERVER__BIND="127.0.0.1:$hport" HYDRANT_TELEMETRY__LOG_LEVEL=warn "$bin/hydrant" serve >"$work/hydrant.log" 2>&1 &
hpid=$!
pids+=($hpid)
fport="$(free_port)"
"$bin/loadtest" floor --bind "127.0.0.1:$fport" --for-s 86400 >"$work/floor.log" 2>&1 &
fpid=$!
pids+=($fpid)
wait_ready "$hport" "$work/hydrant.log"
wait_ready "$fport" "$work/floor.log"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
run() { # NAME PID PORT -> appends "rps us_per_request" to $work/NAME
  local t0 t1 rps
  t0="$(cpu_ticks "$2")"
  rps="$(wrk -t1 -c"$conns" -d"${secs}s" -s loadtest/wrk/hot-path.lua "http://127.0.0.1:$3/v1/models/ctr/predict" |
    awk '/Requests\/sec/ {print $2}')"
  t1="$(cpu_ticks "$2")"
  python3 -c "import os; t=($t1-$t0)/os.sysconf('SC_CLK_TCK'); print(f'{$rps:.0f} {t*1e6/($rps*$secs):.1f}')" >>"$work/$1"
}
# Warm the gateway's cache and both servers' connections.
wrk -t1 -c"$conns" -d1s -s loadtest/wrk/hot-path.lua "http://127.0.0.1:$hport/v1/models/ctr/predict" >/dev/null
for r in $(seq 1 "$rounds"); do
  run hydrant "$hpid" "$hport"
  run floor "$fpid" "$fport"
  echo "round $r/$rounds: hydrant $(tail -1 "$work/hydrant")  floor $(tail -1 "$work/floor")" >&2
done
python3 - "$work/hydrant" "$work/floor" <<'PY'
import statistics, sys
med = {}
for name, path in zip(("hydrant", "floor"), sys.argv[1:]):
    rows = [tuple(map(float, l.split())) for l in open(path)]
    med[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
    print(f"{name:8s} median {med[name][0]:9.0f} rps   {med[name][1]:5.1f} µs of server CPU per request")
print(f"ratio    {med['hydrant'][0] / med['floor'][0]:.2f}x the floor's rps")
PY
