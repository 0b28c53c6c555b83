-- simba: acquire or renew a mutex, or join its wait queue.
--
-- KEYS[1] owner key `P:{M}` (string: the owner's contender id, PX = ttl + transition);
--         also the name of the mutex channel (`acquired@@<id>` broadcasts)
-- KEYS[2] owner metadata `P:{M}:owner` (hash: owner, acquired_at, ttl_at, transition_at, fence)
-- KEYS[3] wait queue `P:{M}:contender` (sorted set: contender id -> arrival in server
--         seconds with a microsecond fraction, less 0.5: see below)
-- KEYS[4] waiter expiry `P:{M}:contender:expires` (sorted set: contender id -> expiry, server ms)
-- KEYS[5] fence counter `P:{M}:fence` (the last fence handed out)
-- KEYS[6] handoff reservation `P:{M}:handoff` (string: the waiter a release handed the
--         mutex to, PX = a short window in which only that waiter may take the free mutex)
-- KEYS[7] primary marker `P:{M}:primary` (hash: replid, the replication id of the primary
--         that last ran this script for the mutex; since, server ms it was first seen)
-- ARGV[1] contender id, ARGV[2] ttl ms, ARGV[3] transition ms,
-- ARGV[4] publish command: 'PUBLISH' (standalone, Sentinel) or 'SPUBLISH' (Cluster)
-- ARGV[5] '1': keep the restart quarantine, with KEYS[8] the boot marker `P:{}:boot`
--         (standalone and Sentinel only); '0': no restart quarantine
-- ARGV[6] '1': a release just handed the mutex to this contender (a `released@@` on its
--         own channel), which then outranks a handoff reservation for another waiter
-- ARGV[7] '1': keep the failover quarantine (KEYS[7]); '0': not
-- ARGV[8] '1': the caller checks the replicas before it counts a new ownership: count
--         the replicas online, mark a new ownership `pending` and leave its `acquired@@`
--         to the caller (published once the replicas confirmed it); '0': no check
--
-- Returns {owner id ('' when none), acquired_at, ttl_at, transition_at, fence, now,
-- replicas, status}: the owner after the call, the server time (ms) it was evaluated at,
-- the number of replicas online at this primary (-1 when not counted), and 'new' (the
-- caller just became the owner), 'renewed' (the caller owned it already), 'pending' (another
-- contender's ownership that its replicas have not confirmed yet) or ''.
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

-- The replication section of INFO: the replicas online, and this primary's replication
-- id, which a replica changes when it is promoted (and a server when it restarts).
local replicas, replid = -1, nil
if ARGV[7] == '1' or ARGV[8] == '1' then
    local info = redis.call('INFO', 'replication')
    replid = string.match(info, 'master_replid:(%w+)')
    replicas = 0
    for _ in string.gmatch(info, 'slave%d+:[^\r\n]*state=online') do
        replicas = replicas + 1
    end
end
local pending = ARGV[8] == '1'

-- The next fence: above the last one this server knows, and at least the server's clock
-- in microseconds, so that it is also above every fence handed out by a primary whose
-- writes this server lost (see the crate docs, *Fencing tokens*).
local function next_fence()
    local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local last = tonumber(redis.call('GET', fence_key) or '0') or 0
    local fence = math.max(last + 1, clock)
    redis.call('SET', fence_key, s(fence), 'PX', s(fence_keep))
    return fence
end

-- Restart quarantine. A missing boot marker means this server's data is new: first use,
-- or lost in a restart or flush — and with it, maybe the key of an owner that still
-- believes it owns until its lease ends. No free mutex is taken for one lease after the
-- marker is set. A server that kept its data kept the marker: no quarantine.
local not_before = 0
if ARGV[5] == '1' then
    local boot = redis.call('GET', KEYS[8])
    if not boot then
        boot = now
        redis.call('SET', KEYS[8], s(now))
    end
    not_before = tonumber(boot) + lease
end

-- Failover quarantine. A primary marker of another replication id means that this
-- mutex's data came to this primary from another one: a replica promoted since (which
-- may lack the last writes of the old primary, an owner key among them) or a restart. No
-- free mutex is taken for one lease after this primary first saw the mutex. A missing
-- marker is the mutex's first use (or the restart quarantine's case).
if ARGV[7] == '1' and replid then
    local mark = redis.call('HMGET', KEYS[7], 'replid', 'since')
    local since = tonumber(mark[2])
    if mark[1] ~= replid then
        since = mark[1] and now or 0
        redis.call('HSET', KEYS[7], 'replid', replid, 'since', s(since))
    end
    redis.call('PEXPIRE', KEYS[7], s(fence_keep))
    if since and since > 0 then
        not_before = math.max(not_before, since + lease)
    end
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
        return { id, tonumber(m[2]), now + ttl, now + lease, tonumber(m[5]), now, replicas, 'renewed' }
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
        local fence = next_fence()
        redis.call('DEL', meta_key)
        redis.call('HSET', meta_key, 'owner', id, 'acquired_at', s(now), 'ttl_at', s(now + ttl),
            'transition_at', s(now + lease), 'fence', s(fence))
        if pending then
            redis.call('HSET', meta_key, 'pending', '1')
        end
        redis.call('PEXPIRE', meta_key, s(lease))
        leave_queue(id)
        if not pending then
            redis.call(publish, owner_key, 'acquired@@' .. id)
        end
        return { id, now, now + ttl, now + lease, fence, now, replicas, 'new' }
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
    -- A score in milliseconds: convert it to seconds, keeping the place.
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
        return { '', 0, now + left, now + left, 0, now, replicas, '' }
    end
    -- Free, but in a quarantine: look again when it ends.
    return { '', 0, not_before, not_before, 0, now, replicas, '' }
end
local m = meta_of(owner)
if m then
    local status = ''
    if redis.call('HGET', meta_key, 'pending') then
        status = 'pending'
    end
    return { owner, tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), now, replicas, status }
end
return { owner, 0, now + pttl, now + pttl, 0, now, replicas, '' }
