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
}

impl Etcd {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let server = which("etcd").ok_or_else(|| {
            ServerError::missing_binary(
                KIND,
                "etcd was not found on PATH or in /usr/bin, /usr/sbin, /usr/local/bin",
            )
        })?;
        Ok(Self { server })
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
        let peer_file = dir.join("peer-port");
        let peer = match std::fs::read_to_string(&peer_file) {
            Ok(p) => p.trim().parse::<u16>().map_err(|e| {
                ServerError::io(
                    KIND,
                    "reading the peer port",
                    std::io::Error::new(std::io::ErrorKind::InvalidData, e),
                )
            })?,
            Err(_) => {
                let p = free_port().map_err(|e| ServerError::io(KIND, "finding a peer port", e))?;
                std::fs::write(&peer_file, p.to_string())
                    .map_err(|e| ServerError::io(KIND, "writing the peer port", e))?;
                p
            }
        };
        let client = format!("http://127.0.0.1:{port}");
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
        Ok(cmd)
    }
}
