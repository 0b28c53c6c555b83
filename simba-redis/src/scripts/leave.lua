-- simba: remove a contender from the wait queue of a mutex.
--
-- KEYS[3] wait queue, KEYS[4] waiter expiry (as in acquire.lua); ARGV[1] contender id.
-- Returns how many entries were removed. Safe to run twice.
return redis.call('ZREM', KEYS[3], ARGV[1]) + redis.call('ZREM', KEYS[4], ARGV[1])
