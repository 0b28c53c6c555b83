-- simba: acquire or renew a permit of a semaphore, or wait in its queue (after sem_common).
--
-- ARGV[1] contender id, ARGV[2] ttl ms, ARGV[3] transition ms, ARGV[4] the permit count
-- asked for, ARGV[5] how soon (ms) a waiter whose free permit is owed to earlier waiters
-- looks again at the latest, ARGV[6] '1': keep the restart quarantine, with KEYS[7] the
-- boot marker `P:{}:boot` (standalone and Sentinel only); '0': not, ARGV[7] how long (ms)
-- a waiter owed a free permit has to take it (its claim).
--
-- Returns {holder id ('' when the caller holds nothing), acquired_at, ttl_at,
-- transition_at, fence, now, status, count}: status 'new' (the caller just got a permit),
-- 'renewed' (it held one), 'wait' (it waits: the times say when to look again) or
-- 'mismatch' (the holders agreed on another count: `count`). Safe to run twice: run again
-- by a holder it is a renewal (same fence, same acquired_at).
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local transition = tonumber(ARGV[3])
local permits = tonumber(ARGV[4])
local turn = tonumber(ARGV[5])
local claim_ms = tonumber(ARGV[7])
local lease = ttl + transition
-- The fence counter outlives every permit; it is seeded from the server clock.
local fence_keep = math.max(2592000000, 2 * lease)

local renewed = renew(id, ttl, lease, claim_ms)
if renewed then
    return renewed
end

local existing = agreed()
if existing and existing ~= permits then
    return { '', 0, 0, 0, 0, now, 'mismatch', existing }
end

-- Restart quarantine, as for a mutex: a server whose data is new (no boot marker) may
-- have lost the holders of permits that still believe they hold; no permit is handed out
-- for one lease after the marker is set.
local not_before = 0
if ARGV[6] == '1' then
    local boot = redis.call('GET', KEYS[7])
    if not boot then
        boot = now
        redis.call('SET', KEYS[7], s(now))
    end
    not_before = tonumber(boot) + lease
end

local count = redis.call('ZCARD', holders_key)
local free = permits - count
-- The caller's place is the number of waiters that count ahead of it (all of them for a
-- newcomer); it takes if that is below `free`. The others among the first `free` that
-- count are owed the free permits: their claims start now (none during the quarantine,
-- when no permit can be taken).
local mine, owed = owed_waiters(id, free)
local rank = redis.call('ZRANK', queue_key, id)
local takes = free > 0 and (mine or (not rank and #owed < free))
if now >= not_before then
    start_claims(owed, claim_ms)
end

if takes and now >= not_before then
    -- The next fence: above the last one, and at least the server's clock in
    -- microseconds (the same rule as a mutex's: see the crate docs, *Fencing tokens*).
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local last = tonumber(redis.call('GET', fence_key) or '0') or 0
    local fence = math.max(last + 1, clock)
    redis.call('SET', fence_key, s(fence), 'PX', s(fence_keep))
    if count == 0 then
        redis.call('HSET', data_key, 'permits', s(permits))
    end
    redis.call('ZADD', holders_key, s(now + lease), id)
    redis.call('HSET', data_key, 'f:' .. id, s(fence), 'a:' .. id, s(now), 't:' .. id, s(now + ttl))
    keep_for(lease)
    forget_waiter(id)
    return { id, now, now + ttl, now + lease, fence, now, 'new', permits }
end

-- Wait: look again when the quarantine ends; when the free permits are owed to earlier
-- waiters, when the first of their claims ends (after `turn` at the latest); else when
-- the first lease ends. The caller called: it is not passed over any more.
local look_at
if now < not_before then
    look_at = not_before
elseif free > 0 then
    look_at = now + turn
    for _, w in ipairs(owed) do
        look_at = math.min(look_at, math.max(w[2] or (now + claim_ms), now))
    end
else
    local first = redis.call('ZRANGE', holders_key, 0, 0, 'WITHSCORES')
    look_at = tonumber(first[2]) or now
end
if rank then
    redis.call('ZREM', claims_key, id)
else
    local arrival = tonumber(t[1]) * 1000000 + tonumber(t[2])
    redis.call('ZADD', queue_key, s(arrival), id)
end
-- A live waiter calls again by `look_at` (+ jitter): it keeps its place a lease longer.
local keep = math.max(look_at - now, 0) + lease + 2000
redis.call('ZADD', expires_key, s(now + keep), id)
for _, key in ipairs({ queue_key, expires_key }) do
    if redis.call('PTTL', key) < keep then
        redis.call('PEXPIRE', key, s(keep))
    end
end
return { '', 0, look_at, look_at, 0, now, 'wait', permits }
