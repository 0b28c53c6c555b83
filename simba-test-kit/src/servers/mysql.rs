//! Private MariaDB instances.

use std::path::{Path, PathBuf};
use std::process::Command;

use tokio::sync::OnceCell;

use super::process::{binary_key, copy_tree, is_root, opt, run, template, which};
use super::{DATABASE, ServerError, ServerKind};

const KIND: ServerKind = ServerKind::Mysql;

/// Settings shared by `mariadb-install-db` and the server, chosen to start fast and to
/// keep the template small. Commits reach the OS before they are acknowledged, so they
/// survive a killed server (not a crashed machine).
const FAST_OPTIONS: &[&str] = &[
    "--innodb-log-file-size=8M",
    "--innodb-buffer-pool-size=32M",
    "--innodb-flush-log-at-trx-commit=2",
    "--skip-name-resolve",
];

/// A local `mariadbd` with its `mariadb-install-db`.
#[derive(Debug, Clone)]
pub(crate) struct Mysql {
    server: PathBuf,
    install_db: PathBuf,
    tls: Option<super::tls::MysqlTls>,
}

static TEMPLATE: OnceCell<PathBuf> = OnceCell::const_new();

impl Mysql {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let server = which("mariadbd")
            .or_else(|| which("mysqld"))
            .ok_or_else(|| {
                ServerError::missing_binary(
                    KIND,
                    "mariadbd (or mysqld) was not found on PATH or in /usr/sbin",
                )
            })?;
        let install_db = which("mariadb-install-db")
            .or_else(|| which("mysql_install_db"))
            .ok_or_else(|| {
                ServerError::missing_binary(
                    KIND,
                    "mariadb-install-db (or mysql_install_db) was not found; the kit runs MariaDB",
                )
            })?;
        Ok(Self {
            server,
            install_db,
            tls: None,
        })
    }

    /// This server with TLS (`--ssl-cert`, `--ssl-key`, `--ssl-ca`) and
    /// `--require-secure-transport=ON`.
    pub(crate) fn with_tls(mut self, tls: super::tls::MysqlTls) -> Self {
        self.tls = Some(tls);
        self
    }

    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    fn user_args() -> Vec<&'static str> {
        // mariadbd refuses to run as root unless told to.
        if is_root() {
            vec!["--user=root"]
        } else {
            vec![]
        }
    }

    /// An initialised data directory, built once per machine and binary version.
    async fn template(&self) -> Result<&'static PathBuf, ServerError> {
        TEMPLATE
            .get_or_try_init(|| {
                let name = format!("mariadb-{}", binary_key(&self.server));
                template(KIND, name, |dir| async move {
                    run(
                        KIND,
                        "mariadb-install-db",
                        tokio::process::Command::new(&self.install_db)
                            .arg("--no-defaults")
                            .arg(opt("--datadir", dir.join("data")))
                            .arg("--auth-root-authentication-method=normal")
                            .arg("--skip-test-db")
                            .args(Self::user_args())
                            .args(FAST_OPTIONS)
                            .current_dir(&dir),
                    )
                    .await
                })
            })
            .await
    }

    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        let template = self.template().await?;
        copy_tree(KIND, &template.join("data"), &dir.join("data")).await
    }

    pub(crate) fn command(&self, dir: &Path, port: u16) -> Result<Command, ServerError> {
        let init = dir.join("init.sql");
        let mut sql = format!("CREATE DATABASE IF NOT EXISTS `{DATABASE}`;\n");
        if self.tls.as_ref().is_some_and(|t| t.require_client_cert) {
            // The kit's user (root) must present a certificate signed by the CA.
            sql.push_str(
                "ALTER USER IF EXISTS 'root'@'localhost', 'root'@'127.0.0.1', 'root'@'%' \
                 REQUIRE X509;\n",
            );
        }
        std::fs::write(&init, sql).map_err(|e| ServerError::io(KIND, "writing init.sql", e))?;
        let mut cmd = Command::new(&self.server);
        cmd.arg("--no-defaults")
            .arg(opt("--datadir", dir.join("data")))
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(opt("--socket", dir.join("mysqld.sock")))
            .arg(opt("--pid-file", dir.join("mysqld.pid")))
            .arg(opt("--init-file", &init))
            .arg("--max-connections=500")
            .arg("--max-connect-errors=1000000")
            .args(FAST_OPTIONS)
            .args(Self::user_args());
        if let Some(tls) = &self.tls {
            cmd.arg(opt("--ssl-cert", &tls.server.cert))
                .arg(opt("--ssl-key", &tls.server.key))
                .arg(opt("--ssl-ca", &tls.ca))
                .arg("--require-secure-transport=ON");
        }
        Ok(cmd)
    }
}
