//! Certificates generated for a test, and private Redis, PostgreSQL, MariaDB and etcd
//! servers that speak only TLS.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType,
    date_time_ymd,
};
use tempfile::TempDir;

use super::process::{Flavor, LocalServer};
use super::{ServerError, ServerKind, TestServer};

/// A set of PEM files made for one test in a temporary directory (removed on drop): a CA,
/// a server certificate it signed for `localhost` and `127.0.0.1`, a client certificate
/// it signed, and the bad cases a TLS test needs — a second, unrelated CA, an expired
/// server certificate and one for another host name.
#[derive(Debug)]
pub struct TestCerts {
    dir: TempDir,
}

/// A certificate and its private key, as PEM file paths.
#[derive(Debug, Clone)]
pub struct CertPair {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM, PKCS#8).
    pub key: PathBuf,
}

fn cert_error(e: rcgen::Error) -> ServerError {
    ServerError::Start {
        kind: ServerKind::Redis,
        message: format!("generating test certificates: {e}"),
        log_tail: String::new(),
    }
}

fn ca(name: &str) -> Result<(Certificate, Issuer<'static, KeyPair>), ServerError> {
    let key = KeyPair::generate().map_err(cert_error)?;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_error)?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.self_signed(&key).map_err(cert_error)?;
    Ok((cert, Issuer::new(params, key)))
}

fn leaf(
    issuer: &Issuer<'_, KeyPair>,
    names: &[&str],
    expired: bool,
) -> Result<(Certificate, KeyPair), ServerError> {
    let key = KeyPair::generate().map_err(cert_error)?;
    let dns: Vec<String> = names
        .iter()
        .filter(|n| n.parse::<std::net::IpAddr>().is_err())
        .map(|n| (*n).to_owned())
        .collect();
    let mut params = CertificateParams::new(dns).map_err(cert_error)?;
    for ip in names
        .iter()
        .filter_map(|n| n.parse::<std::net::IpAddr>().ok())
    {
        params.subject_alt_names.push(SanType::IpAddress(ip));
    }
    params.distinguished_name.push(
        DnType::CommonName,
        names.first().copied().unwrap_or("client"),
    );
    if expired {
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2021, 1, 1);
    }
    let cert = params.signed_by(&key, issuer).map_err(cert_error)?;
    Ok((cert, key))
}

impl TestCerts {
    /// Generates every file.
    pub fn generate() -> Result<TestCerts, ServerError> {
        let dir = tempfile::Builder::new()
            .prefix("simba-certs-")
            .tempdir()
            .map_err(|e| ServerError::io(ServerKind::Redis, "creating a temporary directory", e))?;
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text)
                .map_err(|e| ServerError::io(ServerKind::Redis, format!("writing {name}"), e))
        };
        let (ca_cert, issuer) = ca("simba test CA")?;
        write("ca.pem", &ca_cert.pem())?;
        let (other_cert, _) = ca("another CA")?;
        write("other-ca.pem", &other_cert.pem())?;
        let pairs: [(&str, &[&str], bool); 4] = [
            ("server", &["localhost", "127.0.0.1"], false),
            ("client", &["simba-client"], false),
            ("expired", &["localhost", "127.0.0.1"], true),
            ("wrong-name", &["elsewhere.example"], false),
        ];
        for (name, names, expired) in pairs {
            let (cert, key) = leaf(&issuer, names, expired)?;
            write(&format!("{name}.pem"), &cert.pem())?;
            write(&format!("{name}-key.pem"), &key.serialize_pem())?;
        }
        Ok(TestCerts { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn pair(&self, name: &str) -> CertPair {
        CertPair {
            cert: self.path(&format!("{name}.pem")),
            key: self.path(&format!("{name}-key.pem")),
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The CA that signed the server and client certificates.
    pub fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// A CA that signed nothing here.
    pub fn other_ca(&self) -> PathBuf {
        self.path("other-ca.pem")
    }

    /// The server certificate, for `localhost` and `127.0.0.1`.
    pub fn server(&self) -> CertPair {
        self.pair("server")
    }

    /// A client certificate (for mutual TLS).
    pub fn client(&self) -> CertPair {
        self.pair("client")
    }

    /// A server certificate that expired in 2021.
    pub fn expired(&self) -> CertPair {
        self.pair("expired")
    }

    /// A server certificate for `elsewhere.example` only.
    pub fn wrong_name(&self) -> CertPair {
        self.pair("wrong-name")
    }
}

/// How a TLS Redis server is set up.
#[derive(Debug, Clone)]
pub struct RedisTls {
    /// The server's certificate and key.
    pub server: CertPair,
    /// The CA whose client certificates the server accepts.
    pub ca: PathBuf,
    /// Whether clients must present a certificate (mutual TLS).
    pub require_client_cert: bool,
}

/// A private `redis-server` that speaks only TLS (`--port 0 --tls-port P`); its URL is
/// `rediss://127.0.0.1:P`. It is controllable like any private instance.
pub async fn redis_tls(tls: RedisTls) -> Result<TestServer, ServerError> {
    let redis = super::redis::Redis::detect()
        .map_err(|e| e.with_advice(true))?
        .with_tls(tls);
    Ok(TestServer::from_local(
        LocalServer::create(Flavor::Redis(redis)).await?,
    ))
}

/// How a TLS PostgreSQL server is set up.
#[derive(Debug, Clone)]
pub struct PostgresTls {
    /// The server's certificate and key.
    pub server: CertPair,
    /// The CA whose client certificates the server accepts (`ssl_ca_file`).
    pub ca: PathBuf,
    /// Whether clients must present a certificate signed by `ca` (pg_hba.conf
    /// `clientcert=verify-ca`).
    pub require_client_cert: bool,
}

/// A private PostgreSQL (its own `initdb` data, as [`postgres_private`](super::postgres_private))
/// with `ssl=on` that accepts only TLS connections on TCP: pg_hba.conf has `hostssl` lines
/// (trust, plus `clientcert=verify-ca` when `require_client_cert`) and `hostnossl … reject`.
/// Its URL is the plain one (`postgres://postgres@127.0.0.1:P/simba`): add
/// `?sslmode=…&sslrootcert=…` as the test needs. The certificate files are copied into
/// the server's directory, the key with mode 0600, owned by the user the server runs as.
pub async fn postgres_tls(tls: PostgresTls) -> Result<TestServer, ServerError> {
    let postgres = super::postgres::Postgres::detect()
        .map_err(|e| e.with_advice(true))?
        .with_tls(tls);
    Ok(TestServer::from_local(
        LocalServer::create(Flavor::Postgres(postgres)).await?,
    ))
}

/// How a TLS MySQL / MariaDB server is set up.
#[derive(Debug, Clone)]
pub struct MysqlTls {
    /// The server's certificate and key (`--ssl-cert`, `--ssl-key`).
    pub server: CertPair,
    /// The CA whose client certificates the server accepts (`--ssl-ca`).
    pub ca: PathBuf,
    /// Whether the kit's user (`root`) must present a certificate signed by `ca`
    /// (`REQUIRE X509`).
    pub require_client_cert: bool,
}

/// A private MariaDB (as [`mysql_private`](super::mysql_private)) with TLS and
/// `--require-secure-transport=ON`: plain connections are refused. Its URL is the plain one
/// (`mysql://root@127.0.0.1:P/simba`): add `?ssl-mode=…&ssl-ca=…` as the test needs. The
/// certificate files are read where they are (keep the [`TestCerts`] alive).
pub async fn mysql_tls(tls: MysqlTls) -> Result<TestServer, ServerError> {
    let mysql = super::mysql::Mysql::detect()
        .map_err(|e| e.with_advice(true))?
        .with_tls(tls);
    Ok(TestServer::from_local(
        LocalServer::create(Flavor::Mysql(mysql)).await?,
    ))
}

/// How a TLS etcd server is set up.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The server's certificate and key (`--cert-file`, `--key-file`).
    pub server: CertPair,
    /// The CA whose client certificates the server accepts (`--trusted-ca-file`, given
    /// only with `require_client_cert`: etcd 3.4 asks every client for a certificate once
    /// it has one).
    pub ca: PathBuf,
    /// Whether clients must present a certificate signed by `ca` (`--client-cert-auth`).
    pub require_client_cert: bool,
}

/// A private single-member etcd (as [`etcd_private`](super::etcd_private)) that speaks only
/// TLS on its client port; its URL is `etcds://127.0.0.1:P` (add `?tlsCaFile=…` as the
/// test needs). The certificate files are read where they are (keep the [`TestCerts`]
/// alive).
pub async fn etcd_tls(tls: EtcdTls) -> Result<TestServer, ServerError> {
    let etcd = super::etcd::Etcd::detect()
        .map_err(|e| e.with_advice(true))?
        .with_tls(tls);
    Ok(TestServer::from_local(
        LocalServer::create(Flavor::Etcd(etcd)).await?,
    ))
}
