-- simba: read a semaphore's holders (after sem_common).
--
-- Returns {count (-1 when there is no holder), now, then per holder: id, acquired_at,
-- ttl_at, transition_at, fence}.
local out = { agreed() or -1, now }
local list = redis.call('ZRANGE', holders_key, 0, -1, 'WITHSCORES')
for i = 1, #list, 2 do
    local h = holder(list[i], tonumber(list[i + 1]))
    for _, v in ipairs(h) do
        out[#out + 1] = v
    end
end
return out
