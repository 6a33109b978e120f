# Shared by the benchmark and load-test scripts (sourced after `cd` to the repository root):
# a scratch folder and background processes that are cleaned up on exit, a free port, a throwaway
# redis-server, and waiting for a gateway to turn ready.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Load tests hold many connections: lift the soft open-file limit to the hard one.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# Ctrl-C reaches the foreground command (the load tester), which writes its partial report and exits;
# bash runs this trap only after that, then cleans up on exit. Servers a report depends on (redis-server
# here, hydrant in loadtest.sh) run in process groups of their own (`detached`), so the terminal's Ctrl-C
# does not stop them under the load tester's feet.
trap 'exit 130' INT TERM

# "${detached[@]}" COMMAND... &: runs COMMAND in a process group of its own, out of reach of the
# terminal's Ctrl-C, but in this session. Not `setsid`: a new session is a new scheduling group (the
# kernel's autogroup, wherever kernel.sched_autogroup_enabled is 1), and the kernel shares the cores
# between groups before threads. A gateway in a session of its own got about one core of two beside the
# load tester, while the floor, in the load tester's process, shared the load tester's group: the ratio to
# the floor compared unlike things (docs/performance.md, 2026-11-29, a seventeenth session). An array,
# not a function, so that `$!` is the server's own process id.
detached=(python3 -c 'import os, sys; os.setpgid(0, 0); os.execvp(sys.argv[1], sys.argv[1:])')

# Starts redis-server on a free port (no persistence), sets $redis_port and points the gateway at it.
start_redis() {
  redis_port="$(free_port)"
  # As docker-compose.yml's redis: no persistence, and a full memory refuses writes rather than evicting.
  "${detached[@]}" redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --maxmemory-policy noeviction --dir "$work" </dev/null >"$work/redis.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
  export HYDRANT_STORE__REDIS__URL="redis://127.0.0.1:$redis_port"
}

# Builds the gateway and the load tester in release, and sets $bin to the folder that holds them.
build_release() {
  cargo build --release --locked --bin hydrant
  cargo build --release --locked -p loadtest
  bin=target/release
}

# Loads the demo rows, quietly, with "$bin/hydrant" into the store its environment names.
seed_demo() {
  "$bin/hydrant" load --view user_profile demo/rows/user_profile.jsonl >/dev/null
  "$bin/hydrant" load --view item_stats demo/rows/item_stats.jsonl >/dev/null
}

# wait_ready PORT LOG: waits up to 10 s for /v2/health/ready on PORT; on failure prints LOG and exits.
wait_ready() {
  for _ in $(seq 1 200); do
    curl -sf "http://127.0.0.1:$1/v2/health/ready" >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "the server on port $1 never turned ready; its log:" >&2
  cat "$2" >&2
  exit 1
}
