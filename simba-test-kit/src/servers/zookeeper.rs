//! Private ZooKeeper instances (standalone mode).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::process::{is_executable, which};
use super::{ServerError, ServerKind};

const KIND: ServerKind = ServerKind::Zookeeper;

/// A local Java and ZooKeeper class path.
#[derive(Debug, Clone)]
pub(crate) struct Zookeeper {
    java: PathBuf,
    classpath: OsString,
}

fn java() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("JAVA_HOME") {
        let java = PathBuf::from(home).join("bin/java");
        if is_executable(&java) {
            return Some(java);
        }
    }
    which("java")
}

/// ZooKeeper's class path: `$ZOOKEEPER_HOME/lib/*` for a tarball install, else Debian's
/// `/usr/share/java/zookeeper.jar` (whose manifest names its dependencies) plus an SLF4J
/// binding that logs to stderr.
fn classpath() -> Option<OsString> {
    if let Some(home) = std::env::var_os("ZOOKEEPER_HOME") {
        let home = PathBuf::from(home);
        if home.join("lib").is_dir() {
            let mut cp = home.join("conf").into_os_string();
            cp.push(":");
            cp.push(home.join("lib/*"));
            return Some(cp);
        }
    }
    let jar = Path::new("/usr/share/java/zookeeper.jar");
    if !jar.is_file() {
        return None;
    }
    let mut cp = jar.as_os_str().to_owned();
    let binding = Path::new("/usr/share/java/slf4j-simple.jar");
    if binding.is_file() {
        cp.push(":");
        cp.push(binding);
    }
    Some(cp)
}

impl Zookeeper {
    pub(crate) fn detect() -> Result<Self, ServerError> {
        let java = java().ok_or_else(|| {
            ServerError::missing_binary(KIND, "java was not found (JAVA_HOME, PATH)")
        })?;
        let classpath = classpath().ok_or_else(|| {
            ServerError::missing_binary(
                KIND,
                "ZooKeeper was not found (/usr/share/java/zookeeper.jar, or $ZOOKEEPER_HOME/lib)",
            )
        })?;
        Ok(Self { java, classpath })
    }

    pub(crate) async fn prepare(&self, dir: &Path) -> Result<(), ServerError> {
        tokio::fs::create_dir_all(dir.join("data"))
            .await
            .map_err(|e| ServerError::io(KIND, "creating the data directory", e))
    }

    /// Writes `zoo.cfg` (tickTime 200 ms, sessions 400 ms to 60 s, no admin server, the
    /// four-letter words the kit uses, no fsync) and runs the server in the foreground.
    pub(crate) fn command(&self, dir: &Path, port: u16) -> Result<Command, ServerError> {
        let config = dir.join("zoo.cfg");
        let data = dir.join("data");
        let text = format!(
            "tickTime=200\n\
             minSessionTimeout=400\n\
             maxSessionTimeout=60000\n\
             initLimit=10\n\
             syncLimit=5\n\
             dataDir={data}\n\
             clientPort={port}\n\
             clientPortAddress=127.0.0.1\n\
             maxClientCnxns=0\n\
             admin.enableServer=false\n\
             4lw.commands.whitelist=ruok,srvr,stat,mntr,cons,conf\n\
             forceSync=no\n",
            data = data.display(),
        );
        std::fs::write(&config, text).map_err(|e| ServerError::io(KIND, "writing zoo.cfg", e))?;
        let mut cmd = Command::new(&self.java);
        cmd.args([
            "-Xms32m",
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.admin.enableServer=false",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
        ])
        .arg("-cp")
        .arg(&self.classpath)
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(&config);
        Ok(cmd)
    }
}
