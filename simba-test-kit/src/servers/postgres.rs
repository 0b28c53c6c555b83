//! Private PostgreSQL instances.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tokio::io::AsyncWriteExt;
use tokio::sync::OnceCell;

use super::process::{
    binary_key, chown_tree, copy_tree, is_executable, opt, run_as_postgres, template, which,
};
use super::{DATABASE, ServerError, ServerKind};

const KIND: ServerKind = ServerKind::Postgres;

/// A local PostgreSQL installation.
#[derive(Debug, Clone)]
pub(crate) struct Postgres {
    bin: PathBuf,
    /// `(uid, gid)` to run as when this process is root (PostgreSQL refuses root).
    run_as: Option<(u32, u32)>,
    /// Set for a server that accepts only TLS connections on TCP.
    tls: Option<super::tls::PostgresTls>,
}

/// Where [`Postgres::prepare`] puts the TLS files, in the server's directory.
const TLS_DIR: &str = "tls";

static TEMPLATE: OnceCell<PathBuf> = OnceCell::const_new();

/// The `bin` directory of the newest `/usr/lib/postgresql/<version>`.
fn debian_bin_dir() -> Option<PathBuf> {
    let mut best: Option<(Vec<u32>, PathBuf)> = None;
    for entry in std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(version) = name
            .split('.')
            .map(str::parse::<u32>)
            .collect::<Result<Vec<_>, _>>()
        else {
            continue;
        };
        let bin = entry.path().join("bin");
        if !(is_executable(&bin.join("postgres")) && is_executable(&bin.join("initdb"))) {
            continue;
        }
        if best.as_ref().is_none_or(|(v, _)| version > *v) {
            best = Some((version, bin));
        }
    }
    best.map(|(_, bin)| bin)
}

impl Postgres {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let bin = debian_bin_dir()
            .or_else(|| {
                let postgres = which("postgres")?;
                which("initdb")?;
                postgres.parent().map(Path::to_path_buf)
            })
            .ok_or_else(|| {
                ServerError::missing_binary(
                    KIND,
                    "no PostgreSQL server found (looked for /usr/lib/postgresql/*/bin/postgres \
                     and for postgres + initdb on PATH)",
                )
            })?;
        let run_as = run_as_postgres(KIND, "PostgreSQL")?;
        Ok(Self {
            bin,
            run_as,
            tls: None,
        })
    }

    /// The same server with `ssl=on`, accepting only TLS connections on TCP.
    pub(crate) fn with_tls(mut self, tls: super::tls::PostgresTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Whether the server accepts only TLS connections.
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Copies the certificates into `dir/tls` (the key 0600: PostgreSQL refuses a key others
    /// can read) and writes a pg_hba.conf that accepts TLS connections only.
    async fn prepare_tls(
        &self,
        dir: &Path,
        tls: &super::tls::PostgresTls,
    ) -> Result<(), ServerError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |what: &str, e| ServerError::io(KIND, what.to_owned(), e);
        let target = dir.join(TLS_DIR);
        tokio::fs::create_dir_all(&target)
            .await
            .map_err(|e| io("creating the TLS directory", e))?;
        for (from, to) in [
            (&tls.server.cert, "server.pem"),
            (&tls.server.key, "server-key.pem"),
            (&tls.ca, "ca.pem"),
        ] {
            tokio::fs::copy(from, target.join(to))
                .await
                .map_err(|e| io(&format!("copying {}", from.display()), e))?;
        }
        tokio::fs::set_permissions(
            target.join("server-key.pem"),
            std::fs::Permissions::from_mode(0o600),
        )
        .await
        .map_err(|e| io("setting the key's mode to 0600", e))?;
        let client = if tls.require_client_cert {
            " clientcert=verify-ca"
        } else {
            ""
        };
        let hba = format!(
            "local all all trust\n\
             hostssl all all 127.0.0.1/32 trust{client}\n\
             hostssl all all ::1/128 trust{client}\n\
             hostnossl all all 0.0.0.0/0 reject\n\
             hostnossl all all ::/0 reject\n"
        );
        tokio::fs::write(dir.join("data").join("pg_hba.conf"), hba)
            .await
            .map_err(|e| io("writing pg_hba.conf", e))
    }

    fn tool(&self, name: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(self.bin.join(name));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.env("LC_ALL", "C");
        cmd
    }

    /// `initdb` plus `CREATE DATABASE simba`, once per machine and binary version.
    async fn template(&self) -> Result<&'static PathBuf, ServerError> {
        TEMPLATE
            .get_or_try_init(|| {
                let name = format!("postgres-{}", binary_key(&self.bin.join("postgres")));
                template(KIND, name, |dir| async move {
                    if let Some(owner) = self.run_as {
                        chown_tree(KIND, &dir, owner).await?;
                    }
                    let data = dir.join("data");
                    super::process::run(
                        KIND,
                        "initdb",
                        self.tool("initdb")
                            .arg("-D")
                            .arg(&data)
                            .args(["--auth=trust", "--username=postgres", "--no-sync"])
                            .args(["--encoding=UTF8", "--locale=C"])
                            .current_dir(&dir),
                    )
                    .await?;
                    self.create_database(&dir, &data).await
                })
            })
            .await
    }

    /// Runs `CREATE DATABASE` in single-user mode.
    async fn create_database(&self, dir: &Path, data: &Path) -> Result<(), ServerError> {
        let mut child = self
            .tool("postgres")
            .arg("--single")
            .arg("-D")
            .arg(data)
            .args(["-F", "-c", "exit_on_error=true", "postgres"])
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| ServerError::io(KIND, "starting postgres --single", e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(format!("CREATE DATABASE {DATABASE};\n").as_bytes())
                .await
                .map_err(|e| ServerError::io(KIND, "writing to postgres --single", e))?;
        }
        let output = child
            .wait_with_output()
            .await
            .map_err(|e| ServerError::io(KIND, "running postgres --single", e))?;
        if output.status.success() {
            return Ok(());
        }
        Err(ServerError::Start {
            kind: KIND,
            message: format!(
                "postgres --single (CREATE DATABASE) failed with {}",
                output.status
            ),
            log_tail: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }

    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        let template = self.template().await?;
        copy_tree(KIND, &template.join("data"), &dir.join("data")).await?;
        if let Some(tls) = &self.tls {
            self.prepare_tls(dir, tls).await?;
        }
        if let Some(owner) = self.run_as {
            chown_tree(KIND, dir, owner).await?;
        }
        Ok(())
    }

    /// The postmaster in the foreground, on 127.0.0.1 and a socket in `dir`; no fsync
    /// (commits still reach the OS, so they survive a killed server).
    pub(crate) fn command(&self, dir: &Path, port: u16) -> Command {
        let mut cmd = Command::new(self.bin.join("postgres"));
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.env("LC_ALL", "C")
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-p")
            .arg(port.to_string())
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(opt("unix_socket_directories", dir))
            .args(["-c", "fsync=off"])
            .args(["-c", "full_page_writes=off"])
            // The direct tests' stores, and PgBouncer's session pool in front of it.
            .args(["-c", "max_connections=400"])
            .args(["-c", "logging_collector=off"])
            // After a killed backend, exit instead of reinitialising: the kit's kill()
            // kills the backends first and lets the postmaster reap them.
            .args(["-c", "restart_after_crash=off"]);
        if self.tls.is_some() {
            let tls = dir.join(TLS_DIR);
            cmd.args(["-c", "ssl=on"])
                .arg("-c")
                .arg(opt("ssl_cert_file", tls.join("server.pem")))
                .arg("-c")
                .arg(opt("ssl_key_file", tls.join("server-key.pem")))
                .arg("-c")
                .arg(opt("ssl_ca_file", tls.join("ca.pem")));
        }
        cmd
    }
}
