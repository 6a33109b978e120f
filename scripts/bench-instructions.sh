#!/usr/bin/env bash
# Instructions per hot-path request, the gateway's beside the floor's, counted by valgrind's callgrind.
# Unlike CPU time, an instruction count does not move with how busy a shared machine is, so a change of
# 1-2% to the request path shows in one run, where `bench-cpu.sh` needs many alternating rounds. It
# counts work, not time: cache misses, system calls and wake-ups cost time it does not see, so check a
# change that moves those with `bench-cpu.sh` too.
#
# Starts redis-server, seeds the demo rows, runs each server under callgrind (about 50x slower), warms
# it with `wrk`, then counts the instructions of every thread over SECONDS of `wrk` at CONNECTIONS and
# divides by the requests answered. The gateway's count is also split into the request path on the
# async workers (hyper included), the predict handler (reading the body included), the request decode
# (by hand for the usual body, by serde for any other), and the session threads (the ONNX Runtime runs,
# whose batches are larger under callgrind, which runs one thread at a time).
#   scripts/bench-instructions.sh [SECONDS] [CONNECTIONS]     (default 10 8; needs wrk and valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-10}" conns="${2:-8}"
for tool in wrk valgrind callgrind_annotate; do
  command -v "$tool" >/dev/null || {
    echo "bench-instructions.sh needs $tool (apt-get install -y wrk valgrind)" >&2
    exit 2
  }
done
source scripts/lib.sh

build_release

start_redis
seed_demo
# Under callgrind everything runs ~50x slower: give Redis replies and start-up room.
export HYDRANT_STORE__REDIS__CONNECT_TIMEOUT=60s HYDRANT_STORE__REDIS__COMMAND_TIMEOUT=5s

wrk_hot() { wrk -t1 -c"$conns" -d"$1s" -s loadtest/wrk/hot-path.lua "http://127.0.0.1:$2/v1/models/ctr/predict"; }

# count NAME PORT COMMAND...: runs COMMAND under callgrind, prints "requests file" for the counted span.
count() {
  local name="$1" port="$2" vpid n out
  shift 2
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$name" "$@" >"$work/$name.log" 2>&1 &
  vpid=$!
  pids+=($vpid)
  for _ in $(seq 1 120); do
    curl -sf -o /dev/null "http://127.0.0.1:$port/v2/health/ready" && break
    sleep 1
  done
  curl -sf -o /dev/null "http://127.0.0.1:$port/v2/health/ready" || {
    echo "$name never turned ready under callgrind; its log:" >&2
    cat "$work/$name.log" >&2
    exit 1
  }
  wrk_hot 4 "$port" >/dev/null # warm: caches filled, connections and sessions started
  callgrind_control --zero "$vpid" >/dev/null 2>&1
  out="$(wrk_hot "$secs" "$port")"
  n="$(awk '/requests in/ {print $1}' <<<"$out")"
  if grep -q 'Non-2xx' <<<"$out"; then
    echo "$name answered errors during the count:" >&2
    echo "$out" >&2
    exit 1
  fi
  callgrind_control --dump "$vpid" >/dev/null 2>&1
  # The dump is written as cg.NAME.1 once callgrind has seen the request.
  for _ in $(seq 1 100); do [ -s "$work/cg.$name.1" ] && break; sleep 0.1; done
  kill "$vpid" 2>/dev/null || true
  wait "$vpid" 2>/dev/null || true
  callgrind_annotate --inclusive=yes --threshold=100 "$work/cg.$name.1" >"$work/$name.txt" 2>/dev/null
  echo "$n $work/$name.txt"
}

hport="$(free_port)"
read -r hn hfile < <(HYDRANT_SERVER__BIND="127.0.0.1:$hport" HYDRANT_TELEMETRY__LOG_LEVEL=warn \
  count hydrant "$hport" "$bin/hydrant" serve)
fport="$(free_port)"
read -r fn ffile < <(count floor "$fport" "$bin/loadtest" floor --bind "127.0.0.1:$fport" --for-s 86400)

python3 - "$hn" "$hfile" "$fn" "$ffile" <<'PY'
import sys

def load(path):
    rows = {}
    for line in open(path):
        parts = line.split()
        if len(parts) < 3 or not parts[0].replace(",", "").isdigit():
            continue
        n = int(parts[0].replace(",", ""))
        name = line.split(")", 1)[1].strip() if ")" in line else line
        rows.setdefault(name, n)
    return rows

def find(rows, *needles):
    best = 0
    for name, n in rows.items():
        if all(x in name for x in needles):
            best = max(best, n)
    return best

hn, hrows, fn, frows = int(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3]), load(sys.argv[4])
h_total = find(hrows, "PROGRAM TOTALS") / hn
f_total = find(frows, "PROGRAM TOTALS") / fn
print(f"instructions per hot-path request ({hn} gateway and {fn} floor requests counted):")
print(f"  floor                 {f_total:9.0f}")
print(f"  hydrant               {h_total:9.0f}   ({h_total / f_total:.2f}x the floor's)")
for label, needles in [
    ("request path", ("serve.rs:hydrant::serve::serve::{{closure}}::{{closure}}::{{closure}}",)),
    ("predict handler", ("hydrant::api::predict::{{closure}}",)),
    ("decode, by hand", ("predict_json.rs:hydrant::predict_json::parse",)),
    ("decode, by serde", ("decode.rs:hydrant::decode::parse_body",)),
    ("session threads", ("hydrant::infer::Worker::run [",)),
    ("ONNX Runtime runs", ("ort::session::run::<impl ort::session::Session>::run [",)),
]:
    print(f"    {label:19s} {find(hrows, *needles) / hn:9.0f}")
PY
