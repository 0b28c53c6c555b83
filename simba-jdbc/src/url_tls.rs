//! The TLS options of PostgreSQL and MySQL URLs: each database names its four options
//! (mode, CA, client certificate, key) and reads its mode; the rest is shared.

use simba_core::{Error, Result};

use crate::config::redact_url;

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

/// Takes the query options named in `names` out of a server URL (the options this crate
/// reads itself, which the driver would refuse): gives each, `%`-decoded and not empty, to
/// `take` in the URL's order, and returns the URL without them (the other options in
/// their order, and the fragment, kept). An option given twice is given to `take` twice.
///
/// # Errors
/// [`Error::InvalidConfig`] naming the option if its value has a bad `%`-escape or is
/// empty (the URL redacted in the reason), or the first error of `take`.
pub(crate) fn take_query_options(
    url: &str,
    names: &[&'static str],
    mut take: impl FnMut(&'static str, String) -> Result<()>,
) -> Result<String> {
    let (base, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (url, None),
    };
    let Some((path, query)) = base.split_once('?') else {
        return Ok(url.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let Some(&name) = names.iter().find(|o| **o == key) else {
            kept.push(pair);
            continue;
        };
        let value = percent_decode(value).ok_or_else(|| {
            Error::config(
                name,
                format!(
                    "the value of {name} in `{}` has a bad %-escape",
                    redact_url(url)
                ),
            )
        })?;
        if value.is_empty() {
            return Err(Error::config(
                name,
                format!("{name} is empty in `{}`: give a value", redact_url(url)),
            ));
        }
        take(name, value)?;
    }
    let mut stripped = path.to_owned();
    if !kept.is_empty() {
        stripped.push('?');
        stripped.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        stripped.push('#');
        stripped.push_str(f);
    }
    Ok(stripped)
}

/// `%XX` escapes decoded (the URL form of a path with special characters).
fn percent_decode(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = value.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(e: Error) -> (String, String) {
        match e {
            Error::InvalidConfig { field, reason } => (field.to_owned(), reason),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn query_options_are_taken_in_order_and_the_rest_kept() {
        let mut taken = Vec::new();
        let url = take_query_options("s://h/db?a=1&x=%2Fp&&b&x=2#f?x=3", &["x"], |n, v| {
            taken.push((n, v));
            Ok(())
        })
        .expect("valid");
        assert_eq!(url, "s://h/db?a=1&b#f?x=3");
        assert_eq!(taken, [("x", "/p".to_owned()), ("x", "2".to_owned())]);
        let url = take_query_options("s://h/db#f", &["x"], |_, _| panic!("no options"));
        assert_eq!(url.expect("valid"), "s://h/db#f");
        let (f, r) = reason(
            take_query_options("s://u:hunter2@h/db?x=1&y=%zz", &["x", "y"], |_, _| Ok(()))
                .expect_err("escape"),
        );
        assert_eq!(f, "y");
        assert!(r.contains("bad %-escape") && !r.contains("hunter2"), "{r}");
        let (f, _) = reason(
            take_query_options("s://h/db?x=&y=%zz", &["x", "y"], |_, _| Ok(())).expect_err("empty"),
        );
        assert_eq!(f, "x");
        let (f, _) = reason(
            take_query_options("s://h/db?x=1&y=%zz", &["x", "y"], |n, _| {
                Err(Error::config(n, "refused"))
            })
            .expect_err("refused"),
        );
        assert_eq!(f, "x");
    }
}
