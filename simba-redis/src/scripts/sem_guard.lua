-- simba: renew a permit the caller holds; never takes one (after sem_common).
--
-- ARGV[1] contender id, ARGV[2] ttl ms, ARGV[3] transition ms, ARGV[4] how long (ms) a
-- waiter owed a free permit has to take it (a renewal starts the claims, as sem_acquire's).
-- Returns as sem_acquire.lua: 'renewed', or 'lost' with no holder (the caller's permit
-- ended: its lease passed, or it was released).
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
local lease = ttl + tonumber(ARGV[3])
local renewed = renew(id, ttl, lease, tonumber(ARGV[4]))
if renewed then
    return renewed
end
return { '', 0, now, now, 0, now, 'lost', 0 }
