-- simba: renew an ownership the caller holds; never takes a mutex, never queues.
--
-- KEYS and ARGV as in acquire.lua.
-- Returns {owner id ('' when none), acquired_at, ttl_at, transition_at, fence, now}.
-- Safe to run twice.
local owner_key, meta_key, queue_key, expires_key, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local transition = tonumber(ARGV[3])
local publish = ARGV[4]
local lease = ttl + transition
local fence_keep = math.max(2592000000, 2 * lease)

-- Numbers go to Redis as exact decimal strings (never in exponent notation).
local function s(n)
    return string.format('%.0f', n)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function meta_of(owner)
    local m = redis.call('HMGET', meta_key, 'owner', 'acquired_at', 'ttl_at', 'transition_at', 'fence')
    if m[1] == owner and m[5] then
        return m
    end
    return nil
end

local owner = redis.call('GET', owner_key)
if not owner then
    return { '', 0, 0, 0, 0, now }
end

if owner == id then
    redis.call('SET', owner_key, id, 'XX', 'PX', s(lease))
    redis.call('ZREM', queue_key, id)
    redis.call('ZREM', expires_key, id)
    local m = meta_of(id)
    if m then
        redis.call('HSET', meta_key, 'ttl_at', s(now + ttl), 'transition_at', s(now + lease))
        redis.call('PEXPIRE', meta_key, s(lease))
        return { id, tonumber(m[2]), now + ttl, now + lease, tonumber(m[5]), now }
    end
    -- Our key without our metadata (lost): the key is ours, so start a new ownership with a
    -- new fence; the engine sees the fence change and reports the old ownership as lost.
    if redis.call('EXISTS', fence_key) == 0 then
        redis.call('SET', fence_key, t[1] .. string.format('%06d', tonumber(t[2])))
    end
    local fence = redis.call('INCR', fence_key)
    redis.call('PEXPIRE', fence_key, s(fence_keep))
    redis.call('DEL', meta_key)
    redis.call('HSET', meta_key, 'owner', id, 'acquired_at', s(now), 'ttl_at', s(now + ttl),
        'transition_at', s(now + lease), 'fence', s(fence))
    redis.call('PEXPIRE', meta_key, s(lease))
    redis.call(publish, owner_key, 'acquired@@' .. id)
    return { id, now, now + ttl, now + lease, fence, now }
end

local m = meta_of(owner)
if m then
    return { owner, tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), now }
end
local pttl = redis.call('PTTL', owner_key)
if pttl < 0 then
    pttl = lease
end
return { owner, 0, now + pttl, now + pttl, 0, now }
