#!/bin/sh
# Redis in the foreground on every interface of the container, logging to stdout.
# Test settings: no password, protected mode off (the port is published on the host's
# loopback only), append-only file without fsync, no RDB snapshots.
# Extra arguments are passed to redis-server (e.g. --notify-keyspace-events KEA).
set -eu
exec redis-server \
    --bind 0.0.0.0 \
    --port 6379 \
    --protected-mode no \
    --daemonize no \
    --dir /data \
    --save '' \
    --appendonly yes \
    --appendfsync no \
    --logfile '' \
    --maxclients 4000 \
    "$@"
