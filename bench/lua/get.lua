-- GET pass-through: GET /accounts/{id}, never guarded.
dofile(os.getenv("BENCH_LUA_DIR") .. "/common.lua")

function make_request(n)
   return wrk.format("GET", "/accounts/acc-" .. ((n + tid) % accounts))
end
