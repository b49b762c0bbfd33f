-- Shared by the scenario scripts (loaded with dofile): wall-clock timing, per-thread counters,
-- a graceful end, and a JSON report printed by done().
--
-- Environment (set by bench/wrk.py):
--   BENCH_PREFIX      unique per run: keys of one run never collide with another's
--   BENCH_DURATION    measured seconds; no request is *sent* after that, in-flight ones finish
--   BENCH_TOKEN       bearer token
--   BENCH_BODY        the JSON body of every POST
--   BENCH_ACCOUNTS    how many accounts the load spreads over (acc-0 .. acc-N-1)
--   BENCH_REPLAY_KEYS how many keys the replay scenario cycles through
--   BENCH_DUP_GROUP   how many consecutive requests share one key in the duplicate scenario
--   BENCH_TRACK_KEYS  "1": remember the distinct keys that got a 2xx (from the echoed body)
--
-- wrk's -d is longer than BENCH_DURATION: after BENCH_DURATION, delay() holds every connection
-- back, so what was in flight completes and nothing is cut off (rows written = 2xx received).

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_usec; } bench_timeval;
int gettimeofday(bench_timeval *tv, void *tz);
]]
local tv = ffi.new("bench_timeval")

function now()
   ffi.C.gettimeofday(tv, nil)
   return tonumber(tv.tv_sec) + tonumber(tv.tv_usec) / 1e6
end

prefix = os.getenv("BENCH_PREFIX") or tostring(math.random(1, 2 ^ 30))
duration = tonumber(os.getenv("BENCH_DURATION") or "10")
accounts = tonumber(os.getenv("BENCH_ACCOUNTS") or "100")
replay_keys = tonumber(os.getenv("BENCH_REPLAY_KEYS") or "256")
dup_group = tonumber(os.getenv("BENCH_DUP_GROUP") or "8")
track_keys = os.getenv("BENCH_TRACK_KEYS") == "1"
body = os.getenv("BENCH_BODY") or '{"amount": 5}'

auth = "Bearer " .. (os.getenv("BENCH_TOKEN") or "bench-token")
wrk.headers["Authorization"] = auth

-- per-thread state (each wrk thread has its own Lua state)
tid = 0
t0 = 0
counter = 0
sent = 0
received = 0
window = 0
n2xx = 0
replayed = 0
statuses = {}
keys = {}

function post(path, key)
   -- explicit headers replace wrk.headers in wrk.format, so all of them are listed here
   local headers = {
      ["Authorization"] = auth,
      ["Content-Type"] = "application/json",
      ["Idempotency-Key"] = key,
   }
   return wrk.format("POST", path, headers, body)
end

function credit_path(account)
   return "/accounts/acc-" .. account .. "/credits"
end

-- main state: number the threads and give them one start time
local threads = {}

function setup(thread)
   if start_time == nil then
      start_time = now()
   end
   thread:set("tid", #threads + 1)
   thread:set("t0", start_time)
   table.insert(threads, thread)
end

function request()
   if tid == 1 and not verified then
      -- wrk calls request() once in the first thread to check the script; that one is never sent
      verified = true
      return make_request(0)
   end
   counter = counter + 1
   sent = sent + 1
   return make_request(counter)
end

function delay()
   if now() >= t0 + duration then
      return 3600000 -- past the window: send nothing more, let in-flight requests finish
   end
   return 0
end

function response(status, headers, resp_body)
   received = received + 1
   if now() < t0 + duration then
      window = window + 1
   end
   local s = tostring(status)
   statuses[s] = (statuses[s] or 0) + 1
   if status >= 200 and status < 300 then
      n2xx = n2xx + 1
      if track_keys and resp_body then
         local k = string.match(resp_body, '"key":"([^"]*)"')
         if k then
            keys[k] = true
         end
      end
   end
   for name, value in pairs(headers) do
      if string.find(string.lower(name), "replayed", 1, true) and value == "true" then
         replayed = replayed + 1
      end
   end
end

local function json_value(v)
   if type(v) == "table" then
      local parts = {}
      for k, x in pairs(v) do
         table.insert(parts, string.format("%q:%s", tostring(k), json_value(x)))
      end
      return "{" .. table.concat(parts, ",") .. "}"
   elseif type(v) == "string" then
      return string.format("%q", v)
   end
   return tostring(v)
end

function done(summary, latency, requests)
   local out = {
      sent = 0, received = 0, window = 0, n2xx = 0, replayed = 0, distinct_2xx_keys = 0,
   }
   local st, seen = {}, {}
   for _, t in ipairs(threads) do
      for _, f in ipairs({ "sent", "received", "window", "n2xx", "replayed" }) do
         out[f] = out[f] + (t:get(f) or 0)
      end
      for k, v in pairs(t:get("statuses") or {}) do
         st[k] = (st[k] or 0) + v
      end
      for k, _ in pairs(t:get("keys") or {}) do
         if not seen[k] then
            seen[k] = true
            out.distinct_2xx_keys = out.distinct_2xx_keys + 1
         end
      end
   end
   out.statuses = st
   out.duration_s = duration
   out.wrk_requests = summary.requests
   out.wrk_duration_us = summary.duration
   out.errors = {
      connect = summary.errors.connect,
      read = summary.errors.read,
      write = summary.errors.write,
      status = summary.errors.status,
      timeout = summary.errors.timeout,
   }
   out.latency_us = {
      mean = latency.mean,
      max = latency.max,
      p50 = latency:percentile(50),
      p90 = latency:percentile(90),
      p99 = latency:percentile(99),
   }
   io.write("BENCH_RESULT " .. json_value(out) .. "\n")
end
