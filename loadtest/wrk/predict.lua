-- wrk script: POST a predict request for 1 user and 10 candidates (the demo's hot path).
-- usage: wrk -t1 -c16 -d10s -s loadtest/wrk/predict.lua http://127.0.0.1:8080/v1/models/ctr/predict
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local cands = {}
for i = 1, 10 do cands[#cands + 1] = string.format('{"item_id": "i_%d"}', i * 37) end
wrk.body = '{"entities": {"user_id": "u_42"}, "context": {"hour_of_day": 13, "device": "ios"}, "candidates": [' ..
  table.concat(cands, ", ") .. '], "options": {"timings": false}}'
