-- simba: renew a permit the caller holds; never takes one (after sem_common).
--
-- ARGV[1] contender id, ARGV[2] ttl ms, ARGV[3] transition ms.
-- Returns as sem_acquire.lua: 'renewed', or 'lost' with no holder (the caller's permit
-- ended: its lease passed, or it was released).
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local lease = ttl + tonumber(ARGV[3])
local renewed = renew(id, ttl, lease)
if renewed then
    return renewed
end
return { '', 0, now, now, 0, now, 'lost', 0 }
