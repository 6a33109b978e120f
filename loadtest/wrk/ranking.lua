-- wrk script: ranking, 1 user x 100 candidates (every key cached after the first request).
-- usage: wrk -t1 -c4 -d10s -s loadtest/wrk/ranking.lua http://127.0.0.1:8080/v1/models/ctr/predict
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local cands = {}
for i = 0, 99 do cands[#cands + 1] = string.format('{"item_id": "i_%d"}', i * 17) end
wrk.body = '{"entities": {"user_id": "u_42"}, "context": {"hour_of_day": 13, "device": "ios"}, "candidates": [' ..
  table.concat(cands, ", ") .. '], "options": {"timings": false}}'
