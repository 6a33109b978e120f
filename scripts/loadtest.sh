#!/usr/bin/env bash
# Runs the docker-compose topology as local processes: redis-server, the seed job (bulk loader),
# the gateway, and the load tester; writes the report to target/loadtest/<scenario>.{json,html}.
#   scripts/loadtest.sh loadtest/scenarios/hot-path.toml [extra loadtest args...]
# Everything listens on 127.0.0.1 and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
scenario="${1:?usage: $0 SCENARIO.toml [loadtest args...]}"
shift
[ -f "$scenario" ] || { echo "no scenario file $scenario" >&2; exit 2; }

source scripts/lib.sh

build_release

start_redis

# seed (the compose `seed` service)
"$bin/hydrant" load --view user_profile demo/rows/user_profile.jsonl
"$bin/hydrant" load --view item_stats demo/rows/item_stats.jsonl

# gateway (the compose `hydrant` service), on WORKERS async workers (default 1): the load tester shares
# the machine, and the in-process floor runs on as many threads as the gateway's /v1/stats says it runs
port="$(free_port)"
HYDRANT_SERVER__BIND="127.0.0.1:$port" HYDRANT_TELEMETRY__LOG_LEVEL="${LOG_LEVEL:-warn}" \
  HYDRANT_SERVER__WORKERS="${WORKERS:-1}" \
  "${detached[@]}" "$bin/hydrant" serve </dev/null >"$work/hydrant.log" 2>&1 &
pids+=($!)
wait_ready "$port" "$work/hydrant.log"

# load tester (the compose `loadtest` service)
"$bin/loadtest" run "$scenario" --target "http://127.0.0.1:$port" --redis-url "$HYDRANT_STORE__REDIS__URL" "$@"
