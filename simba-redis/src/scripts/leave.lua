-- simba: remove a contender from the wait queue of a mutex.
--
-- KEYS[3] wait queue, KEYS[4] waiter expiry, KEYS[6] handoff reservation (as in
-- acquire.lua); ARGV[1] contender id. A reservation held by the contender is given up.
-- Returns how many queue entries were removed. Safe to run twice.
if redis.call('GET', KEYS[6]) == ARGV[1] then
    redis.call('DEL', KEYS[6])
end
return redis.call('ZREM', KEYS[3], ARGV[1]) + redis.call('ZREM', KEYS[4], ARGV[1])
