-- simba semaphores: the part every semaphore script starts with (prepended to each).
--
-- KEYS[1] holders `P:{S}:@@sem` (sorted set: holder id -> end of its lease, server ms);
--         also the channel on which a release that reached no waiter says `released@@<id>`
-- KEYS[2] data `P:{S}:@@sem:data` (hash: `permits` -> the count the holders agreed on;
--         per holder `f:<id>` fence, `a:<id>` acquired_at, `t:<id>` ttl_at)
-- KEYS[3] wait queue `P:{S}:@@sem:queue` (sorted set: waiter id -> arrival, server µs)
-- KEYS[4] waiter expiry `P:{S}:@@sem:expires` (sorted set: waiter id -> expiry, server ms)
-- KEYS[5] fence counter `P:{S}:@@sem:fence` (the last fence handed out)
-- A waiter is woken on its own channel `P:{S}:@@sem:w:<id>`.
--
-- Every time is the server's (`TIME`); holders past their lease and waiters past their
-- expiry are dropped here, before anything else looks at them.
local holders_key, data_key, queue_key, expires_key, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

-- Numbers go to Redis as exact decimal strings (never in exponent notation).
local function s(n)
    return string.format('%.0f', n)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function forget_holder(who)
    redis.call('ZREM', holders_key, who)
    redis.call('HDEL', data_key, 'f:' .. who, 'a:' .. who, 't:' .. who)
end

local function forget_waiter(who)
    redis.call('ZREM', queue_key, who)
    redis.call('ZREM', expires_key, who)
end

for _, who in ipairs(redis.call('ZRANGEBYSCORE', holders_key, '-inf', s(now))) do
    forget_holder(who)
end
local dead = redis.call('ZRANGEBYSCORE', expires_key, '-inf', s(now), 'LIMIT', 0, 100)
for _, who in ipairs(dead) do
    forget_waiter(who)
end

-- The agreed count, or nil when there is no holder.
local function agreed()
    if redis.call('ZCARD', holders_key) == 0 then
        return nil
    end
    return tonumber(redis.call('HGET', data_key, 'permits'))
end

-- `who` as a holder: {id, acquired_at, ttl_at, transition_at, fence}.
local function holder(who, transition_at)
    local m = redis.call('HMGET', data_key, 'a:' .. who, 't:' .. who, 'f:' .. who)
    return { who, tonumber(m[1]) or 0, tonumber(m[2]) or 0, transition_at, tonumber(m[3]) or 0 }
end

-- Keeps the holders and their data as long as the longest lease among them.
local function keep_for(ms)
    for _, key in ipairs({ holders_key, data_key }) do
        if redis.call('PTTL', key) < ms then
            redis.call('PEXPIRE', key, s(ms))
        end
    end
end

-- Renews `who`'s permit if it holds one (in its lease): its reply, or nil.
local function renew(who, ttl, lease)
    if not redis.call('ZSCORE', holders_key, who) then
        return nil
    end
    redis.call('ZADD', holders_key, 'XX', s(now + lease), who)
    redis.call('HSET', data_key, 't:' .. who, s(now + ttl))
    keep_for(lease)
    forget_waiter(who)
    local h = holder(who, now + lease)
    return { h[1], h[2], h[3], h[4], h[5], now, 'renewed', 0 }
end
