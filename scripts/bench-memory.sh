#!/usr/bin/env bash
# Resident memory of the gateway with N cached user_profile entities, beside their raw payload (the
# MessagePack records and keys as stored in Redis).
#   scripts/bench-memory.sh [N]      (default 1000000) -> target/loadtest/memory.md
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-1000000}"
source scripts/lib.sh

cargo build --release --bin hydrant
bin=target/release/hydrant

start_redis

python3 - "$n" "$work/users.jsonl" <<'PY'
import json, random, sys
n, path = int(sys.argv[1]), sys.argv[2]
rng = random.Random(42)
countries = ["us", "de", "in", "br", "fr", "jp"]
with open(path, "w") as f:
    for i in range(n):
        f.write(json.dumps({"user_id": f"u_{i}", "age": rng.randint(18, 80), "country": rng.choice(countries),
                            "is_premium": rng.random() < 0.2, "avg_session_minutes": round(rng.expovariate(0.1), 6),
                            "embedding": [round(rng.uniform(-1, 1), 6) for _ in range(4)]}) + "\n")
PY
"$bin" load --view user_profile "$work/users.jsonl"
payload="$(redis-cli -p "$redis_port" EVAL "local c='0' local n=0 local b=0 repeat local r=redis.call('SCAN',c,'MATCH',ARGV[1],'COUNT',10000) c=r[1] for _,k in ipairs(r[2]) do n=n+1 b=b+redis.call('STRLEN',k)+#k end until c=='0' return {n,b}" 0 'hy:user_profile:*' | tr '\n' ' ')"

port="$(free_port)"
HYDRANT_SERVER__BIND="127.0.0.1:$port" HYDRANT_CACHE__MAX_BYTES=$((8 << 30)) HYDRANT_TELEMETRY__LOG_LEVEL=warn \
  HYDRANT_STORE__REDIS__COMMAND_TIMEOUT=2s "$bin" serve >"$work/hydrant.log" 2>&1 &
hpid=$!
pids+=($hpid)
wait_ready "$port" "$work/hydrant.log"

python3 - "$n" "$port" "$hpid" "$payload" <<'PY'
import http.client, json, sys, os
n, port, pid, payload = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
before = rss()
conn = http.client.HTTPConnection("127.0.0.1", port)
for start in range(0, n, 1000):
    keys = [f"u_{i}" for i in range(start, min(n, start + 1000))]
    body = json.dumps({"entities": {"user_id": keys}, "features": ["user_profile"], "options": {"timings": False, "deadline_ms": 2000}})
    conn.request("POST", "/v1/features", body, {"content-type": "application/json"})
    r = conn.getresponse(); data = r.read()
    if r.status != 200:
        sys.exit(f"features answered {r.status}: {data[:200]}")
conn.request("GET", "/metrics"); m = conn.getresponse().read().decode()
after = rss()
entries = metric(m, 'hydrant_cache_entries{view="user_profile"}')
est = metric(m, 'hydrant_cache_bytes{view="user_profile"}')
keys, raw = int(payload[0]), int(payload[1])
delta = after - before
text = f"""| entities cached | raw payload (keys + MessagePack records) | gateway RSS before -> after | RSS growth | cache's own estimate |
| --- | --- | --- | --- | --- |
| {int(entries):,} | {raw / 2**20:,.1f} MiB ({raw / max(keys, 1):.0f} B each) | {before / 2**20:,.0f} -> {after / 2**20:,.0f} MiB | {delta / 2**20:,.0f} MiB ({delta / max(entries, 1):.0f} B each, {delta / max(raw, 1):.1f}x the payload) | {est / 2**20:,.0f} MiB |
"""
os.makedirs("target/loadtest", exist_ok=True)
open("target/loadtest/memory.md", "w").write(text)
print(text)
PY
