"""Every Lua script Ferry runs in Redis, and how pipelines run them without an extra round trip.

A script's state names and queue-entry fields come in as arguments (the job states of
`worker.protocol.jobs`, the envelope of `Envelope.to_fields`), so the Python enums stay the one
place they are spelled. Keys are passed as KEYS; each script's header says what it takes.

Pipelines: redis-py checks `SCRIPT EXISTS` before every pipeline that holds a script, one more
round trip per engine step. `add` queues a bare EVALSHA instead; when Redis does not know a
script (first use, restart, SCRIPT FLUSH) nothing of that script ran, so `execute` loads the
scripts and builds and sends the whole pipeline once more.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.commands.core import Script
from redis.exceptions import NoScriptError

from ferry.worker.common.connect import is_cluster

# The command a script publishes a job's events with: `JOB_PUBLISH` stands for PUBLISH on a
# single node, SPUBLISH on a cluster (`register`), where a job's channel then lives on its shard
# alone (it shares the job hash's name, so the script's slot) instead of reaching every node.
_JOB_PUBLISH = "JOB_PUBLISH"

# Reads the space-separated terminal states in ARGV[1] into a set: `terminal[state]` is true.
_TERMINAL = """
local terminal = {}
for s in string.gmatch(ARGV[1], '%S+') do terminal[s] = true end
"""

# Enqueue one job (the API). KEYS: job hash, queue stream[, idempotency key].
# ARGV: job id, idempotency ttl, number of envelope fields n, n field/value pairs, then the job
# hash's field/value pairs. Returns {1, job id}, or {0, existing job id} when the key was taken.
ENQUEUE = """
if #KEYS == 3 then
  local existing = redis.call('GET', KEYS[3])
  if existing then return {0, existing} end
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[2])
end
local n = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 4 + 2 * n))
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4, 3 + 2 * n))
return {1, ARGV[1]}
"""

# Request cancellation (the API). KEYS: job hash, events stream.
# ARGV: terminal states, cancelled state, result ttl, now, cancel channel, job channel, job id,
# the cancelled event's JSON after its leading `{"seq":N` (seq is decided here, atomically).
# A queued job is cancelled at once; every call also wakes the worker running the job.
CANCEL = _TERMINAL + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return false end
if terminal[state] then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'queued' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  local seq = 0
  if #last > 0 then seq = tonumber(string.match(last[1][1], '^(%d+)')) + 1 end
  local data = '{"seq":' .. seq .. ARGV[8]
  redis.call('XADD', KEYS[2], seq .. '-1', 'seq', tostring(seq), 'type', 'cancelled', 'data', data)
  redis.call('HSET', KEYS[1], 'state', ARGV[2], 'finished_at', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('JOB_PUBLISH', ARGV[6], data)
  state = ARGV[2]
end
redis.call('PUBLISH', ARGV[5], ARGV[7])
return state
"""

# Start a job on a worker. KEYS: job hash, events stream.
# ARGV: terminal states, running state, worker id, now, job channel, the started event's JSON
# after its leading `{"seq":0`. Returns the job's attempts so far (this one included), or 0 when
# it is settled or cancelled (then it must not start).
START = _TERMINAL + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or terminal[state] or redis.call('HGET', KEYS[1], 'cancel') == '1' then return 0 end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'worker_id', ARGV[3])
redis.call('HSETNX', KEYS[1], 'started_at', ARGV[4])
if redis.call('XLEN', KEYS[2]) == 0 then
  local data = '{"seq":0' .. ARGV[6]
  redis.call('XADD', KEYS[2], '0-1', 'seq', '0', 'type', 'started', 'data', data)
  redis.call('JOB_PUBLISH', ARGV[5], data)
end
return attempts
"""

# Renew the leases of a worker's running entries. KEYS: one queue stream per entry.
# ARGV: group, consumer, then the entry ids (aligned with KEYS). Returns {ids another consumer
# holds now, ids no longer pending at all, streams without the group}: a stream that lost its
# group (Redis restarted empty, the stream deleted) lost its pending entries with it.
RENEW = """
local taken, gone, missing = {}, {}, {}
for k = 1, #KEYS do
  local id = ARGV[k + 2]
  local p = redis.pcall('XPENDING', KEYS[k], ARGV[1], id, id, 1)
  if type(p) == 'table' and p.err then
    if not string.find(p.err, 'NOGROUP') then return redis.error_reply(p.err) end
    table.insert(gone, id)
    table.insert(missing, KEYS[k])
  elseif #p == 0 then
    table.insert(gone, id)
  elseif p[1][2] ~= ARGV[2] then
    table.insert(taken, id)
  else
    redis.call('XCLAIM', KEYS[k], ARGV[1], ARGV[2], 0, id, 'JUSTID')
  end
end
return {taken, gone, missing}
"""

# Take new entries by strict priority in one round trip. KEYS: the queue streams, highest
# priority first; ARGV: group, consumer, most entries to take. XREADGROUP each stream in turn
# until the count is met. A stream without the group (Redis restarted empty, a stream deleted) is
# skipped, not an error: what the others gave is already pending here and must come back.
# Returns {{stream, {{id, {field, value, ...}}, ...}} per stream read, {streams without the group}}.
READ = """
local out, missing = {}, {}
local left = tonumber(ARGV[3])
for i = 1, #KEYS do
  if left <= 0 then break end
  local answer = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', KEYS[i], '>')
  if type(answer) == 'table' and answer.err then
    if not string.find(answer.err, 'NOGROUP') then return redis.error_reply(answer.err) end
    table.insert(missing, KEYS[i])
  elseif answer then
    local entries = answer[1][2]
    left = left - #entries
    table.insert(out, {KEYS[i], entries})
  end
end
return {out, missing}
"""

# Append a job's events, publish them, and when the job ends write its result and settle its
# queue entry (the worker's publisher). KEYS[1] events stream, KEYS[2] job hash (also the name
# of the job's pub/sub channel)[, KEYS[3] queue stream: the job ends with this write].
# ARGV[1] first_token_at or '', ARGV[2] number of events n, n x (seq, type, data), then, when the
# job ends: result ttl, group, entry id, job hash field/value pairs...
# Seq fencing: a seq already in the stream with other bytes is another worker's event (the job
# was reclaimed): return 0 and write nothing more. The same bytes are our own retried write.
# A job whose hash is gone (Redis lost it: a restart without persistence, an eviction) gets no
# write at all: return -1. Writing would leave a partial hash and events of a job nobody knows.
EMIT = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
local n = tonumber(ARGV[2])
local i = 3
for _ = 1, n do
  local seq, kind, data = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local added = redis.pcall('XADD', KEYS[1], seq .. '-1', 'seq', seq, 'type', kind, 'data', data)
  if type(added) == 'table' and added.err then
    local have = redis.call('XRANGE', KEYS[1], seq .. '-1', seq .. '-1')
    if #have == 0 or have[1][2][6] ~= data then return 0 end
  else
    redis.call('JOB_PUBLISH', KEYS[2], data)
  end
  i = i + 3
end
if ARGV[1] ~= '' then redis.call('HSETNX', KEYS[2], 'first_token_at', ARGV[1]) end
if #KEYS == 3 then
  if #ARGV > i + 2 then redis.call('HSET', KEYS[2], unpack(ARGV, i + 3)) end
  redis.call('EXPIRE', KEYS[1], ARGV[i])
  redis.call('EXPIRE', KEYS[2], ARGV[i])
  redis.call('XACK', KEYS[3], ARGV[i + 1], ARGV[i + 2])
  redis.call('XDEL', KEYS[3], ARGV[i + 2])
end
return 1
"""

# Hand a job back to the queue so any worker takes it now, not after the lease runs out.
# KEYS[1] queue stream holding the entry, KEYS[2] stream to re-add it to, KEYS[3] job hash.
# ARGV: terminal states, queued state, group, entry id, this worker's consumer name, attempts to
# record ('' for a job that never started here: its hash is left alone), number of envelope
# fields n, n field/value pairs of the new envelope. Returns 0 when the entry is no longer ours.
HAND_BACK = _TERMINAL + """
local p = redis.call('XPENDING', KEYS[1], ARGV[3], ARGV[4], ARGV[4], 1)
if #p == 0 or p[1][2] ~= ARGV[5] then return 0 end
redis.call('XACK', KEYS[1], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[1], ARGV[4])
local state = redis.call('HGET', KEYS[3], 'state')
if state and not terminal[state] then
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[3], 'state', ARGV[2], 'attempts', ARGV[6]) end
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 8, 7 + 2 * tonumber(ARGV[7])))
end
return 1
"""

# Move a queue entry this worker holds to a peer (the LoRA affinity: the peer holds the job's
# adapter): the entry changes owner (its lease goes with it: a peer that dies before starting it
# loses it to the reaper, nothing is lost) and the peer's hand-off stream gets a wake-up entry.
# KEYS[1] queue stream, KEYS[2] the peer's hand-off stream (same shard: one slot). ARGV: group,
# entry id, this worker's consumer name, the peer's, job id, hand-off stream TTL in seconds.
# Returns 0 when the entry is no longer ours (nothing moved), else 1.
HAND_OFF = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[4], 0, ARGV[2], 'JUSTID')
redis.call('XADD', KEYS[2], '*', 'job_id', ARGV[5], 'stream', KEYS[1], 'entry_id', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return 1
"""

# Take a hand-off: settle its wake-up entry and, if the queue entry it names is still ours (no
# reaper took it meanwhile), restart its lease and return its fields (else nil).
# KEYS[1] this worker's hand-off stream, KEYS[2] the queue stream. ARGV: group, hand-off entry
# id, queue entry id, this worker's consumer name.
TAKE_HANDOFF = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[4] then return false end
redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[4], 0, ARGV[3], 'JUSTID')
local entry = redis.call('XRANGE', KEYS[2], ARGV[3], ARGV[3])
if #entry == 0 then return false end
return entry[1][2]
"""

# A batch driver's write, fenced by its lease (the Batch API). KEYS: the batch's lease, then the
# keys the writes name (all of one batch: one hash slot). ARGV[1]: the driver's lease token;
# ARGV[2]: JSON list of writes `[command, key index (1 = KEYS[2]), args...]` with commands
# HSET, HDEL, HINCRBY, SREM. Nothing is written unless the lease is still the caller's: a driver
# that stalled past its lease cannot overwrite the new driver's work. Returns 1, or 0 when fenced off.
BATCH_FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local allowed = {HSET = true, HDEL = true, HINCRBY = true}
for _, w in ipairs(cjson.decode(ARGV[2])) do
  local command = table.remove(w, 1)
  local key = KEYS[1 + table.remove(w, 1)]
  if not allowed[command] then return redis.error_reply('BATCH_FENCED: ' .. command .. ' not allowed') end
  if #w > 0 then redis.call(command, key, unpack(w)) end
end
return 1
"""

# Renew a batch lease if it is still the caller's. KEYS: lease. ARGV: token, lease ms. Returns 1 or 0.
BATCH_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# Ask a batch to cancel (the API). KEYS: batch hash. ARGV: now. A batch still validating or in
# progress becomes `cancelling`, and its driver cancels its jobs; returns the status it had.
BATCH_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1], 'cancel_requested', '1')
end
return status
"""


# Refill the token bucket `name` of hash KEYS[1] to `now` (ms): its level rises at `cap` per
# minute up to `cap`; a bucket never seen is full. Levels may be below 0 (a correction charged
# more than was reserved): a debt, paid back by the refill.
_BUCKET_LEVEL = """
local function bucket_level(name, cap, now)
  local have = redis.call('HMGET', KEYS[1], name, name .. '_ts')
  local level, ts = tonumber(have[1]), tonumber(have[2])
  if not level then return cap end
  level = level + math.max(0, now - ts) * cap / 60000
  if level > cap then level = cap end
  return level
end
"""

# Admit one request against a tenant's budget (the API). KEYS: the budget's bucket hash.
# ARGV: now (ms), requests per minute, tokens per minute (0: that dimension is unlimited), the
# tokens to reserve, the hash's ttl (s). Both buckets are taken or neither. Returns {admitted,
# too large (the reservation is over the whole per-minute budget), requests left, ms until the
# request bucket is full, tokens left, ms until the token bucket is full, ms to wait before a retry
# can pass}; an unlimited dimension reports -1 left.
RATE_LIMIT = _BUCKET_LEVEL + """
local now = tonumber(ARGV[1])
local names, caps, costs = {'req', 'tok'}, {tonumber(ARGV[2]), tonumber(ARGV[3])}, {1, tonumber(ARGV[4])}
local levels, wait, too_large = {}, 0, 0
for i = 1, 2 do
  if caps[i] > 0 then
    levels[i] = bucket_level(names[i], caps[i], now)
    if costs[i] > caps[i] then too_large = 1
    elseif levels[i] < costs[i] then wait = math.max(wait, (costs[i] - levels[i]) * 60000 / caps[i]) end
  end
end
local admitted = wait == 0 and too_large == 0
local out = {admitted and 1 or 0, too_large}
for i = 1, 2 do
  if caps[i] > 0 then
    local level = levels[i]
    if admitted then level = level - costs[i] end
    redis.call('HSET', KEYS[1], names[i], tostring(level), names[i] .. '_ts', ARGV[1], names[i] .. '_cap', ARGV[1 + i])
    table.insert(out, math.floor(math.max(level, 0)))
    table.insert(out, math.ceil((caps[i] - level) * 60000 / caps[i]))
  else
    table.insert(out, -1)
    table.insert(out, 0)
  end
end
table.insert(out, math.ceil(wait))
redis.call('EXPIRE', KEYS[1], ARGV[5])
return out
"""

# Give back what an admission took for work that was never queued (the API: a full queue, or a
# failed enqueue, after the budget was taken). KEYS: the budget's bucket hash. ARGV: now (ms),
# requests, tokens. Each bucket is refilled to now first, then credited, capped at its capacity.
RATE_REFUND = """
local now = tonumber(ARGV[1])
local names, amounts = {'req', 'tok'}, {tonumber(ARGV[2]), tonumber(ARGV[3])}
for i = 1, 2 do
  local have = redis.call('HMGET', KEYS[1], names[i], names[i] .. '_ts', names[i] .. '_cap')
  local level, ts, cap = tonumber(have[1]), tonumber(have[2]), tonumber(have[3])
  if level and cap and amounts[i] > 0 then
    level = math.min(cap, level + math.max(0, now - ts) * cap / 60000 + amounts[i])
    redis.call('HSET', KEYS[1], names[i], tostring(level), names[i] .. '_ts', ARGV[1])
  end
end
return 1
"""

# Count a job that ended, once (whoever saw the end: the worker's publisher, or the API for a job
# cancelled while queued). KEYS: the job's `usage_counted` marker, the tenant's usage totals, its
# usage of the day[, the bucket hash its tokens were reserved in]. ARGV: marker ttl, prompt tokens,
# completion tokens, the day hash's ttl, now (ms), tokens to give back to the bucket (reserved
# minus used; negative charges the excess). Returns 1, or 0 when the job was counted already.
ACCOUNT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for k = 2, 3 do
  redis.call('HINCRBY', KEYS[k], 'requests', 1)
  redis.call('HINCRBY', KEYS[k], 'prompt_tokens', ARGV[2])
  redis.call('HINCRBY', KEYS[k], 'completion_tokens', ARGV[3])
end
redis.call('EXPIRE', KEYS[3], ARGV[4])
if #KEYS == 4 then
  local have = redis.call('HMGET', KEYS[4], 'tok', 'tok_ts', 'tok_cap')
  local level, ts, cap = tonumber(have[1]), tonumber(have[2]), tonumber(have[3])
  if level and cap then
    local now = tonumber(ARGV[5])
    level = math.min(cap, level + math.max(0, now - ts) * cap / 60000 + tonumber(ARGV[6]))
    redis.call('HSET', KEYS[4], 'tok', tostring(math.max(level, -cap)), 'tok_ts', ARGV[5])
  end
end
return 1
"""


def register(client, source: str) -> Script:
    """`client.register_script(source)`, its job-channel publishes made SPUBLISH on a cluster client."""
    return client.register_script(source.replace(_JOB_PUBLISH, "SPUBLISH" if is_cluster(client) else "PUBLISH"))


def add(pipe, script: Script, keys: list[str], args: list) -> None:
    """Queue `script` on `pipe` as a bare EVALSHA (spelled as a command: a cluster pipeline refuses
    its `evalsha` method, yet routes the command by its keys)."""
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def execute(build: Callable[[], object], scripts: list[Script]) -> list:
    """Run the pipeline `build()` returns (errors come back as results), loading `scripts` if Redis lacks them."""
    results = build().execute(raise_on_error=False)
    if any(isinstance(r, NoScriptError) for r in results):
        for script in scripts:
            script.sha = script.registered_client.script_load(script.script)
        results = build().execute(raise_on_error=False)
    return results


def raise_errors(results: list) -> list:
    """`results` of `execute`, raising the first error among them."""
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results
