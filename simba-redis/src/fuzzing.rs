//! Bodies of the fuzz targets `redis_url` and `redis_notice` (see `fuzz/`), replayed over
//! their committed corpora by this crate's tests. Not part of the API.

use simba_core::fuzzing::{PLANTED, url_parts};

use crate::config::RedisConfig;

/// URL parsing never panics; a password planted in the userinfo and in
/// `sentinelPassword` never shows in an error or in `Debug`.
pub fn url(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = RedisConfig::new(s).validate();
    }
    let p = url_parts(data, 4);
    for scheme in [
        "redis",
        "rediss",
        "redis-sentinel",
        "redis-cluster",
        "valkey",
    ] {
        let url = format!(
            "{scheme}://{}:{PLANTED}@{}:{}/{}?sentinelServiceName=m&sentinelPassword={PLANTED}",
            p[0], p[1], p[2], p[3]
        );
        let config = RedisConfig::new(url.as_str());
        if let Err(e) = config.validate() {
            assert!(!e.to_string().contains(PLANTED), "{url}: {e}");
        }
        let debug = format!("{config:?}");
        assert!(!debug.contains(PLANTED), "{url}: {debug}");
    }
}

/// Pub/sub notices (`event@@contenderId`, `reserved@@<ms>:<waiter>`) never panic the
/// parser; what it accepts is the message it was given, and a reservation is bounded.
pub fn notice(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match crate::subscriptions::parse_notice(s) {
        Some(crate::subscriptions::Notice::Acquired(id)) => {
            assert_eq!(format!("acquired{}{id}", simba_core::MESSAGE_SEPARATOR), s);
        }
        Some(crate::subscriptions::Notice::Released(id)) => {
            assert_eq!(format!("released{}{id}", simba_core::MESSAGE_SEPARATOR), s);
        }
        Some(crate::subscriptions::Notice::Reserved(d)) => {
            assert!(s.starts_with("reserved@@"), "{s:?}");
            assert!(d <= std::time::Duration::from_secs(60), "{s:?} -> {d:?}");
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use simba_core::fuzzing::replay;

    #[test]
    fn corpus_redis_url() {
        replay(env!("CARGO_MANIFEST_DIR"), "redis_url", super::url);
    }

    #[test]
    fn corpus_redis_notice() {
        replay(env!("CARGO_MANIFEST_DIR"), "redis_notice", super::notice);
    }
}
