//! The TLS options of PostgreSQL and MySQL URLs: each database names its four options
//! (mode, CA, client certificate, key) and reads its mode; the rest is shared.

use simba_core::{Error, Result};

use crate::url_query::take_query_options;

/// A database's names for the four TLS options of its URLs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TlsOptionNames {
    /// The mode (`sslmode`, `ssl-mode`).
    pub(crate) mode: &'static str,
    /// The CA file (`sslrootcert`, `ssl-ca`).
    pub(crate) ca: &'static str,
    /// The client certificate (`sslcert`, `ssl-cert`).
    pub(crate) cert: &'static str,
    /// The client certificate's key (`sslkey`, `ssl-key`).
    pub(crate) key: &'static str,
}

/// The TLS options of a SQL URL: a mode of the database's own kind and three PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UrlTls<M> {
    /// The mode; `None`: not given (the database's client default).
    pub(crate) mode: Option<M>,
    /// The CA certificates.
    pub(crate) ca: Option<std::path::PathBuf>,
    /// The client certificate.
    pub(crate) cert: Option<std::path::PathBuf>,
    /// The client certificate's key.
    pub(crate) key: Option<std::path::PathBuf>,
}

impl<M> Default for UrlTls<M> {
    fn default() -> Self {
        UrlTls {
            mode: None,
            ca: None,
            cert: None,
            key: None,
        }
    }
}

/// Splits a URL into the URL its driver is given (without the TLS options `names`) and
/// those options, the mode read by `parse_mode`; a client certificate needs its key and
/// a key its certificate.
pub(crate) fn split_tls_options<M>(
    url: &str,
    names: TlsOptionNames,
    parse_mode: impl Fn(&str) -> Result<M>,
) -> Result<(String, UrlTls<M>)> {
    let mut options = UrlTls::default();
    let all = [names.mode, names.ca, names.cert, names.key];
    let stripped = take_query_options(url, &all, |name, value| {
        if name == names.mode {
            options.mode = Some(parse_mode(&value)?);
        } else if name == names.ca {
            options.ca = Some(value.into());
        } else if name == names.cert {
            options.cert = Some(value.into());
        } else {
            options.key = Some(value.into());
        }
        Ok(())
    })?;
    match (&options.cert, &options.key) {
        (Some(_), None) => Err(Error::config(
            names.key,
            format!(
                "{} is given without {}: give the client certificate's private key with \
                 {}=/path/client-key.pem",
                names.cert, names.key, names.key
            ),
        )),
        (None, Some(_)) => Err(Error::config(
            names.cert,
            format!(
                "{} is given without {}: give the client certificate with {}=/path/client.pem",
                names.key, names.cert, names.cert
            ),
        )),
        _ => Ok((stripped, options)),
    }
}
