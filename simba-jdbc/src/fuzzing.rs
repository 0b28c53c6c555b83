//! Body of the fuzz target `sql_url` (see `fuzz/`), replayed over its committed corpus by
//! this crate's tests. Not part of the API.

use simba_core::fuzzing::{PLANTED, url_parts};

use crate::config::SqlConfig;

/// URL parsing never panics; a password planted in the userinfo and in `password=` never
/// shows in an error, in `Debug` or in the redacted URL.
pub fn url(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let c = SqlConfig::new(s);
        let _ = c.validate();
        let _ = c.backend();
    }
    let p = url_parts(data, 4);
    for scheme in ["mysql", "mariadb", "postgres", "postgresql", "sqlite"] {
        let url = format!(
            "{scheme}://{}:{PLANTED}@{}:{}/{}?password={PLANTED}",
            p[0], p[1], p[2], p[3]
        );
        let config = SqlConfig::new(url.as_str());
        if let Err(e) = config.validate() {
            assert!(!e.to_string().contains(PLANTED), "{url}: {e}");
        }
        for shown in [format!("{config:?}"), config.redacted_url()] {
            assert!(!shown.contains(PLANTED), "{url}: {shown}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn corpus_sql_url() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "sql_url", super::url);
    }
}
