//! Contender ids and validation of names.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// The longest mutex name accepted (bytes). Backends may accept less (a SQL column).
pub const MAX_MUTEX_NAME_LEN: usize = 200;
/// The longest contender id accepted (bytes).
pub const MAX_CONTENDER_ID_LEN: usize = 200;
/// The separator of Simba's Redis messages (`event@@ownerId`); ids must not contain it.
pub const MESSAGE_SEPARATOR: &str = "@@";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// 64 pseudo-random bits, different in every call and every process.
///
/// Seeds from the standard library's per-process random hasher keys, the clock and a counter.
/// Not for cryptography: used for jitter and id suffixes.
pub(crate) fn random_u64() -> u64 {
    static STATE: OnceLock<RandomState> = OnceLock::new();
    let mut h = STATE.get_or_init(RandomState::new).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Ok(t) = SystemTime::now().duration_since(UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

fn host_name() -> String {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    let clean: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .take(64)
        .collect();
    if clean.is_empty() {
        "localhost".to_owned()
    } else {
        clean
    }
}

/// A new contender id, unique across hosts, processes, restarts and calls:
/// `{n}:{pid}@{host}:{random}`, e.g. `3:4121@web-1:9f1c2a7be0d4c311`.
///
/// The readable part follows Simba's `n:pid@host`; the random suffix keeps two processes
/// that reuse a pid (a restart, a container) apart.
pub fn generate_contender_id() -> String {
    static HOST: OnceLock<String> = OnceLock::new();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let host = HOST.get_or_init(host_name);
    format!("{n}:{}@{host}:{:016x}", std::process::id(), random_u64())
}

fn shorten(s: &str) -> String {
    if s.len() <= 64 {
        return s.to_owned();
    }
    let mut end = 64;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Checks a mutex name: 1 to [`MAX_MUTEX_NAME_LEN`] bytes, no control characters, no
/// whitespace at either end, and none of `{`, `}` (they would break Redis Cluster hash tags).
///
/// # Errors
/// [`Error::InvalidName`] saying what is wrong.
pub fn validate_mutex_name(name: &str) -> Result<()> {
    let fail = |reason: String| {
        Err(Error::InvalidName {
            name: shorten(name),
            reason,
        })
    };
    if name.is_empty() {
        return fail("a mutex name must not be empty".into());
    }
    if name.len() > MAX_MUTEX_NAME_LEN {
        return fail(format!(
            "{} bytes is longer than the limit of {MAX_MUTEX_NAME_LEN}; use a shorter name",
            name.len()
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return fail(format!(
            "contains the control character {c:?}; use printable characters"
        ));
    }
    if name.trim() != name {
        return fail("starts or ends with whitespace".into());
    }
    if name.contains(['{', '}']) {
        return fail("contains `{` or `}`, which would break Redis Cluster hash tags".into());
    }
    Ok(())
}

/// Checks a contender id: 1 to [`MAX_CONTENDER_ID_LEN`] bytes, no control characters or
/// whitespace, and not containing [`MESSAGE_SEPARATOR`] (`@@`).
///
/// # Errors
/// [`Error::InvalidContenderId`] saying what is wrong.
pub fn validate_contender_id(id: &str) -> Result<()> {
    let fail = |reason: String| {
        Err(Error::InvalidContenderId {
            id: shorten(id),
            reason,
        })
    };
    if id.is_empty() {
        return fail("a contender id must not be empty".into());
    }
    if id.len() > MAX_CONTENDER_ID_LEN {
        return fail(format!("longer than {MAX_CONTENDER_ID_LEN} bytes"));
    }
    if id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return fail("contains whitespace or a control character".into());
    }
    if id.contains(MESSAGE_SEPARATOR) {
        return fail(format!(
            "contains `{MESSAGE_SEPARATOR}`, the separator of simba's Redis messages"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_readable_and_valid() {
        let a = generate_contender_id();
        let b = generate_contender_id();
        assert_ne!(a, b);
        assert!(a.contains(&format!(":{}@", std::process::id())), "{a}");
        validate_contender_id(&a).expect("generated id is valid");
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_mutex_name("orders-migration").is_ok());
        assert!(validate_mutex_name("ünïcode/ok:1").is_ok());
        for bad in ["", " lead", "trail ", "a\nb", "a\u{7}", "x{y}"] {
            let err = validate_mutex_name(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err}");
        }
        let long = "n".repeat(MAX_MUTEX_NAME_LEN + 1);
        let msg = validate_mutex_name(&long)
            .expect_err("too long")
            .to_string();
        assert!(msg.contains("longer than the limit"), "{msg}");
        assert!(msg.len() < 200, "name is shortened in the message: {msg}");
    }

    #[test]
    fn contender_ids_are_validated() {
        for bad in ["", "a@@b", "a b", "a\tb"] {
            assert!(validate_contender_id(bad).is_err(), "{bad:?}");
        }
        assert!(validate_contender_id("a@b").is_ok());
    }
}
