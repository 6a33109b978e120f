#!/usr/bin/env python3
"""Peak memory a 1 MiB body of the smallest list elements costs each JSON route, before its answer.

For each case a fresh gateway starts (the embedded store and the demo schemas, as `make run` serves
them), takes one ~1 MiB body whose list holds as many tiny elements as fit (`{}`, `"a"`, `0`), and the
rise of its peak resident memory (`VmHWM`) is printed with the answer. A body refused before its lists
are read costs about 12 MB (the body, hyper's buffers, the allocator's first large pages); a route that
holds every element of a long list before checking its limit costs several times more.

    scripts/bench-body-memory.py [BIN]      (default target/release/hydrant; run from the repository root
                                             after `make run` has built it and loaded the demo rows)
"""
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

SIZE = (1 << 20) - 200


def body(prefix, item, suffix):
    n = SIZE // (len(item) + 1)
    return (prefix + ",".join([item] * n) + suffix).encode()


CASES = {
    "predict: candidates": ("/v1/models/ctr/predict", body('{"entities":{"user_id":"u_1"},"candidates":[', "{}", "]}")),
    "features: keys": ("/v1/features", body('{"features":["user_profile"],"entities":{"user_id":[', '"a"', "]}}")),
    "features: names": ("/v1/features", body('{"entities":{"user_id":["u_1"]},"features":[', '"a"', "]}")),
    "online features: keys": ("/get-online-features", body('{"features":["user_profile:age"],"entities":{"user_id":[', '"a"', "]}}")),
    "prefetch: keys": ("/v1/prefetch", body('{"entities":{"user_id":[', '"a"', "]}}")),
    "rows": ("/v1/views/user_profile/rows", body('{"rows":[', "{}", "]}")),
    "infer: data": ("/v2/models/ctr/infer", body('{"inputs":[{"name":"features","shape":[1,27],"datatype":"FP32","data":[', "0", "]}]}")),
    "predict: a context list": ("/v1/models/ctr/predict", body('{"entities":{"user_id":"u_1"},"context":{"device":[', "0", "]}}")),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/hydrant"
    for name, (path, data) in CASES.items():
        port = free_port()
        env = dict(os.environ, HYDRANT_SERVER__BIND=f"127.0.0.1:{port}", HYDRANT_TELEMETRY__LOG_LEVEL="error")
        server = subprocess.Popen([binary, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    urllib.request.urlopen(base + "/v2/health/ready")
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                sys.exit(f"{binary} did not turn ready on port {port}")

            def hwm_kb():
                with open(f"/proc/{server.pid}/status") as f:
                    return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

            before = hwm_kb()
            req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
            started = time.monotonic()
            try:
                with urllib.request.urlopen(req) as r:
                    status, answer = r.status, r.read(100)
            except urllib.error.HTTPError as e:
                status, answer = e.code, e.read(100)
            ms = (time.monotonic() - started) * 1000
            print(f"{name:24s} {len(data) / 1e6:.2f} MB body: peak +{(hwm_kb() - before) / 1024:6.1f} MB, "
                  f"{status} in {ms:4.0f} ms  {answer.decode(errors='replace')[:70]}")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
