-- simba: release a mutex the caller owns so that it stays held for ARGV[3] ms more (by the
-- server's clock), renewed by nobody and taken by nobody until then (ShedLock's
-- lockAtLeastFor).
--
-- KEYS as in acquire.lua (KEYS[1] owner key, KEYS[2] owner metadata).
-- ARGV[1] contender id, ARGV[2] the hold's owner id (`held@@<id>`, which no contender has),
-- ARGV[3] hold in ms (at least 1).
--
-- Returns 1 when the caller owned the mutex and it is now held until now + ARGV[3], 0 when
-- it did not own it (nothing changes). Safe to run twice: the second run returns 0.
--
-- The owner key keeps the JVM Simba's rules: it holds an owner id with a PX lease and is
-- taken only with NX. Its value becomes the hold's id, so the caller can no longer renew
-- (renewals check that the key holds the caller's id) and nobody can take it before the
-- key expires. The metadata keeps the fence and acquired_at, with ttl_at = transition_at =
-- the end of the hold. Nothing is published: the mutex is not free, and waiters look again
-- when the hold ends, as they do when a lease ends.
local owner_key, meta_key = KEYS[1], KEYS[2]
local id = ARGV[1]
local holder = ARGV[2]
local hold = tonumber(ARGV[3])

if redis.call('GET', owner_key) ~= id then
    return 0
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ends = string.format('%.0f', now + hold)

redis.call('SET', owner_key, holder, 'XX', 'PX', ARGV[3])
local m = redis.call('HMGET', meta_key, 'owner', 'fence')
if m[1] == id and m[2] then
    redis.call('HSET', meta_key, 'owner', holder, 'ttl_at', ends, 'transition_at', ends)
    redis.call('PEXPIRE', meta_key, ARGV[3])
else
    -- No metadata of ours (lost): readers see the hold through the key's PTTL.
    redis.call('DEL', meta_key)
end
return 1
