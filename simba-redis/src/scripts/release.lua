-- simba: release a mutex the caller owns and hand it to the longest live waiter.
--
-- KEYS as in acquire.lua.
-- ARGV[1] contender id, ARGV[2] publish command ('PUBLISH' or 'SPUBLISH'),
-- ARGV[3] how many queued waiters to try at most,
-- ARGV[4] how long (ms) the notified waiter alone may take the mutex (the reservation).
--
-- Returns {1, notified waiter ('' if none)} when released, {0, ''} when the caller did not own
-- the mutex (then it only leaves the queue). Safe to run twice: the second run returns {0, ''}.
--
-- Handoff: waiters are taken in arrival order; each gets `released@@<id>` on its own channel
-- `P:{M}:<waiter>`. A waiter whose publish reaches no subscriber (it died) is dropped and the
-- next one is tried. The waiter reached gets the reservation `P:{M}:handoff` for ARGV[4] ms:
-- until it takes the mutex or the reservation ends, the acquire script lets nobody else take
-- it (no barging). A paused waiter (a GC pause, a frozen VM) still counts as a receiver,
-- so the reservation is announced on `P:{M}:@@handoff` as `reserved@@<ms>:<waiter>`: the
-- stores of the other waiters wake them when it lapses untaken (unless an `acquired@@`
-- came first), and the first of them to call takes the mutex. The reservation is set only
-- here, once per release: nothing renews it. If no waiter was reached, `released@@<id>`
-- goes to the mutex channel.
local owner_key, meta_key, queue_key, expires_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local handoff_key = KEYS[6]
local id = ARGV[1]
local publish = ARGV[2]
local tries = tonumber(ARGV[3])
local reserve = ARGV[4]

if redis.call('GET', owner_key) ~= id then
    redis.call('ZREM', queue_key, id)
    redis.call('ZREM', expires_key, id)
    return { 0, '' }
end
redis.call('DEL', owner_key, meta_key)

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local dead = redis.call('ZRANGEBYSCORE', expires_key, '-inf', string.format('%.0f', now), 'LIMIT', 0, 100)
if #dead > 0 then
    redis.call('ZREM', queue_key, unpack(dead))
    redis.call('ZREM', expires_key, unpack(dead))
end

local message = 'released@@' .. id
for _ = 1, tries do
    local head = redis.call('ZRANGE', queue_key, 0, 0)
    if #head == 0 then
        break
    end
    local waiter = head[1]
    redis.call('ZREM', queue_key, waiter)
    redis.call('ZREM', expires_key, waiter)
    if redis.call(publish, owner_key .. ':' .. waiter, message) > 0 then
        redis.call('SET', handoff_key, waiter, 'PX', reserve)
        redis.call(publish, owner_key .. ':@@handoff', 'reserved@@' .. reserve .. ':' .. waiter)
        return { 1, waiter }
    end
end
redis.call(publish, owner_key, message)
return { 1, '' }
