-- Concurrent duplicates: consecutive requests share a key (BENCH_DUP_GROUP of them), so all the
-- connections hammer a small rotating set of keys while the first of each group is in flight.
-- The thread id is left out on purpose: threads at the same count send the same key.
dofile(os.getenv("BENCH_LUA_DIR") .. "/common.lua")

function make_request(n)
   local group = math.floor((n - 1) / dup_group)
   return post(credit_path(group % accounts), prefix .. "-d-" .. group)
end
