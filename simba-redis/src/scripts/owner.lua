-- simba: read the owner of a mutex without changing anything.
--
-- KEYS[1] owner key, KEYS[2] owner metadata (as in acquire.lua).
-- Returns {owner id ('' when none), acquired_at, ttl_at, transition_at, fence, now}.
local owner_key, meta_key = KEYS[1], KEYS[2]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local owner = redis.call('GET', owner_key)
if not owner then
    return { '', 0, 0, 0, 0, now }
end
local m = redis.call('HMGET', meta_key, 'owner', 'acquired_at', 'ttl_at', 'transition_at', 'fence')
if m[1] == owner and m[5] then
    return { owner, tonumber(m[2]), tonumber(m[3]), tonumber(m[4]), tonumber(m[5]), now }
end
local pttl = redis.call('PTTL', owner_key)
if pttl < 0 then
    pttl = 0
end
return { owner, 0, now + pttl, now + pttl, 0, now }
