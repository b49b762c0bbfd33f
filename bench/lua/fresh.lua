-- Fresh keys: every request a new Idempotency-Key (prefix + thread id + per-thread counter).
dofile(os.getenv("BENCH_LUA_DIR") .. "/common.lua")

function make_request(n)
   return post(credit_path((n * 7 + tid) % accounts), prefix .. "-f" .. tid .. "-" .. n)
end
