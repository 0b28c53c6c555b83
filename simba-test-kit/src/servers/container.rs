//! The testcontainers fallback (feature `containers`), used when no environment variable
//! is set and no local server binary is installed.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use testcontainers::core::IntoContainerPort;
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerRequest, GenericImage, ImageExt};

use super::{DATABASE, Origin, ServerKind, TestServer, probe};

const STARTUP: Duration = Duration::from_secs(120);

fn request(kind: ServerKind) -> (u16, ContainerRequest<GenericImage>) {
    match kind {
        ServerKind::Redis => (
            6379,
            GenericImage::new("redis", "7.2")
                .with_exposed_port(6379.tcp())
                .with_startup_timeout(STARTUP),
        ),
        ServerKind::Mysql => (
            3306,
            GenericImage::new("mariadb", "10.11")
                .with_exposed_port(3306.tcp())
                .with_env_var("MARIADB_ALLOW_EMPTY_ROOT_PASSWORD", "1")
                .with_env_var("MARIADB_DATABASE", DATABASE)
                .with_startup_timeout(STARTUP),
        ),
        ServerKind::Postgres => (
            5432,
            GenericImage::new("postgres", "15")
                .with_exposed_port(5432.tcp())
                .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                .with_env_var("POSTGRES_DB", DATABASE)
                .with_startup_timeout(STARTUP),
        ),
        ServerKind::Zookeeper => (
            2181,
            GenericImage::new("zookeeper", "3.8")
                .with_exposed_port(2181.tcp())
                .with_env_var("ZOO_TICK_TIME", "200")
                .with_env_var("ZOO_MAX_CLIENT_CNXNS", "0")
                .with_env_var("ZOO_ADMINSERVER_ENABLED", "false")
                .with_env_var(
                    "ZOO_4LW_COMMANDS_WHITELIST",
                    "ruok,srvr,stat,mntr,cons,conf",
                )
                .with_env_var(
                    "ZOO_CFG_EXTRA",
                    "minSessionTimeout=400 maxSessionTimeout=60000",
                )
                .with_startup_timeout(STARTUP),
        ),
    }
}

/// Starts a container for `kind` and waits until it answers; the error explains why not
/// (e.g. no Docker daemon).
pub(crate) async fn start(kind: ServerKind) -> Result<TestServer, String> {
    let (internal, request) = request(kind);
    let container = request
        .start()
        .await
        .map_err(|e| format!("starting a container: {e}"))?;
    let host = container
        .get_host()
        .await
        .map_err(|e| format!("container host: {e}"))?
        .to_string();
    let port = container
        .get_host_port_ipv4(internal)
        .await
        .map_err(|e| format!("container port: {e}"))?;
    let addr: SocketAddr = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("resolving {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} has no address"))?;
    let deadline = Instant::now() + STARTUP;
    loop {
        let error =
            match tokio::time::timeout(Duration::from_secs(2), probe::ready(kind, addr)).await {
                Ok(Ok(())) => break,
                Ok(Err(e)) => e,
                Err(_) => "the readiness probe timed out".to_owned(),
            };
        if Instant::now() >= deadline {
            return Err(format!(
                "the {kind} container at {addr} is not ready after {STARTUP:?}: {error}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = match kind {
        ServerKind::Redis => format!("redis://{host}:{port}"),
        ServerKind::Mysql => format!("mysql://root@{host}:{port}/{DATABASE}"),
        ServerKind::Postgres => format!("postgres://postgres@{host}:{port}/{DATABASE}"),
        ServerKind::Zookeeper => format!("{host}:{port}"),
    };
    Ok(TestServer {
        kind,
        url,
        host,
        port,
        origin: Origin::Container(Box::new(container)),
    })
}
