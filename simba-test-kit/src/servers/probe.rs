//! Minimal protocol clients that tell whether a server is ready: Redis `PING`, a MySQL
//! login plus `SELECT 1`, a PostgreSQL start-up handshake, ZooKeeper's `srvr`, etcd's
//! `GET /health`.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{DATABASE, ServerKind};

/// Whether the server at `addr` answers like a ready server of `kind`, with the
/// credentials of a private instance. The error says what was seen instead.
pub(crate) async fn ready(kind: ServerKind, addr: SocketAddr) -> Result<(), String> {
    match kind {
        ServerKind::Redis => match redis_command(addr, &[b"PING"]).await? {
            Resp::Simple(s) if s == "PONG" => Ok(()),
            other => Err(format!("PING answered {other:?}")),
        },
        ServerKind::Mysql => mysql_select_one(addr, "root", DATABASE).await,
        ServerKind::Postgres => postgres_startup(addr, "postgres", DATABASE).await,
        ServerKind::Zookeeper => {
            let answer = zookeeper_four_letter(addr, "srvr").await?;
            if answer.contains("Mode:") {
                Ok(())
            } else {
                Err(format!("srvr answered {:?}", answer.trim()))
            }
        }
        ServerKind::Etcd => etcd_health(addr).await,
        // The admin console answers without a server connection: PgBouncer is ready
        // whether or not the PostgreSQL behind it is.
        ServerKind::Pgbouncer => postgres_startup(addr, "postgres", "pgbouncer").await,
    }
}

/// etcd's `GET /health` (HTTP/1.1 on the client port): ready when it says `"health":"true"`
/// (a member with a leader).
pub(crate) async fn etcd_health(addr: SocketAddr) -> Result<(), String> {
    let mut stream = connect(addr).await?;
    let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending GET /health: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .map_err(|e| format!("reading the /health answer: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    if answer.contains("\"health\":\"true\"") {
        Ok(())
    } else {
        Err(format!("GET /health answered {:?}", answer.trim()))
    }
}

/// What one etcd member says of itself (`POST /v3/maintenance/status`, the gRPC gateway on
/// the client port): its member id, the leader it follows (0: none) and its Raft term.
#[cfg(feature = "containers")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EtcdStatus {
    pub(crate) member: u64,
    pub(crate) leader: u64,
    pub(crate) term: u64,
}

/// Asks the member at `addr` for its [`EtcdStatus`]. The member answers from its own state,
/// without a quorum, so a partitioned member answers too (with its own, possibly stale,
/// view of the leader).
#[cfg(feature = "containers")]
pub(crate) async fn etcd_status(addr: SocketAddr) -> Result<EtcdStatus, String> {
    let mut stream = connect(addr).await?;
    let body = "{}";
    let request = format!(
        "POST /v3/maintenance/status HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("sending the status request: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .map_err(|e| format!("reading the status answer: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    parse_etcd_status(&answer).ok_or_else(|| format!("status answered {:?}", answer.trim()))
}

/// The numbers of a status answer; the gateway writes 64-bit integers as JSON strings.
/// A member without a leader leaves `leader` out (0).
#[cfg(feature = "containers")]
fn parse_etcd_status(text: &str) -> Option<EtcdStatus> {
    let field = |key: &str| -> Option<u64> {
        let pattern = format!("\"{key}\":\"");
        let start = text.find(&pattern)? + pattern.len();
        let end = start + text[start..].find('"')?;
        text[start..end].parse().ok()
    };
    Some(EtcdStatus {
        member: field("member_id")?,
        leader: field("leader").unwrap_or(0),
        term: field("raftTerm").or_else(|| field("raft_term"))?,
    })
}

async fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// A RESP value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resp {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The text of a simple or bulk string.
    pub(crate) fn text(&self) -> Option<String> {
        match self {
            Self::Simple(s) => Some(s.clone()),
            Self::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }
}

/// Sends one command to a Redis server on a new connection and reads the reply.
pub(crate) async fn redis_command(addr: SocketAddr, args: &[&[u8]]) -> Result<Resp, String> {
    let mut stream = connect(addr).await?;
    let mut request = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        request.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        request.extend_from_slice(arg);
        request.extend_from_slice(b"\r\n");
    }
    stream
        .write_all(&request)
        .await
        .map_err(|e| format!("writing to {addr}: {e}"))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((value, _)) = parse_resp(&buf)? {
            return Ok(value);
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading from {addr}: {e}"))?;
        if n == 0 {
            return Err(format!("{addr} closed the connection"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Parses one RESP2 value; `Ok(None)` if `buf` is incomplete.
fn parse_resp(buf: &[u8]) -> Result<Option<(Resp, usize)>, String> {
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let Some(&tag) = buf.first() else {
        return Ok(None);
    };
    let line = String::from_utf8_lossy(&buf[1..end]).into_owned();
    let next = end + 2;
    let number = |line: &str| {
        line.parse::<i64>()
            .map_err(|e| format!("bad RESP number {line:?}: {e}"))
    };
    match tag {
        b'+' => Ok(Some((Resp::Simple(line), next))),
        b'-' => Ok(Some((Resp::Error(line), next))),
        b':' => Ok(Some((Resp::Integer(number(&line)?), next))),
        b'$' => {
            let len = number(&line)?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Some((Resp::Bulk(None), next)));
            };
            if buf.len() < next + len + 2 {
                return Ok(None);
            }
            Ok(Some((
                Resp::Bulk(Some(buf[next..next + len].to_vec())),
                next + len + 2,
            )))
        }
        b'*' => {
            let len = number(&line)?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Some((Resp::Array(None), next)));
            };
            let mut items = Vec::with_capacity(len.min(1024));
            let mut at = next;
            for _ in 0..len {
                match parse_resp(&buf[at..])? {
                    Some((item, used)) => {
                        items.push(item);
                        at += used;
                    }
                    None => return Ok(None),
                }
            }
            Ok(Some((Resp::Array(Some(items)), at)))
        }
        other => Err(format!("unexpected RESP type byte {other:#04x}")),
    }
}

/// Sends a ZooKeeper four-letter word and returns the answer.
pub(crate) async fn zookeeper_four_letter(addr: SocketAddr, word: &str) -> Result<String, String> {
    let mut stream = connect(addr).await?;
    stream
        .write_all(word.as_bytes())
        .await
        .map_err(|e| format!("writing to {addr}: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .map_err(|e| format!("reading from {addr}: {e}"))?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

// ---- MySQL ----------------------------------------------------------------------------

const CLIENT_LONG_PASSWORD: u32 = 1;
const CLIENT_CONNECT_WITH_DB: u32 = 8;
const CLIENT_PROTOCOL_41: u32 = 0x200;
const CLIENT_TRANSACTIONS: u32 = 0x2000;
const CLIENT_SECURE_CONNECTION: u32 = 0x8000;
const CLIENT_PLUGIN_AUTH: u32 = 0x8_0000;

async fn mysql_read(stream: &mut TcpStream) -> Result<(u8, Vec<u8>), String> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|e| format!("reading a MySQL packet: {e}"))?;
    let len = usize::from(header[0]) | usize::from(header[1]) << 8 | usize::from(header[2]) << 16;
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .await
        .map_err(|e| format!("reading a MySQL packet: {e}"))?;
    Ok((header[3], payload))
}

async fn mysql_write(stream: &mut TcpStream, seq: u8, payload: &[u8]) -> Result<(), String> {
    let len = payload.len();
    let mut packet = Vec::with_capacity(len + 4);
    packet.extend_from_slice(&[
        (len & 0xff) as u8,
        (len >> 8 & 0xff) as u8,
        (len >> 16 & 0xff) as u8,
        seq,
    ]);
    packet.extend_from_slice(payload);
    stream
        .write_all(&packet)
        .await
        .map_err(|e| format!("writing a MySQL packet: {e}"))
}

fn mysql_error(payload: &[u8]) -> String {
    let code = match payload.get(1..3) {
        Some(&[lo, hi]) => u16::from_le_bytes([lo, hi]),
        _ => 0,
    };
    let mut message = payload.get(3..).unwrap_or_default();
    if message.first() == Some(&b'#') {
        message = message.get(6..).unwrap_or_default();
    }
    format!("MySQL error {code}: {}", String::from_utf8_lossy(message))
}

/// Logs in as `user` without a password, selects `database` and runs `SELECT 1`.
async fn mysql_select_one(addr: SocketAddr, user: &str, database: &str) -> Result<(), String> {
    let mut stream = connect(addr).await?;
    let (seq, greeting) = mysql_read(&mut stream).await?;
    match greeting.first() {
        Some(0x0a) => {}
        Some(0xff) => return Err(mysql_error(&greeting)),
        other => return Err(format!("unexpected MySQL greeting {other:?}")),
    }
    let caps = CLIENT_LONG_PASSWORD
        | CLIENT_CONNECT_WITH_DB
        | CLIENT_PROTOCOL_41
        | CLIENT_TRANSACTIONS
        | CLIENT_SECURE_CONNECTION
        | CLIENT_PLUGIN_AUTH;
    let mut login = Vec::new();
    login.extend_from_slice(&caps.to_le_bytes());
    login.extend_from_slice(&(16u32 << 20).to_le_bytes());
    login.push(45); // utf8mb4_general_ci
    login.extend_from_slice(&[0u8; 23]);
    login.extend_from_slice(user.as_bytes());
    login.push(0);
    login.push(0); // empty auth response
    login.extend_from_slice(database.as_bytes());
    login.push(0);
    login.extend_from_slice(b"mysql_native_password\0");
    let mut seq = seq.wrapping_add(1);
    mysql_write(&mut stream, seq, &login).await?;
    loop {
        let (s, reply) = mysql_read(&mut stream).await?;
        seq = s;
        match reply.first() {
            Some(0x00) => break,
            Some(0xff) => return Err(mysql_error(&reply)),
            // Auth switch: the answer for an empty password is empty.
            Some(0xfe) => {
                seq = seq.wrapping_add(1);
                mysql_write(&mut stream, seq, &[]).await?;
            }
            // More auth data (e.g. caching_sha2 fast-auth success); wait for the result.
            Some(0x01) => {}
            other => return Err(format!("unexpected MySQL login reply {other:?}")),
        }
    }
    mysql_write(&mut stream, 0, b"\x03SELECT 1").await?;
    let (_, reply) = mysql_read(&mut stream).await?;
    if reply.first() == Some(&0xff) {
        return Err(mysql_error(&reply));
    }
    let _ = mysql_write(&mut stream, 0, b"\x01").await;
    Ok(())
}

// ---- PostgreSQL -----------------------------------------------------------------------

/// Runs the start-up handshake as `user` on `database` (trust authentication) until the
/// server says `ReadyForQuery`.
async fn postgres_startup(addr: SocketAddr, user: &str, database: &str) -> Result<(), String> {
    let mut stream = connect(addr).await?;
    let mut body = Vec::new();
    body.extend_from_slice(&196_608u32.to_be_bytes()); // protocol 3.0
    for (k, v) in [("user", user), ("database", database)] {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let len = u32::try_from(body.len() + 4).map_err(|e| e.to_string())?;
    let mut message = len.to_be_bytes().to_vec();
    message.extend_from_slice(&body);
    stream
        .write_all(&message)
        .await
        .map_err(|e| format!("writing to {addr}: {e}"))?;
    loop {
        let mut header = [0u8; 5];
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("reading from {addr}: {e}"))?;
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
        let len = usize::try_from(len)
            .map_err(|e| e.to_string())?
            .saturating_sub(4);
        if len > 1 << 20 {
            return Err(format!("implausible PostgreSQL message length {len}"));
        }
        let mut payload = vec![0u8; len];
        stream
            .read_exact(&mut payload)
            .await
            .map_err(|e| format!("reading from {addr}: {e}"))?;
        match header[0] {
            b'R' => {
                let code = payload
                    .get(..4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                    .map(u32::from_be_bytes);
                if code != Some(0) {
                    return Err(format!(
                        "PostgreSQL wants authentication (method {code:?}); private instances use trust"
                    ));
                }
            }
            b'E' => {
                let fields: Vec<String> = payload
                    .split(|&b| b == 0)
                    .filter(|f| f.first() == Some(&b'M'))
                    .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
                    .collect();
                return Err(format!("PostgreSQL error: {}", fields.join("; ")));
            }
            b'Z' => {
                let _ = stream.write_all(b"X\0\0\0\x04").await;
                return Ok(());
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "containers")]
    #[test]
    fn parses_etcd_status() {
        // etcd 3.4.23's answer, as printed by a single member.
        let text = r#"HTTP/1.1 200 OK

{"header":{"cluster_id":"151","member_id":"1366","revision":"1","raft_term":"2"},"version":"3.4.23","dbSize":"20480","leader":"1366","raftIndex":"4","raftTerm":"2"}"#;
        assert_eq!(
            parse_etcd_status(text),
            Some(EtcdStatus {
                member: 1366,
                leader: 1366,
                term: 2
            })
        );
        let no_leader = r#"{"header":{"member_id":"7","raft_term":"5"},"raftTerm":"5"}"#;
        assert_eq!(parse_etcd_status(no_leader).map(|s| s.leader), Some(0));
        assert_eq!(parse_etcd_status("{\"error\":\"x\"}"), None);
    }

    #[test]
    fn parses_resp() {
        assert_eq!(
            parse_resp(b"+PONG\r\n"),
            Ok(Some((Resp::Simple("PONG".into()), 7)))
        );
        assert_eq!(parse_resp(b"$5\r\nhel"), Ok(None));
        assert_eq!(
            parse_resp(b"*2\r\n:1\r\n$-1\r\n"),
            Ok(Some((
                Resp::Array(Some(vec![Resp::Integer(1), Resp::Bulk(None)])),
                13
            )))
        );
        assert!(parse_resp(b"?x\r\n").is_err());
    }
}
