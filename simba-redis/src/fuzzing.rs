//! Bodies of the fuzz targets `redis_url`, `redis_notice` and `redis_reply` (see `fuzz/`),
//! replayed over their committed corpora by this crate's tests. Not part of the API.

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
            assert_eq!(format!("acquired{}{id}", crate::MESSAGE_SEPARATOR), s);
        }
        Some(crate::subscriptions::Notice::Released(id)) => {
            assert_eq!(format!("released{}{id}", crate::MESSAGE_SEPARATOR), s);
        }
        Some(crate::subscriptions::Notice::Reserved(d)) => {
            assert!(s.starts_with("reserved@@"), "{s:?}");
            assert!(d <= std::time::Duration::from_secs(60), "{s:?} -> {d:?}");
        }
        None => {}
    }
}

/// Builds a script reply (a `fred` value) from fuzz input, so that the fuzzer explores
/// replies of every shape: one tag byte per value (mod 8: 0 nil, 1 integer from 8 bytes
/// LE, 2 text and 3 bytes of a length byte's length, 4 double from 8 bytes LE, 5 array of
/// `byte % 9` values, 6 boolean, 7 `QUEUED`); missing bytes read as 0; arrays deeper than
/// four levels hold nil.
pub fn reply_value(data: &[u8]) -> fred::types::Value {
    use fred::types::Value;
    fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (head, tail) = data.split_at(n.min(data.len()));
        *data = tail;
        head
    }
    fn byte(data: &mut &[u8]) -> u8 {
        take(data, 1).first().copied().unwrap_or(0)
    }
    fn word(data: &mut &[u8]) -> [u8; 8] {
        let mut w = [0; 8];
        let got = take(data, 8);
        w[..got.len()].copy_from_slice(got);
        w
    }
    fn value(data: &mut &[u8], depth: u8) -> Value {
        match byte(data) % 8 {
            0 => Value::Null,
            1 => Value::from(i64::from_le_bytes(word(data))),
            2 => {
                let n = usize::from(byte(data));
                Value::from(String::from_utf8_lossy(take(data, n)).into_owned())
            }
            3 => {
                let n = usize::from(byte(data));
                Value::from(Box::<[u8]>::from(take(data, n)))
            }
            4 => Value::from(f64::from_bits(u64::from_le_bytes(word(data)))),
            5 if depth < 4 => {
                let n = byte(data) % 9;
                Value::Array((0..n).map(|_| value(data, depth + 1)).collect())
            }
            5 => Value::Null,
            6 => Value::from(byte(data) & 1 == 1),
            _ => Value::Queued,
        }
    }
    let mut data = data;
    value(&mut data, 0)
}

/// Script replies: whatever the server (or something posing as it) answers, turning it
/// into a lease reply or a release outcome never panics; an accepted lease reply names
/// the owner the reply's first value gave, and "no owner" carries no fence.
pub fn reply(data: &[u8]) {
    use fred::types::Value;
    let v = reply_value(data);
    if let Ok(r) = crate::error::lease_reply("fuzzed script", v.clone()) {
        let Value::Array(items) = &v else {
            panic!("an accepted lease reply that is no array: {v:?}");
        };
        assert_eq!(items.len(), 6, "{v:?}");
        match &items[0] {
            Value::Null => assert!(r.owner.owner_id.is_empty(), "{v:?}"),
            Value::String(s) => assert_eq!(r.owner.owner_id, s.to_string(), "{v:?}"),
            Value::Bytes(b) => assert_eq!(r.owner.owner_id.as_bytes(), &b[..], "{v:?}"),
            other => panic!("an owner id from {other:?}"),
        }
        if r.owner.owner_id.is_empty() {
            assert_eq!(r.owner.fence, 0, "{v:?}");
            assert!(!r.owner.has_owner(), "{v:?}");
        }
    }
    if let Ok((_, waiter)) = crate::error::release_reply(v.clone()) {
        assert!(
            matches!(&v, Value::Array(items) if items.len() == 2),
            "{v:?}"
        );
        let _ = waiter;
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

    #[test]
    fn corpus_redis_reply() {
        replay(env!("CARGO_MANIFEST_DIR"), "redis_reply", super::reply);
    }

    /// The seeds decode to the replies they stand for (so the corpus starts from real
    /// shapes, not noise).
    #[test]
    fn seed_shapes() {
        use fred::types::Value;
        // [ "c1", 1, 2, 3, 7, 4 ]: an owner.
        let mut seed = vec![5, 6, 2, 2, b'c', b'1'];
        for n in [1i64, 2, 3, 7, 4] {
            seed.push(1);
            seed.extend(n.to_le_bytes());
        }
        let v = super::reply_value(&seed);
        let r = crate::error::lease_reply("seed", v).expect("a valid lease reply");
        assert_eq!(
            (r.owner.owner_id.as_str(), r.owner.fence, r.now),
            ("c1", 7, 4)
        );
        // [ 1, nil ]: released, no waiter.
        let v = super::reply_value(&[5, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(v, Value::Array(vec![Value::Integer(1), Value::Null]));
        assert_eq!(
            crate::error::release_reply(v).expect("valid"),
            (true, String::new())
        );
    }
}
