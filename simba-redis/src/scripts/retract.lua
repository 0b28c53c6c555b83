-- simba: take back an acquisition that the replica check refused (it does not count).
--
-- KEYS as in acquire.lua (KEYS[1] owner key, KEYS[2] owner metadata).
-- ARGV[1] contender id, ARGV[2] the fence that acquisition got, ARGV[3] publish command.
--
-- Deletes the owner key and its metadata only if they are still that acquisition's (the
-- caller's id, that fence), and says on the mutex channel that the mutex is free
-- (`released@@<id>`). Returns 1 when it deleted them, 0 otherwise. Safe to run twice.
local owner_key, meta_key = KEYS[1], KEYS[2]
local id = ARGV[1]
if redis.call('GET', owner_key) ~= id then
    return 0
end
local m = redis.call('HMGET', meta_key, 'owner', 'fence')
if m[1] ~= id or m[2] ~= ARGV[2] then
    return 0
end
redis.call('DEL', owner_key, meta_key)
redis.call(ARGV[3], owner_key, 'released@@' .. id)
return 1
