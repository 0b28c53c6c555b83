//! Bodies of the fuzz targets `zk_url` and `zk_latch` (see `fuzz/`), replayed over their
//! committed corpora by this crate's tests. Not part of the API.

use simba_core::fuzzing::{PLANTED, url_parts};

use crate::config::{ZkConfig, redact_url};

/// Connect strings and URLs never panic the parser; digest credentials planted in a
/// `zk://` URL never show in an error, in `Debug` or in the redacted URL.
pub fn url(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = ZkConfig::new(s).validate();
        if let Ok(c) = ZkConfig::from_url(s) {
            let _ = c.validate();
        }
    }
    let p = url_parts(data, 3);
    let url = format!("zk://{}:{PLANTED}@{},{}/{}", p[0], p[1], p[2], p[0]);
    match ZkConfig::from_url(&url) {
        Ok(c) => {
            assert!(!format!("{c:?}").contains(PLANTED), "{url}: {c:?}");
            if let Err(e) = c.validate() {
                assert!(!e.to_string().contains(PLANTED), "{url}: {e}");
            }
        }
        Err(e) => assert!(!e.to_string().contains(PLANTED), "{url}: {e}"),
    }
    assert!(!redact_url(&url).contains(PLANTED), "{url}");
}

/// Latch children of any names (the server's and strangers') sort without panicking, and
/// the result holds only names that were given.
pub fn latch(data: &[u8]) {
    let s = String::from_utf8_lossy(data);
    let children: Vec<String> = s.split('\n').map(str::to_owned).collect();
    for name in crate::common::sort_latch(&children) {
        assert!(children.iter().any(|c| c == name), "{name:?}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn corpus_zk_url() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "zk_url", super::url);
    }

    #[test]
    fn corpus_zk_latch() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "zk_latch", super::latch);
    }
}
