//! The `docker` command and the labelled Docker networks of the multi-node deployments in
//! containers ([`ZkEnsemble`](super::ZkEnsemble), [`EtcdCluster`](super::EtcdCluster)).

use std::net::Ipv4Addr;
use std::time::Duration;

use tokio::process::Command;

use super::container::LABEL;
use super::{ServerError, ServerKind};

/// How long one `docker` command may take.
pub(super) const DOCKER_TIMEOUT: Duration = Duration::from_secs(60);

fn docker_error(kind: ServerKind, context: String, message: String) -> ServerError {
    ServerError::io(kind, context, std::io::Error::other(message))
}

/// The labels of everything a test process creates: `--label simba.test=1 --label
/// simba.test.pid=PID`, as arguments.
pub(super) fn label_args() -> [String; 4] {
    [
        "--label".to_owned(),
        format!("{LABEL}=1"),
        "--label".to_owned(),
        format!("simba.test.pid={}", std::process::id()),
    ]
}

/// Runs `docker ARGS` within [`DOCKER_TIMEOUT`], returns its standard output; an error
/// ([`ServerError::Io`] of `kind`) carries its standard error.
pub(super) async fn docker(kind: ServerKind, args: &[&str]) -> Result<String, ServerError> {
    let context = format!("docker {}", args.join(" "));
    let output = tokio::time::timeout(
        DOCKER_TIMEOUT,
        Command::new("docker")
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| {
        docker_error(
            kind,
            context.clone(),
            format!("no answer in {DOCKER_TIMEOUT:?}"),
        )
    })?
    .map_err(|e| ServerError::io(kind, context.clone(), e))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    } else {
        Err(docker_error(
            kind,
            context,
            format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        ))
    }
}

/// A Docker network of a deployment, with the subnet it was created with.
#[derive(Debug, Clone)]
pub(super) struct Net {
    pub(super) name: String,
    /// The network address of the subnet.
    pub(super) base: Ipv4Addr,
}

impl Net {
    /// A network not created yet (its drop removes nothing).
    pub(super) fn none() -> Net {
        Net {
            name: String::new(),
            base: Ipv4Addr::UNSPECIFIED,
        }
    }

    /// The fixed address of node `i` on this network.
    pub(super) fn node_ip(&self, i: usize) -> Ipv4Addr {
        // .1 is the gateway (the host); nodes are .11, .12, .13.
        Ipv4Addr::from(u32::from(self.base) + 11 + i as u32)
    }
}

/// Parses `a.b.c.d/len` into its network address.
pub(super) fn parse_subnet(text: &str) -> Option<Ipv4Addr> {
    let (ip, len) = text.trim().split_once('/')?;
    let ip: Ipv4Addr = ip.parse().ok()?;
    let len: u32 = len.parse().ok()?;
    // Room for the gateway and the nodes' .11 to .13 at least.
    if !(8..=27).contains(&len) {
        return None;
    }
    let mask = u32::MAX << (32 - len);
    Some(Ipv4Addr::from(u32::from(ip) & mask))
}

/// Creates a labelled network with a subnet the engine picks, then makes it again with that
/// subnet given explicitly: only on such a network does the engine keep a container's fixed
/// address (`--ip`). The engine's choice avoids its other networks and the host's routes.
async fn create_network(kind: ServerKind, name: &str, internal: bool) -> Result<Net, ServerError> {
    let labels = label_args();
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    let mut last = None;
    for _ in 0..3 {
        let mut args = vec!["network", "create"];
        args.extend(&labels);
        args.push(name);
        docker(kind, &args).await?;
        let subnet = docker(
            kind,
            &[
                "network",
                "inspect",
                "-f",
                "{{range .IPAM.Config}}{{.Subnet}} {{end}}",
                name,
            ],
        )
        .await;
        docker(kind, &["network", "rm", name]).await?;
        let subnet = subnet?;
        let context = || format!("docker network inspect {name}");
        let Some(text) = subnet.split_whitespace().find(|s| !s.contains(':')) else {
            return Err(docker_error(
                kind,
                context(),
                format!("no IPv4 subnet in {subnet:?}"),
            ));
        };
        let Some(base) = parse_subnet(text) else {
            return Err(docker_error(
                kind,
                context(),
                format!("unusable subnet {text:?}"),
            ));
        };
        let mut args = vec!["network", "create"];
        args.extend(&labels);
        args.extend(["--subnet", text]);
        if internal {
            args.push("--internal");
        }
        args.push(name);
        // Another process may have taken the subnet in between: then ask again.
        match docker(kind, &args).await {
            Ok(_) => {
                return Ok(Net {
                    name: name.to_owned(),
                    base,
                });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| docker_error(kind, format!("creating {name}"), "failed".to_owned())))
}

/// Connects container `name` (node `i`) to `net` at its fixed address.
async fn connect(kind: ServerKind, net: &Net, name: &str, i: usize) -> Result<(), ServerError> {
    let ip = net.node_ip(i).to_string();
    docker(kind, &["network", "connect", "--ip", &ip, &net.name, name])
        .await
        .map(drop)
}

/// Disconnects container `name` from `net`.
async fn disconnect(kind: ServerKind, net: &Net, name: &str) -> Result<(), ServerError> {
    docker(kind, &["network", "disconnect", &net.name, name])
        .await
        .map(drop)
}

/// The last `lines` lines of container `name`'s log (standard output and error).
async fn logs(name: &str, lines: usize) -> String {
    let tail = lines.to_string();
    let output = tokio::time::timeout(
        DOCKER_TIMEOUT,
        Command::new("docker")
            .args(["logs", "--tail", &tail, name])
            .kill_on_drop(true)
            .output(),
    )
    .await;
    match output {
        Ok(Ok(o)) => format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Ok(Err(e)) => format!("docker logs {name}: {e}"),
        Err(_) => format!("docker logs {name}: no answer in {DOCKER_TIMEOUT:?}"),
    }
}

/// Removes `containers` and then `networks` (synchronously, with the `docker` command, so
/// that it also works in a `Drop` while a test panics); says on stderr what it could not
/// remove. `what` names the deployment in that message.
fn remove_now(what: &str, containers: &[String], networks: &[&Net]) {
    let run = |args: &[&str], names: &[&str], things: &str| {
        if names.is_empty() {
            return;
        }
        let status = std::process::Command::new("docker")
            .args(args)
            .args(names)
            .stdout(std::process::Stdio::null())
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!(
                "simba-test-kit: could not remove the {things} of {what} ({status:?}); \
                 `scripts/containers.sh clean` removes them"
            );
        }
    };
    let containers: Vec<&str> = containers.iter().map(String::as_str).collect();
    run(&["rm", "-f", "-v"], &containers, "containers");
    let networks: Vec<&str> = networks
        .iter()
        .map(|n| n.name.as_str())
        .filter(|n| !n.is_empty())
        .collect();
    run(&["network", "rm"], &networks, "networks");
}

/// The containers and networks of a three-node deployment in containers (the ZooKeeper
/// ensemble's, the etcd cluster's): `peers` for the nodes' own traffic (an internal
/// network), `control` for the kit's questions, one network per client; node `i` has the
/// fixed address [`Net::node_ip`]`(i)` on each. The faults that both deployments have are
/// here; everything is removed on drop.
pub(super) struct Deployment {
    pub(super) kind: ServerKind,
    pub(super) prefix: String,
    pub(super) containers: Vec<String>,
    pub(super) peers: Net,
    pub(super) control: Net,
    pub(super) clients: Vec<Net>,
}

impl Deployment {
    /// Creates the networks `{prefix}-peers` (internal), `{prefix}-control` and `clients`
    /// (at least one) client networks; no container yet. What was created is removed when
    /// a later step fails (the drop).
    pub(super) async fn create(
        kind: ServerKind,
        prefix: String,
        clients: usize,
    ) -> Result<Deployment, ServerError> {
        let mut d = Deployment {
            kind,
            prefix,
            containers: Vec::new(),
            peers: Net::none(),
            control: Net::none(),
            clients: Vec::new(),
        };
        d.peers = create_network(kind, &format!("{}-peers", d.prefix), true).await?;
        d.control = create_network(kind, &format!("{}-control", d.prefix), false).await?;
        for c in 0..clients.max(1) {
            let net = create_network(kind, &format!("{}-client{c}", d.prefix), false).await?;
            d.clients.push(net);
        }
        Ok(d)
    }

    /// Runs `docker ARGS` (see [`docker`]).
    pub(super) async fn docker(&self, args: &[&str]) -> Result<String, ServerError> {
        docker(self.kind, args).await
    }

    /// Connects container `name` (node `i`) to `net` at its fixed address.
    pub(super) async fn connect(&self, net: &Net, name: &str, i: usize) -> Result<(), ServerError> {
        connect(self.kind, net, name, i).await
    }

    /// SIGKILL of node `i`'s container.
    pub(super) async fn kill(&self, i: usize) -> Result<(), ServerError> {
        self.docker(&["kill", &self.containers[i]]).await.map(drop)
    }

    /// `docker stop` of node `i` (SIGTERM, SIGKILL after 10 s).
    pub(super) async fn stop(&self, i: usize) -> Result<(), ServerError> {
        self.docker(&["stop", &self.containers[i]]).await.map(drop)
    }

    /// `docker start` of node `i` (same data, same addresses).
    pub(super) async fn start(&self, i: usize) -> Result<(), ServerError> {
        self.docker(&["start", &self.containers[i]]).await.map(drop)
    }

    /// Disconnects node `i` from the peers network.
    pub(super) async fn partition(&self, i: usize) -> Result<(), ServerError> {
        disconnect(self.kind, &self.peers, &self.containers[i]).await
    }

    /// Connects node `i` to the peers network again, at its address.
    pub(super) async fn heal(&self, i: usize) -> Result<(), ServerError> {
        self.connect(&self.peers, &self.containers[i], i).await
    }

    /// Disconnects every node from client `client`'s network.
    pub(super) async fn cut_client(&self, client: usize) -> Result<(), ServerError> {
        let net = &self.clients[client];
        for name in &self.containers {
            disconnect(self.kind, net, name).await?;
        }
        Ok(())
    }

    /// Connects every node to client `client`'s network again.
    pub(super) async fn restore_client(&self, client: usize) -> Result<(), ServerError> {
        let net = &self.clients[client];
        for (i, name) in self.containers.iter().enumerate() {
            self.connect(net, name, i).await?;
        }
        Ok(())
    }

    /// The last `lines` lines of node `i`'s log.
    pub(super) async fn logs(&self, i: usize, lines: usize) -> String {
        match self.containers.get(i) {
            Some(name) => logs(name, lines).await,
            None => String::new(),
        }
    }
}

impl Drop for Deployment {
    /// Removes the containers and the networks (synchronously, so that it also works while
    /// a test panics).
    fn drop(&mut self) {
        let mut networks: Vec<&Net> = self.clients.iter().collect();
        networks.extend([&self.control, &self.peers]);
        remove_now(&self.prefix, &self.containers, &networks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets_and_addresses() {
        let base = parse_subnet("172.19.0.0/16");
        assert_eq!(base, Some(Ipv4Addr::new(172, 19, 0, 0)));
        let net = Net {
            name: "n".into(),
            base: Ipv4Addr::new(192, 168, 16, 0),
        };
        assert_eq!(net.node_ip(0), Ipv4Addr::new(192, 168, 16, 11));
        assert_eq!(net.node_ip(2), Ipv4Addr::new(192, 168, 16, 13));
        assert_eq!(
            parse_subnet("10.1.2.3/24"),
            Some(Ipv4Addr::new(10, 1, 2, 0))
        );
        assert_eq!(parse_subnet("10.1.2.3/30"), None);
        assert_eq!(parse_subnet("fd00::/64"), None);
        assert_eq!(parse_subnet("nonsense"), None);
    }
}
