-- Replays: a fixed set of keys completed during the warm-up (bench/wrk.py sends them first,
-- with the same key -> account mapping), requested again and again with the same body.
dofile(os.getenv("BENCH_LUA_DIR") .. "/common.lua")

function make_request(n)
   local i = (n + tid * 7919) % replay_keys
   return post(credit_path(i % accounts), prefix .. "-r-" .. i)
end
