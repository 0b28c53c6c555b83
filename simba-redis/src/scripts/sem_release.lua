-- simba: release the caller's permit and leave the wait queue, or only leave the queue
-- (after sem_common).
--
-- ARGV[1] contender id, ARGV[2] publish command ('PUBLISH' or 'SPUBLISH'),
-- ARGV[3] how many queued waiters to try at most, ARGV[4] '1': waiters are pushed (a
-- waiter that no publish reaches died and leaves the queue); '0': waiters poll (no push),
-- ARGV[5] '1': only leave the queue (a permit the caller holds stays held until its lease
-- ends: the caller lost track of it); '0': release.
--
-- Returns 1 when the caller held a permit (now freed), 0 otherwise. Safe to run twice.
--
-- Wake-ups (simba-core's `permit_wakes`): each waiter owed a free permit, passed-over
-- waiters (claim ended) skipped, and the waiter that counts after them (it looks again when
-- their claims end), each `released@@<id>` on the waiter's own channel
-- `P:{S}:@@sem:w:<waiter>`. A waiter no publish reaches leaves the queue and the next one
-- is tried in its stead. A freed permit that reached no waiter is said on the holders
-- channel.
local id = ARGV[1]
local publish = ARGV[2]
local tries = tonumber(ARGV[3])
local pushed = ARGV[4] == '1'

local held = ARGV[5] ~= '1' and redis.call('ZSCORE', holders_key, id) ~= false
if held then
    forget_holder(id)
end
local queued = redis.call('ZREM', queue_key, id) == 1
redis.call('ZREM', expires_key, id)
redis.call('ZREM', claims_key, id)
if not (held or queued) or not pushed then
    return held and 1 or 0
end

local free = recorded_permits() - redis.call('ZCARD', holders_key)
local message = 'released@@' .. id
local woken = 0
local deaf = {}
if free > 0 then
    scan_queue(function(who, claim)
        if tries <= 0 then
            return true
        end
        if counts(claim) then
            tries = tries - 1
            if redis.call(publish, holders_key .. ':w:' .. who, message) > 0 then
                woken = woken + 1
            else
                deaf[#deaf + 1] = who
            end
        end
        return woken > free
    end)
end
for _, who in ipairs(deaf) do
    forget_waiter(who)
end
if held and woken == 0 then
    redis.call(publish, holders_key, message)
end
return held and 1 or 0
