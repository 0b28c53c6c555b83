-- simba semaphores: the part every semaphore script starts with (prepended to each).
--
-- KEYS[1] holders `P:{S}:@@sem` (sorted set: holder id -> end of its lease, server ms);
--         also the channel on which a release that reached no waiter says `released@@<id>`
-- KEYS[2] data `P:{S}:@@sem:data` (hash: `permits` -> the count the holders agreed on;
--         per holder `f:<id>` fence, `a:<id>` acquired_at, `t:<id>` ttl_at)
-- KEYS[3] wait queue `P:{S}:@@sem:queue` (sorted set: waiter id -> arrival, server µs)
-- KEYS[4] waiter expiry `P:{S}:@@sem:expires` (sorted set: waiter id -> expiry, server ms)
-- KEYS[5] fence counter `P:{S}:@@sem:fence` (the last fence handed out)
-- KEYS[6] claims `P:{S}:@@sem:claims` (sorted set: waiter id -> claim_by, server ms: until
--         when a waiter owed a free permit may take it; at and after it, the waiter is
--         passed over until it calls again)
-- A waiter is woken on its own channel `P:{S}:@@sem:w:<id>`.
--
-- Every time is the server's (`TIME`); holders past their lease and waiters past their
-- expiry are dropped here, before anything else looks at them. The rule is simba-core's
-- `admit_permit` (acquire, renew) and `permit_wakes` (release, leave).
local holders_key, data_key, queue_key, expires_key, fence_key, claims_key =
    KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

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
    redis.call('ZREM', claims_key, who)
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

-- Whether waiter `who`, with claim deadline `claim` (nil: none), counts at `now`: a
-- waiter whose claim has come is passed over.
local function counts(claim)
    return claim == nil or claim > now
end

-- The queue in order, read a few entries at a time: calls `visit(who, claim)` for each
-- waiter until it returns true.
local function scan_queue(visit)
    local from = 0
    while true do
        local page = redis.call('ZRANGE', queue_key, from, from + 15)
        if #page == 0 then
            return
        end
        for _, who in ipairs(page) do
            if visit(who, tonumber(redis.call('ZSCORE', claims_key, who))) then
                return
            end
        end
        from = from + #page
    end
end

-- The first `free` waiters that count, `caller` counting wherever it is queued (it called,
-- so it is not stopped): returns whether `caller` is among them, and the others, as
-- {{id, claim or nil}, ...} in queue order (the waiters owed a free permit).
local function owed_waiters(caller, free)
    local owed, found, seen = {}, false, 0
    if free > 0 then
        scan_queue(function(who, claim)
            if who == caller then
                found = true
                seen = seen + 1
            elseif counts(claim) then
                owed[#owed + 1] = { who, claim }
                seen = seen + 1
            end
            return seen >= free
        end)
    end
    return found, owed
end

-- Starts the claim of each owed waiter that has none: it has until `now + claim_ms` to
-- take its permit. The claims key lives as long as the queue's entries.
local function start_claims(owed, claim_ms)
    local started = false
    for _, w in ipairs(owed) do
        if w[2] == nil then
            redis.call('ZADD', claims_key, s(now + claim_ms), w[1])
            started = true
        end
    end
    if started then
        local keep = redis.call('PTTL', expires_key)
        if keep > 0 and redis.call('PTTL', claims_key) < keep then
            redis.call('PEXPIRE', claims_key, keep)
        end
    end
end

-- The count on record (the holders' agreed one; kept after the last holder left, until the
-- data key expires), or 0.
local function recorded_permits()
    return tonumber(redis.call('HGET', data_key, 'permits')) or 0
end

-- Renews `who`'s permit if it holds one (in its lease): its reply, or nil. Like every
-- decision but a mismatch, it starts the claims of the waiters owed a free permit.
local function renew(who, ttl, lease, claim_ms)
    if not redis.call('ZSCORE', holders_key, who) then
        return nil
    end
    local _, owed = owed_waiters(who, recorded_permits() - redis.call('ZCARD', holders_key))
    start_claims(owed, claim_ms)
    redis.call('ZADD', holders_key, 'XX', s(now + lease), who)
    redis.call('HSET', data_key, 't:' .. who, s(now + ttl))
    keep_for(lease)
    forget_waiter(who)
    local h = holder(who, now + lease)
    return { h[1], h[2], h[3], h[4], h[5], now, 'renewed', 0 }
end
