#!/bin/sh
# PostgreSQL 15 in the background and PgBouncer in the foreground, both logging to stderr.
# At first start (empty $PGDATA) it creates the cluster as docker/postgres does: user
# "postgres" with password "simba", the database "simba", "trust" for every TCP client
# (a test server whose ports are published on the host's loopback only). PgBouncer starts
# once PostgreSQL answers, so a client of port 6432 finds both ready.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    echo "simba-entrypoint: initialising $PGDATA" >&2
    pwfile=$(mktemp)
    printf 'simba\n' > "$pwfile"
    initdb -D "$PGDATA" --username=postgres --pwfile="$pwfile" --auth=trust \
        --encoding=UTF8 --locale=C --no-sync >/dev/null
    rm -f "$pwfile"
    printf 'host all all 0.0.0.0/0 trust\nhost all all ::/0 trust\n' >> "$PGDATA/pg_hba.conf"
    echo 'CREATE DATABASE simba;' | postgres --single -D "$PGDATA" -c exit_on_error=true postgres >/dev/null
fi
postgres -D "$PGDATA" \
    -c listen_addresses='*' \
    -c fsync=off \
    -c full_page_writes=off \
    -c max_connections=400 &
# Up to 60 s for PostgreSQL to answer (pg_isready polls: there is no event to wait on).
i=0
until pg_isready -q -h 127.0.0.1 -p 5432 -U postgres -d simba; do
    i=$((i + 1))
    [ "$i" -lt 600 ] || { echo "simba-entrypoint: PostgreSQL did not answer within 60 s" >&2; exit 1; }
    sleep 0.1
done
exec pgbouncer /etc/simba-pgbouncer/pgbouncer.ini
