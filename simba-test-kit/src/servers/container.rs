//! Test servers in containers (feature `containers`): the images `simba/redis`,
//! `simba/mariadb`, `simba/postgres`, `simba/zookeeper`, `simba/etcd` and `simba/pgbouncer`
//! (PostgreSQL and PgBouncer in one container; tag [`IMAGE_TAG`]) that
//! `scripts/containers.sh build` makes from Debian's packages and `docker-compose.yml` uses.
//!
//! Every container publishes its port on `127.0.0.1` only (a random host port), carries the
//! label [`LABEL`]` = 1` (and the test process id as `simba.test.pid`) so that
//! `scripts/containers.sh clean` can remove what a killed test process left, and is removed
//! when its [`TestServer`] is dropped, also when the test panics.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use testcontainers::bollard::Docker;
use testcontainers::bollard::models::PortBinding;
use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerRequest, GenericImage, ImageExt};

use super::{
    DATABASE, IMAGE_TAG, Origin, PoolMode, Pooler, ServerError, ServerKind, TestServer, image_name,
    probe,
};

/// The label every test container carries (value `1`).
pub const LABEL: &str = "simba.test";

/// Password of `root` in `simba/mariadb` and of `postgres` in `simba/postgres`.
const PASSWORD: &str = "simba";

/// How long a container may take to start and answer.
const STARTUP: Duration = Duration::from_secs(120);

/// How to build the images, for error messages.
const BUILD_HINT: &str = "build the images with `scripts/containers.sh build` (from Debian's packages, \
     a few minutes the first time)";

/// The server's port inside the container.
fn internal_port(kind: ServerKind) -> u16 {
    kind.default_port()
}

/// The ports the container publishes: the server's, and for PgBouncer also that of the
/// PostgreSQL behind it.
fn published_ports(kind: ServerKind) -> Vec<u16> {
    match kind {
        ServerKind::Pgbouncer => vec![internal_port(kind), internal_port(ServerKind::Postgres)],
        _ => vec![internal_port(kind)],
    }
}

/// The container request for `kind`: our image, its port on 127.0.0.1, the labels, and
/// the log line its server prints once it accepts connections where the kit's protocol
/// probe cannot log in (MariaDB's root has a password, the probe sends none).
fn request(kind: ServerKind) -> ContainerRequest<GenericImage> {
    let ports = published_ports(kind);
    let mut image = GenericImage::new(image_name(kind), IMAGE_TAG);
    for port in &ports {
        image = image.with_exposed_port(port.tcp());
    }
    if kind == ServerKind::Mysql {
        image = image.with_wait_for(WaitFor::message_on_stderr("ready for connections"));
    }
    image
        .with_label(LABEL, "1")
        .with_label("simba.test.pid", std::process::id().to_string())
        .with_startup_timeout(STARTUP)
        .with_host_config_modifier(move |host| {
            // Instead of testcontainers' "publish all ports" on every interface: these
            // ports, on loopback, on ports the engine picks.
            host.publish_all_ports = Some(false);
            host.port_bindings = Some(
                ports
                    .iter()
                    .map(|port| {
                        (
                            format!("{port}/tcp"),
                            Some(vec![PortBinding {
                                host_ip: Some(Ipv4Addr::LOCALHOST.to_string()),
                                host_port: Some(String::new()),
                            }]),
                        )
                    })
                    .collect::<HashMap<_, _>>(),
            );
        })
}

/// Checks that a Docker daemon answers and has the image for `kind`, so that the error
/// says which of the two is missing and how to fix it.
pub(super) async fn preflight(kind: ServerKind) -> Result<(), String> {
    let unreachable = |e: testcontainers::bollard::errors::Error| {
        format!("no Docker daemon answers ({e}). {}", docker_hint())
    };
    let docker = Docker::connect_with_defaults().map_err(unreachable)?;
    docker.ping().await.map_err(unreachable)?;
    let image = format!("{}:{IMAGE_TAG}", image_name(kind));
    docker
        .inspect_image(&image)
        .await
        .map_err(|e| format!("the image {image} is not there ({e}): {BUILD_HINT}"))?;
    Ok(())
}

fn docker_hint() -> String {
    let host =
        std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".to_owned());
    format!(
        "Start the Docker engine (e.g. `systemctl start docker`), check that this user may use \
         {host} (the `docker` group) or set DOCKER_HOST; `docker info` must work"
    )
}

/// Starts a container for `kind` and waits until its server answers.
///
/// # Errors
///
/// [`ServerError::Unavailable`] when no Docker daemon answers or the image is missing,
/// [`ServerError::Start`] when the container does not start or does not become ready.
pub(crate) async fn start(kind: ServerKind) -> Result<TestServer, ServerError> {
    let unavailable = |hint: String| ServerError::Unavailable { kind, hint };
    let failed = |message: String| ServerError::Start {
        kind,
        message,
        log_tail: String::new(),
    };
    preflight(kind).await.map_err(unavailable)?;
    let container = request(kind)
        .start()
        .await
        .map_err(|e| failed(format!("starting {}:{IMAGE_TAG}: {e}", image_name(kind))))?;
    let port = container
        .get_host_port_ipv4(internal_port(kind))
        .await
        .map_err(|e| failed(format!("container port: {e}")))?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    // MariaDB's readiness is its log line (see `request`).
    if kind != ServerKind::Mysql {
        wait_ready(&container, kind, addr).await?;
    }
    let url = match kind {
        ServerKind::Redis => format!("redis://{addr}"),
        ServerKind::Mysql => format!("mysql://root:{PASSWORD}@{addr}/{DATABASE}"),
        ServerKind::Postgres | ServerKind::Pgbouncer => {
            format!("postgres://postgres:{PASSWORD}@{addr}/{DATABASE}")
        }
        ServerKind::Zookeeper => addr.to_string(),
        ServerKind::Etcd => format!("etcd://{addr}"),
    };
    Ok(TestServer {
        kind,
        url,
        host: Ipv4Addr::LOCALHOST.to_string(),
        port,
        origin: Origin::Container(Box::new(container)),
    })
}

/// Polls the protocol probe of `kind` at `addr` until it answers, up to [`STARTUP`]. The
/// engine's port forwarder accepts connections before the server listens, so a
/// connection alone proves nothing: the probe must get an answer. (Polling: the kit has
/// no event for "the server in the container listens"; the bound is generous.)
async fn wait_ready(
    container: &testcontainers::ContainerAsync<GenericImage>,
    kind: ServerKind,
    addr: SocketAddr,
) -> Result<(), ServerError> {
    let deadline = Instant::now() + STARTUP;
    loop {
        let error =
            match tokio::time::timeout(Duration::from_secs(2), probe::ready(kind, addr)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => "the readiness probe timed out".to_owned(),
            };
        if Instant::now() >= deadline {
            let logs = container.stderr_to_vec().await.unwrap_or_default();
            let text = String::from_utf8_lossy(&logs);
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            return Err(ServerError::Start {
                kind,
                message: format!(
                    "the container {} at {addr} is not ready after {STARTUP:?}: {error}",
                    container.id()
                ),
                log_tail: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A container of `simba/pgbouncer` (PostgreSQL and PgBouncer): the [`Pooler`] of `mode`,
/// whose PgBouncer [`TestServer`] owns the container, and whose PostgreSQL is reached on
/// the container's second published port.
///
/// # Errors
///
/// As [`start`].
pub(crate) async fn start_pooler(mode: PoolMode) -> Result<Pooler, ServerError> {
    let pooler = start(ServerKind::Pgbouncer).await?;
    let Origin::Container(container) = &pooler.origin else {
        return Err(ServerError::Start {
            kind: ServerKind::Pgbouncer,
            message: "the PgBouncer container is not a container (an internal error of the kit)"
                .to_owned(),
            log_tail: String::new(),
        });
    };
    let port = container
        .get_host_port_ipv4(internal_port(ServerKind::Postgres))
        .await
        .map_err(|e| ServerError::Start {
            kind: ServerKind::Pgbouncer,
            message: format!("the container's PostgreSQL port: {e}"),
            log_tail: String::new(),
        })?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    wait_ready(container, ServerKind::Postgres, addr).await?;
    let postgres = TestServer::external(
        ServerKind::Postgres,
        &format!("postgres://postgres:{PASSWORD}@{addr}/{DATABASE}"),
    )?;
    Ok(super::pgbouncer::pooler(mode, pooler, postgres))
}
