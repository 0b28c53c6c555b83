-- simba: acquire or renew a mutex, or join its wait queue.
--
-- KEYS[1] owner key `P:{M}` (string: the owner's contender id, PX = ttl + transition);
--         also the name of the mutex channel (`acquired@@<id>` broadcasts)
-- KEYS[2] owner metadata `P:{M}:owner` (hash: owner, acquired_at, ttl_at, transition_at, fence)
-- KEYS[3] wait queue `P:{M}:contender` (sorted set: contender id -> arrival in server
--         seconds with a microsecond fraction, less 0.5: see below)
-- KEYS[4] waiter expiry `P:{M}:contender:expires` (sorted set: contender id -> expiry, server ms)
-- KEYS[5] fence counter `P:{M}:fence`
-- KEYS[6] handoff reservation `P:{M}:handoff` (string: the waiter a release handed the
--         mutex to, PX = a short window in which only that waiter may take the free mutex)
-- ARGV[1] contender id, ARGV[2] ttl ms, ARGV[3] transition ms,
-- ARGV[4] publish command: 'PUBLISH' (standalone, Sentinel) or 'SPUBLISH' (Cluster)
-- ARGV[5] '1': keep the restart quarantine, with KEYS[7] the boot marker `P:{}:boot`
--         (standalone and Sentinel only); '0': no quarantine
-- ARGV[6] '1': a release just handed the mutex to this contender (a `released@@` on its
--         own channel), which then outranks a handoff reservation for another waiter
--
-- Returns {owner id ('' when none), acquired_at, ttl_at, transition_at, fence, now}:
-- the owner after the call, and the server time (ms) it was evaluated at.
--
-- Safe to run twice: run again by the owner it is a renewal (same fence, same acquired_at).
local owner_key, meta_key, queue_key, expires_key, fence_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local handoff_key = KEYS[6]
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local transition = tonumber(ARGV[3])
local publish = ARGV[4]
local lease = ttl + transition
-- The fence counter outlives any ownership; it is seeded from the server clock when missing.
local fence_keep = math.max(2592000000, 2 * lease)

-- Numbers go to Redis as exact decimal strings (never in exponent notation).
local function s(n)
    return string.format('%.0f', n)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Restart quarantine. A missing boot marker means this server's data is new: first use,
-- or lost in a restart or flush — and with it, maybe the key of an owner that still
-- believes it owns until its lease ends. No free mutex is taken for one lease after the
-- marker is set. A server that kept its data kept the marker: no quarantine.
local not_before = 0
if ARGV[5] == '1' then
    local boot = redis.call('GET', KEYS[7])
    if not boot then
        boot = now
        redis.call('SET', KEYS[7], s(now))
    end
    not_before = tonumber(boot) + lease
end

-- The metadata of `owner`, or nil if the hash belongs to nobody or someone else
-- (e.g. an owner that set only the owner key, as the JVM Simba does).
local function meta_of(owner)
    local m = redis.call('HMGET', meta_key, 'owner', 'acquired_at', 'ttl_at', 'transition_at', 'fence')
    if m[1] == owner and m[5] then
        return m
    end
    return nil
end

local function leave_queue(who)
    redis.call('ZREM', queue_key, who)
    redis.call('ZREM', expires_key, who)
end

local owner = redis.call('GET', owner_key)

if owner == id then
    local m = meta_of(id)
    if m then
        -- Renewal: same fence, same acquired_at.
        redis.call('SET', owner_key, id, 'XX', 'PX', s(lease))
        redis.call('HSET', meta_key, 'ttl_at', s(now + ttl), 'transition_at', s(now + lease))
        redis.call('PEXPIRE', meta_key, s(lease))
        leave_queue(id)
        return { id, tonumber(m[2]), now + ttl, now + lease, tonumber(m[5]), now }
    end
    -- Our key without our metadata: start a new ownership (new fence) below.
    redis.call('DEL', owner_key)
    owner = false
end

-- A release handed the free mutex to a queued waiter: only that waiter may take it while
-- the reservation lasts (no barging past the queue).
local reserved = false
if not owner then
    reserved = redis.call('GET', handoff_key)
end
-- A contender that a release just handed the mutex to may take it over a reservation for
-- another: that release came after the reservation was made (the reserved waiter took the
-- mutex and released it, e.g. a JVM Simba, which leaves reservations alone).
local for_me = reserved == id or (reserved and ARGV[6] == '1')
if for_me then
    reserved = false
end

if not owner and not reserved and now >= not_before then
    if redis.call('SET', owner_key, id, 'NX', 'PX', s(lease)) then
        if for_me then
            redis.call('DEL', handoff_key)
        end
        if redis.call('EXISTS', fence_key) == 0 then
            -- Larger than any fence issued before the key was lost (one per microsecond at most).
            redis.call('SET', fence_key, t[1] .. string.format('%06d', tonumber(t[2])))
        end
        local fence = redis.call('INCR', fence_key)
        redis.call('PEXPIRE', fence_key, s(fence_keep))
        redis.call('DEL', meta_key)
        redis.call('HSET', meta_key, 'owner', id, 'acquired_at', s(now), 'ttl_at', s(now + ttl),
            'transition_at', s(now + lease), 'fence', s(fence))
        redis.call('PEXPIRE', meta_key, s(lease))
        leave_queue(id)
        redis.call(publish, owner_key, 'acquired@@' .. id)
        return { id, now, now + ttl, now + lease, fence, now }
    end
    owner = redis.call('GET', owner_key)
end

-- Someone else owns the mutex: join (or stay in) the wait queue and refresh our expiry.
local pttl = redis.call('PTTL', owner_key)
if pttl < 0 then
    pttl = lease
end
-- A live waiter calls again by the owner's transition_at (+ jitter), or sooner.
local keep = math.max(pttl, lease) + lease + 2000
-- The queue score is the arrival in seconds, microseconds as the fraction, less half a
-- second. The JVM Simba scores its waiters with the whole seconds of the same `TIME`: its
-- score S stands for an arrival somewhere in [S, S + 1), on average S + 0.5. Shifted by
-- half a second, our scores compare with its scores by expected arrival, so a release by
-- either serves both kinds of waiters in arrival order to within half a second (unshifted,
-- every JVM waiter of a second would sort ahead of ours of the same second: in a busy queue
-- ours would be served once a second).
local queued = redis.call('ZSCORE', queue_key, id)
if not queued then
    local arrival = tonumber(t[1]) - 0.5 + tonumber(t[2]) / 1000000
    redis.call('ZADD', queue_key, string.format('%.6f', arrival), id)
elseif tonumber(queued) >= 100000000000 then
    -- Queued in milliseconds by an earlier version of this script: keep the place.
    redis.call('ZADD', queue_key, 'XX', string.format('%.3f', tonumber(queued) / 1000 - 0.5), id)
end
redis.call('ZADD', expires_key, s(now + keep), id)
if redis.call('PTTL', queue_key) < keep then
    redis.call('PEXPIRE', queue_key, s(keep))
end
if redis.call('PTTL', expires_key) < keep then
    redis.call('PEXPIRE', expires_key, s(keep))
end
-- Purge waiters that stopped calling.
local dead = redis.call('ZRANGEBYSCORE', expires_key, '-inf', s(now), 'LIMIT', 0, 100)
if #dead > 0 then
    redis.call('ZREM', queue_key, unpack(dead))
    redis.call('ZREM', expires_key, unpack(dead))
end

if not owner then
    if reserved then
        -- Free, but handed to another waiter: look again when the reservation ends (its
        -- release will wake us when we reach the head of the queue).
        local left = math.max(redis.call('PTTL', handoff_key), 0)
        return { '', 0, now + left, now + left, 0, now }
    end
    -- Free, but in the restart quarantine: look again when it ends.
    return { '', 0, not_before, not_before, 0, now }
end
local m = meta_of(owner)
if m then
    return { owner, tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), now }
end
return { owner, 0, now + pttl, now + pttl, 0, now }
