"""The Redis job store's Lua scripts: each step that must not be seen half done, which
Redis runs atomically. KEYS and ARGV as redis_store.py passes them; `ARGV`'s key
prefix, where a script names keys it finds on its way (a job's, a batch's lines').
"""

CLAIM = """
local now = tonumber(ARGV[1])
local id = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, 1)[1]
if not id then
  id = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not id then return false end
  redis.call('ZREM', KEYS[1], id)
end
local key = ARGV[4] .. 'job:' .. id
local deadline = tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], deadline, id)
redis.call('HSET', key, 'status', 'running', 'owner', ARGV[3], 'lease_until', deadline,
  'updated', ARGV[1])
redis.call('HINCRBY', key, 'attempts', 1)
return redis.call('HGETALL', key)
"""
RENEW = """
local key = ARGV[4] .. 'job:' .. ARGV[1]
if redis.call('HGET', key, 'owner') ~= ARGV[2] then return 0 end
if redis.call('HGET', key, 'status') ~= 'running' then return 0 end
redis.call('HSET', key, 'lease_until', ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
FINISH = """
local key = ARGV[8] .. 'job:' .. ARGV[1]
if redis.call('HGET', key, 'owner') ~= ARGV[2] then return 0 end
if redis.call('HGET', key, 'status') ~= 'running' then return 0 end
local now = tonumber(ARGV[6])
redis.call('HSET', key, 'status', ARGV[3], 'result_status', ARGV[4], 'result', ARGV[5],
  'updated', ARGV[6])
redis.call('HDEL', key, 'owner')
redis.call('ZREM', KEYS[1], ARGV[1])
local batch = redis.call('HGET', key, 'batch_id')
if batch then
  local bkey = ARGV[8] .. 'batch:' .. batch
  if redis.call('HINCRBY', bkey, 'open', -1) <= 0 then
    redis.call('SADD', ARGV[8] .. 'unsettled', batch)
  end
  redis.call('HINCRBY', bkey, tonumber(ARGV[4]) < 400 and 'completed' or 'failed', 1)
else
  redis.call('PEXPIRE', key, ARGV[7])
end
if redis.call('HEXISTS', key, 'webhook') == 1 then
  redis.call('HSET', key, 'hook_state', 'pending')
  redis.call('ZADD', KEYS[2], now, ARGV[1])
end
return 1
"""
RELEASE = """
local n = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[2] .. 'job:' .. id
  if redis.call('HGET', key, 'owner') == ARGV[1] then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HSET', key, 'status', 'queued', 'lease_until', 0)
    redis.call('HDEL', key, 'owner')
    redis.call('ZADD', KEYS[2], redis.call('HGET', key, 'score'), id)
    n = n + 1
  end
end
return n
"""
DUE_HOOK = """
local id = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)[1]
if not id then return false end
local key = ARGV[3] .. 'job:' .. id
if redis.call('EXISTS', key) == 0 then
  redis.call('ZREM', KEYS[1], id)
  return false
end
redis.call('ZADD', KEYS[1], ARGV[2], id)
return redis.call('HGETALL', key)
"""
HOOK_TRIED = """
local key = ARGV[4] .. 'job:' .. ARGV[1]
if redis.call('EXISTS', key) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('HSET', key, 'hook_state', ARGV[2])
redis.call('HINCRBY', key, 'hook_attempts', 1)
if ARGV[2] == 'pending' then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""
CANCEL = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
if (redis.call('HGET', KEYS[1], 'tenant') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
local dropped = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local key = ARGV[3] .. 'job:' .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    redis.call('HSET', key, 'status', 'cancelled')
    redis.call('ZREM', KEYS[3], id)
    dropped = dropped + 1
  end
end
if redis.call('HINCRBY', KEYS[1], 'open', -dropped) <= 0 then
  redis.call('SADD', ARGV[3] .. 'unsettled', ARGV[4])
end
return 1
"""
SETTLE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'open')) > 0 then return 0 end
local tenant = redis.call('HGET', KEYS[1], 'tenant')
local names = {'batch_output.jsonl', 'batch_error.jsonl'}
local fields = {'output_file_id', 'error_file_id'}
for i = 1, 2 do
  local id, content = ARGV[3 + i], ARGV[5 + i]
  if content ~= '' then
    local fkey = ARGV[1] .. 'file:' .. id
    redis.call('HSET', fkey, 'purpose', 'batch_output', 'filename', names[i],
      'created', ARGV[2], 'content', content)
    if tenant then redis.call('HSET', fkey, 'tenant', tenant) end
    redis.call('PEXPIRE', fkey, ARGV[3])
    redis.call('ZADD', ARGV[1] .. 'files:of:' .. (tenant or ''), ARGV[2], id)
    redis.call('HSET', KEYS[1], fields[i], id)
  end
end
local final = status == 'cancelling' and 'cancelled' or 'completed'
redis.call('HSET', KEYS[1], 'status', final, 'finished_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  redis.call('DEL', ARGV[1] .. 'job:' .. id)
end
redis.call('DEL', KEYS[2])
redis.call('SREM', ARGV[1] .. 'unsettled', ARGV[8])
return 1
"""

#: a slice of a file's `content` field: only the slice crosses the network
WRITTEN = """
local content = redis.call('HGET', KEYS[1], 'content')
if not content then return false end
return string.sub(content, tonumber(ARGV[1]) + 1, tonumber(ARGV[1]) + tonumber(ARGV[2]))
"""

PUT_PART = """
local now = tonumber(ARGV[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local used = 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(size) end
local size = string.len(ARGV[2])
if used + size > tonumber(ARGV[3]) then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[2], ARGV[5], size)
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[5])
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], math.floor(tonumber(ARGV[4]) * 1000)) end
return 1
"""

#: every script, registered with the server once (redis-py sends the script itself
#: only when the server does not know it yet)
ALL = (CLAIM, RENEW, FINISH, RELEASE, DUE_HOOK, HOOK_TRIED, CANCEL, SETTLE, WRITTEN, PUT_PART)
