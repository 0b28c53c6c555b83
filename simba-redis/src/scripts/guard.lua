-- simba: renew an ownership the caller holds; never takes a mutex, never queues.
--
-- KEYS and ARGV as in acquire.lua (ARGV[5] to ARGV[7] are not used here).
-- Returns {owner id ('' when none), acquired_at, ttl_at, transition_at, fence, now,
-- replicas, status}, as acquire.lua does.
-- Safe to run twice.
local owner_key, meta_key, queue_key, expires_key, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local transition = tonumber(ARGV[3])
local publish = ARGV[4]
local lease = ttl + transition
local fence_keep = math.max(2592000000, 2 * lease)
local pending = ARGV[8] == '1'

-- Numbers go to Redis as exact decimal strings (never in exponent notation).
local function s(n)
    return string.format('%.0f', n)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local replicas = -1
if pending then
    replicas = 0
    for _ in string.gmatch(redis.call('INFO', 'replication'), 'slave%d+:[^\r\n]*state=online') do
        replicas = replicas + 1
    end
end

local function meta_of(owner)
    local m = redis.call('HMGET', meta_key, 'owner', 'acquired_at', 'ttl_at', 'transition_at', 'fence')
    if m[1] == owner and m[5] then
        return m
    end
    return nil
end

local owner = redis.call('GET', owner_key)
if not owner then
    return { '', 0, 0, 0, 0, now, replicas, '' }
end

if owner == id then
    redis.call('SET', owner_key, id, 'XX', 'PX', s(lease))
    redis.call('ZREM', queue_key, id)
    redis.call('ZREM', expires_key, id)
    local m = meta_of(id)
    if m then
        -- The caller renews, so its acquisition was counted: no longer pending.
        redis.call('HDEL', meta_key, 'pending')
        redis.call('HSET', meta_key, 'ttl_at', s(now + ttl), 'transition_at', s(now + lease))
        redis.call('PEXPIRE', meta_key, s(lease))
        return { id, tonumber(m[2]), now + ttl, now + lease, tonumber(m[5]), now, replicas, 'renewed' }
    end
    -- Our key without our metadata (lost): the key is ours, so start a new ownership with a
    -- new fence (as acquire.lua computes it); the engine sees the fence change and reports
    -- the old ownership as lost.
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local last = tonumber(redis.call('GET', fence_key) or '0') or 0
    local fence = math.max(last + 1, clock)
    redis.call('SET', fence_key, s(fence), 'PX', s(fence_keep))
    redis.call('DEL', meta_key)
    redis.call('HSET', meta_key, 'owner', id, 'acquired_at', s(now), 'ttl_at', s(now + ttl),
        'transition_at', s(now + lease), 'fence', s(fence))
    if pending then
        redis.call('HSET', meta_key, 'pending', '1')
    else
        redis.call(publish, owner_key, 'acquired@@' .. id)
    end
    redis.call('PEXPIRE', meta_key, s(lease))
    return { id, now, now + ttl, now + lease, fence, now, replicas, 'new' }
end

local m = meta_of(owner)
if m then
    local status = ''
    if redis.call('HGET', meta_key, 'pending') then
        status = 'pending'
    end
    return { owner, tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), now, replicas, status }
end
local pttl = redis.call('PTTL', owner_key)
if pttl < 0 then
    pttl = lease
end
return { owner, 0, now + pttl, now + pttl, 0, now, replicas, '' }
