#!/bin/sh
# PostgreSQL 15 in the foreground on every interface of the container, logging to stderr.
# At first start (empty $PGDATA) it creates the cluster: user "postgres" with password
# "simba" and the database "simba". Authentication is "trust" for every TCP client: this
# is a test server whose port is published on the host's loopback only.
# Extra arguments are passed to postgres (e.g. -c log_statement=all).
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
exec postgres -D "$PGDATA" \
    -c listen_addresses='*' \
    -c fsync=off \
    -c full_page_writes=off \
    -c max_connections=200 \
    "$@"
