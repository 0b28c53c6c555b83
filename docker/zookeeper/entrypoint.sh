#!/bin/sh
# ZooKeeper in the foreground, configured by /etc/simba/zoo.cfg, logging to stderr.
# Extra arguments are passed to java before the main class (e.g. -Dzookeeper.x=y).
set -eu
exec java -Xms32m -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Djava.net.preferIPv4Stack=true \
    -Dzookeeper.admin.enableServer=false \
    -Dorg.slf4j.simpleLogger.showDateTime=true \
    "$@" \
    -cp /usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar \
    org.apache.zookeeper.server.quorum.QuorumPeerMain /etc/simba/zoo.cfg
