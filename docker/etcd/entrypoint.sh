#!/bin/sh
# One etcd member in the foreground: clients on every interface of the container (the
# port is published on the host's loopback only), peers on the container's loopback, no
# authentication, logs to stderr. Extra arguments are passed to etcd.
set -eu
exec etcd \
    --name simba \
    --data-dir /var/lib/etcd/data \
    --listen-client-urls http://0.0.0.0:2379 \
    --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster simba=http://127.0.0.1:2380 \
    --initial-cluster-state new \
    --logger zap --log-outputs stderr \
    "$@"
