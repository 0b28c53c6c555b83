#!/bin/sh
# MariaDB in the foreground on every interface of the container, logging to stderr.
# At first start (empty /var/lib/mysql) it creates the system tables, sets root's password
# to "simba" (for root@localhost and root@'%') and creates the database "simba".
# Extra arguments are passed to mariadbd.
set -eu
datadir=/var/lib/mysql
if [ ! -d "$datadir/mysql" ]; then
    echo "simba-entrypoint: initialising $datadir" >&2
    mariadb-install-db --datadir="$datadir" --auth-root-authentication-method=normal \
        --skip-test-db >/dev/null
    init=/run/mysqld/simba-init.sql
    # mariadb-install-db also makes root@<container hostname>, useless with skip-name-resolve.
    cat > "$init" <<SQL
CREATE USER IF NOT EXISTS 'root'@'%' IDENTIFIED BY 'simba';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'%' WITH GRANT OPTION;
ALTER USER 'root'@'localhost' IDENTIFIED BY 'simba';
DROP USER IF EXISTS 'root'@'127.0.0.1', 'root'@'::1', 'root'@'$(cat /proc/sys/kernel/hostname)';
CREATE DATABASE IF NOT EXISTS simba;
SQL
    set -- --init-file="$init" "$@"
fi
exec mariadbd "$@"
