//! Query options of a database URL that this crate reads itself and takes out before the
//! driver sees the URL (the TLS options of PostgreSQL and MySQL, the connector's
//! `simba_table` / `simba_ddl`).

use simba_core::{Error, Result};

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

/// `url` with every secret replaced by `***`, for errors and logs: the userinfo password
/// (`mysql://user:password@…`, `postgres://user:password@…`) and every parameter named like
/// a password (`password=`, `pass=`, `sslpassword=`, …), in URLs and in PostgreSQL's
/// `key=value` connection strings alike.
///
/// ```
/// assert_eq!(
///     simba_jdbc::redact_url("postgres://app:hunter2@db/x?sslmode=require&password=hunter2"),
///     "postgres://app:***@db/x?sslmode=require&password=***",
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    simba_core::redact_url_with(url, simba_core::is_secret_key)
}

/// The field and reason of an [`Error::InvalidConfig`] (tests of the URL options).
#[cfg(test)]
pub(crate) fn invalid_config(e: Error) -> (String, String) {
    match e {
        Error::InvalidConfig { field, reason } => (field.to_owned(), reason),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::invalid_config as reason;

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
