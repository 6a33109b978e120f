-- wrk script: the hot path, 1 user + 1 candidate + context, every key cached after the first request.
-- The body is the one `loadtest` sends for hot-path.toml (serde_json's compact form, `options` included).
-- usage: wrk -t1 -c32 -d10s -s loadtest/wrk/hot-path.lua http://127.0.0.1:8080/v1/models/ctr/predict
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json"
wrk.body = '{"entities":{"user_id":"u_42"},"context":{"hour_of_day":13,"device":"ios"},"candidates":[{"item_id":"i_7"}],"options":{"timings":true}}'
