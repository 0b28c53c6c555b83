//! Private `redis-server` instances.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::which;
use super::{ServerError, ServerKind};

/// A local `redis-server` (or `valkey-server`).
#[derive(Debug, Clone)]
pub(crate) struct Redis {
    server: PathBuf,
    /// Set for a cluster node: the cluster bus port.
    cluster_bus_port: Option<u16>,
    /// Set for a server that speaks TLS on its port.
    tls: Option<super::tls::RedisTls>,
    /// Set for a TLS server that also speaks plain RESP on this port (127.0.0.1), for the
    /// kit's own admin commands and probes (the kit has no TLS client).
    admin_port: Option<u16>,
}

impl Redis {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let server = which("redis-server")
            .or_else(|| which("valkey-server"))
            .ok_or_else(|| {
                ServerError::missing_binary(
                    ServerKind::Redis,
                    "redis-server was not found on PATH or in /usr/bin, /usr/sbin, /usr/local/bin",
                )
            })?;
        Ok(Self {
            server,
            cluster_bus_port: None,
            tls: None,
            admin_port: None,
        })
    }

    /// The same server as a cluster node with its bus on `bus_port`.
    pub(crate) fn cluster_node(&self, bus_port: u16) -> Self {
        Self {
            server: self.server.clone(),
            cluster_bus_port: Some(bus_port),
            tls: self.tls.clone(),
            admin_port: self.admin_port,
        }
    }

    /// The same server speaking only TLS, with `tls`'s certificates.
    pub(crate) fn with_tls(mut self, tls: super::tls::RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The same (TLS) server with a plain admin port beside its TLS port. With it, a
    /// cluster node also runs its bus over TLS (`tls-cluster yes`) and every server
    /// replicates over TLS (`tls-replication yes`): Redis then announces the TLS port to
    /// TLS clients and the plain port only to plain ones (the kit's admin connections).
    pub(crate) fn with_admin_port(mut self, port: u16) -> Self {
        self.admin_port = Some(port);
        self
    }

    /// Whether the server speaks TLS on its port.
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The plain admin port beside the TLS port, if any.
    pub(crate) fn admin_port(&self) -> Option<u16> {
        self.admin_port
    }

    /// The server binary (also runs sentinels, with `--sentinel`).
    pub(crate) fn binary(&self) -> &Path {
        &self.server
    }

    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        tokio::fs::create_dir_all(dir.join("data"))
            .await
            .map_err(|e| ServerError::io(ServerKind::Redis, "creating the data directory", e))
    }

    /// Foreground server on 127.0.0.1, persistence by an append-only file (written to the
    /// OS before each reply, so it survives a kill), no RDB snapshots.
    pub(crate) fn command(&self, dir: &Path, port: u16) -> Command {
        let mut cmd = Command::new(&self.server);
        match &self.tls {
            None => {
                cmd.arg("--port").arg(port.to_string());
            }
            Some(tls) => {
                let plain = self.admin_port.unwrap_or(0);
                cmd.arg("--port")
                    .arg(plain.to_string())
                    .arg("--tls-port")
                    .arg(port.to_string())
                    .arg("--tls-cert-file")
                    .arg(&tls.server.cert)
                    .arg("--tls-key-file")
                    .arg(&tls.server.key)
                    .arg("--tls-ca-cert-file")
                    .arg(&tls.ca)
                    .args([
                        "--tls-auth-clients",
                        if tls.require_client_cert { "yes" } else { "no" },
                    ]);
                if self.admin_port.is_some() {
                    cmd.args(["--tls-replication", "yes"]);
                    if self.cluster_bus_port.is_some() {
                        cmd.args(["--tls-cluster", "yes"]);
                    }
                }
            }
        }
        cmd.args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(dir.join("data"))
            .args(["--daemonize", "no"])
            .args(["--save", ""])
            .args(["--appendonly", "yes"])
            .args(["--appendfsync", "no"])
            .args(["--logfile", ""])
            .args(["--maxclients", "4000"]);
        if let Some(bus) = self.cluster_bus_port {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .arg("--cluster-port")
                .arg(bus.to_string())
                .args(["--cluster-node-timeout", "5000"]);
        }
        cmd
    }
}
