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

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

cargo build --release --bin hydrant && cargo build --release -p loadtest
bin=target/release

redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
export HYDRANT_STORE__REDIS__URL="redis://127.0.0.1:$redis_port"

# seed (the compose `seed` service)
"$bin/hydrant" load --view user_profile demo/rows/user_profile.jsonl
"$bin/hydrant" load --view item_stats demo/rows/item_stats.jsonl

# gateway (the compose `hydrant` service)
port="$(free_port)"
HYDRANT_SERVER__BIND="127.0.0.1:$port" HYDRANT_TELEMETRY__LOG_LEVEL="${LOG_LEVEL:-warn}" \
  "$bin/hydrant" serve >"$work/hydrant.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null 2>&1 && break
  sleep 0.05
done
curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null || { cat "$work/hydrant.log" >&2; exit 1; }

# load tester (the compose `loadtest` service)
"$bin/loadtest" run "$scenario" --target "http://127.0.0.1:$port" --redis-url "$HYDRANT_STORE__REDIS__URL" "$@"
