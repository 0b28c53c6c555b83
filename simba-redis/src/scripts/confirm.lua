-- simba: an acquisition the replicas confirmed counts: clear its `pending` mark and
-- announce it (`acquired@@<id>` on the mutex channel).
--
-- KEYS as in acquire.lua (KEYS[1] owner key, KEYS[2] owner metadata).
-- ARGV[1] contender id, ARGV[2] the fence that acquisition got, ARGV[3] publish command.
-- Returns 1 when that acquisition still holds the mutex, 0 otherwise. Safe to run twice.
local owner_key, meta_key = KEYS[1], KEYS[2]
local id = ARGV[1]
if redis.call('GET', owner_key) ~= id then
    return 0
end
local m = redis.call('HMGET', meta_key, 'owner', 'fence')
if m[1] ~= id or m[2] ~= ARGV[2] then
    return 0
end
redis.call('HDEL', meta_key, 'pending')
redis.call(ARGV[3], owner_key, 'acquired@@' .. id)
return 1
