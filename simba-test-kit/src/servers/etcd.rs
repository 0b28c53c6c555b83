//! Private etcd instances (one member, Debian's `etcd-server` package or any `etcd` on
//! `PATH`).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::{free_port, which};
use super::{ServerError, ServerKind};

const KIND: ServerKind = ServerKind::Etcd;

/// A local `etcd` binary.
#[derive(Debug, Clone)]
pub(crate) struct Etcd {
    server: PathBuf,
    tls: Option<super::tls::EtcdTls>,
}

impl Etcd {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let server = which("etcd").ok_or_else(|| {
            ServerError::missing_binary(
                KIND,
                "etcd was not found on PATH or in /usr/bin, /usr/sbin, /usr/local/bin",
            )
        })?;
        Ok(Self { server, tls: None })
    }

    /// The same server speaking only TLS on its client port, with `tls`'s certificates,
    /// and `/health` in plain HTTP on a metrics port of its own (the kit's readiness probe
    /// speaks no TLS).
    pub(crate) fn with_tls(mut self, tls: super::tls::EtcdTls) -> Self {
        self.tls = Some(tls);
        self
    }

    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The plain metrics port of a TLS server (chosen at its first start, kept in
    /// `dir/metrics-port`).
    pub(crate) fn metrics_port(&self, dir: &Path) -> Option<u16> {
        self.tls.as_ref()?;
        std::fs::read_to_string(dir.join("metrics-port"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        tokio::fs::create_dir_all(dir.join("data"))
            .await
            .map_err(|e| ServerError::io(KIND, "creating the data directory", e))
    }

    /// One member on 127.0.0.1: the client port `port`, a peer port chosen at the first
    /// start and kept in `dir/peer-port` (a restart reuses it), data in `dir/data`, no
    /// fsync wait beyond etcd's own, heartbeat 100 ms / election 1 s (etcd's defaults).
    pub(crate) fn command(&self, dir: &Path, port: u16) -> Result<Command, ServerError> {
        let peer = kept_port(dir, "peer-port")?;
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new(&self.server);
        cmd.arg("--name")
            .arg("simba")
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("simba={peer}"))
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"]);
        if let Some(tls) = &self.tls {
            let metrics = kept_port(dir, "metrics-port")?;
            cmd.arg("--cert-file")
                .arg(&tls.server.cert)
                .arg("--key-file")
                .arg(&tls.server.key)
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{metrics}"));
            // etcd 3.4 asks every client for a certificate once it has a trusted CA file
            // (`--client-cert-auth` or not): the CA only where certificates are required.
            if tls.require_client_cert {
                cmd.arg("--trusted-ca-file")
                    .arg(&tls.ca)
                    .arg("--client-cert-auth");
            }
        }
        Ok(cmd)
    }
}

/// A port chosen at the first start and kept in `dir/{file}` (a restart reuses it).
fn kept_port(dir: &Path, file: &str) -> Result<u16, ServerError> {
    let path = dir.join(file);
    match std::fs::read_to_string(&path) {
        Ok(p) => p.trim().parse::<u16>().map_err(|e| {
            ServerError::io(
                KIND,
                format!("reading {file}"),
                std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            )
        }),
        Err(_) => {
            let p = free_port()
                .map_err(|e| ServerError::io(KIND, format!("finding a port for {file}"), e))?;
            std::fs::write(&path, p.to_string())
                .map_err(|e| ServerError::io(KIND, format!("writing {file}"), e))?;
            Ok(p)
        }
    }
}
