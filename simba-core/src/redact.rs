//! Hiding secrets in backend URLs before they reach an error, a log line or a report.

/// Whether a query parameter (or `key=value` setting) named `key` holds a secret by the
/// common rule: its name, percent-decoded and lower-cased, contains `pass` (`password`,
/// `sentinelPassword`, `pass`, `sslpassword`, …), `pwd`, `secret` or `token`.
pub fn is_secret_key(key: &str) -> bool {
    let key = percent_decode(key).to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|word| key.contains(word))
}

/// `url` with every secret replaced by `***`: the password of the userinfo
/// (`scheme://user:password@host`, also `scheme://:password@host`), and the value of every
/// query parameter for which `secret_key` returns true (e.g. [`is_secret_key`]).
///
/// This is the mechanism; each backend crate's own `redact_url` says which of its URL
/// forms and parameters hold secrets, and is what callers use. Anything that is not a URL
/// is returned as it is, except for `key=value` words whose key is a secret (the
/// connection-string form some drivers accept).
///
/// ```
/// use simba_core::{is_secret_key, redact_url_with};
///
/// let shown = redact_url_with("postgres://app:hunter2@db/x?sslpassword=k&sslmode=require", is_secret_key);
/// assert_eq!(shown, "postgres://app:***@db/x?sslpassword=***&sslmode=require");
/// ```
pub fn redact_url_with(url: &str, secret_key: impl Fn(&str) -> bool) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_words(url, &secret_key);
    };
    // The userinfo ends at the last `@` before the query: a password may hold `@`, and
    // also `/` or `#` when its writer did not percent-encode them.
    let query_at = rest.find('?').unwrap_or(rest.len());
    let (authority, tail) = match rest[..query_at].rfind('@') {
        Some(at) => {
            let (userinfo, after) = rest.split_at(at);
            let userinfo = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => userinfo.to_owned(),
            };
            let end = after.find(['/', '?', '#']).unwrap_or(after.len());
            let (host, tail) = after.split_at(end);
            (format!("{userinfo}{host}"), tail)
        }
        None => {
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (host, tail) = rest.split_at(end);
            (host.to_owned(), tail)
        }
    };
    let (path, fragment) = match tail.find('#') {
        Some(i) => tail.split_at(i),
        None => (tail, ""),
    };
    let path = match path.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if secret_key(k) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => path.to_owned(),
    };
    format!("{scheme}://{authority}{path}{fragment}")
}

/// `key=value` words (space separated) with secret values hidden.
fn redact_words(s: &str, secret_key: &impl Fn(&str) -> bool) -> String {
    s.split(' ')
        .map(|word| match word.split_once('=') {
            Some((k, _)) if secret_key(k) => format!("{k}=***"),
            _ => word.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `%XX` sequences decoded where they form valid UTF-8; anything else kept as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(url: &str) -> String {
        redact_url_with(url, is_secret_key)
    }

    #[test]
    fn userinfo_passwords_are_hidden() {
        assert_eq!(r("redis://u:s3cr3t@h:6379/0"), "redis://u:***@h:6379/0");
        assert_eq!(r("redis://:s3cr3t@h"), "redis://:***@h");
        assert_eq!(r("mysql://u:p@ss@h/db"), "mysql://u:***@h/db");
        assert_eq!(
            r("zk://u:p@h1:2181,h2:2181/c"),
            "zk://u:***@h1:2181,h2:2181/c"
        );
        // A user name alone is not a secret.
        assert_eq!(r("postgres://app@h/db"), "postgres://app@h/db");
        assert_eq!(r("sqlite:///tmp/x.db"), "sqlite:///tmp/x.db");
    }

    #[test]
    fn secret_parameters_are_hidden() {
        assert_eq!(
            r("redis-sentinel://h:1/0?sentinelServiceName=m&sentinelPassword=s3cr3t"),
            "redis-sentinel://h:1/0?sentinelServiceName=m&sentinelPassword=***"
        );
        assert_eq!(
            r("mysql://u@h/db?PASSWORD=a&pass=b&x=1#frag"),
            "mysql://u@h/db?PASSWORD=***&pass=***&x=1#frag"
        );
        assert_eq!(
            r("postgres://h/db?pass%77ord=s"),
            "postgres://h/db?pass%77ord=***"
        );
        assert_eq!(
            r("postgres://h/db?%70assword=s"),
            "postgres://h/db?%70assword=***"
        );
        assert_eq!(
            r("host=h user=u password=s3cr3t dbname=d"),
            "host=h user=u password=*** dbname=d"
        );
    }

    #[test]
    fn nothing_secret_survives_odd_forms() {
        for url in [
            "redis://u:s3cr3t@",
            "redis://u:s3cr3t@h?",
            "redis://u:s3cr3t@h#x",
            "x://:s3cr3t@@h",
            "redis://u:s3/cr#3t@h/0",
            "redis://u:s3cr3t@h/0?sentinelPassword=s3cr3t",
            "postgres://u:s3cr3t@h:notaport/db?password=s3cr3t&password=s3cr3t",
        ] {
            assert!(!r(url).contains("s3cr3t"), "{url} -> {}", r(url));
        }
    }
}
