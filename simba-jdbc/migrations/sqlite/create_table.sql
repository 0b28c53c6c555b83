CREATE TABLE IF NOT EXISTS {table} (
    mutex         VARCHAR(200) NOT NULL PRIMARY KEY,
    acquired_at   BIGINT NOT NULL DEFAULT 0,
    ttl_at        BIGINT NOT NULL DEFAULT 0,
    transition_at BIGINT NOT NULL DEFAULT 0,
    owner_id      VARCHAR(200) NOT NULL DEFAULT '',
    version       BIGINT NOT NULL DEFAULT 0,
    waiter_id     VARCHAR(200) NOT NULL DEFAULT '',
    waiter_until  BIGINT NOT NULL DEFAULT 0
)
