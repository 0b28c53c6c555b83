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

/// The longest id [`generate_contender_id`] makes: it fits the `owner_id CHAR(32)` of a
/// table made by the JVM Simba library, with the 6 characters of a hold's `held@@` prefix.
pub const GENERATED_ID_MAX_LEN: usize = 26;

/// A new contender id, unique across hosts, processes, restarts and calls:
/// `{n}:{pid}@{host}:{random}`, e.g. `3:4121@web-1:2kD9xPq0aZb`, at most
/// [`GENERATED_ID_MAX_LEN`] characters.
///
/// The readable part follows Simba's `n:pid@host`; the random suffix (64 bits, in 11
/// characters of base 62) keeps two processes that reuse a pid (a restart, a container)
/// apart. The host name is cut to fit, and left out when the counter and the pid leave no
/// room for it.
pub fn generate_contender_id() -> String {
    static HOST: OnceLock<String> = OnceLock::new();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let host = HOST.get_or_init(host_name);
    let random = base62(random_u64());
    let head = format!("{n}:{}", std::process::id());
    // head + '@' + host + ':' + random
    let room = GENERATED_ID_MAX_LEN.saturating_sub(head.len() + 2 + random.len());
    if room == 0 {
        return format!("{}:{random}", std::process::id());
    }
    // The host name is ASCII (see `host_name`): any cut is a character boundary.
    let host = &host[..host.len().min(room)];
    format!("{head}@{host}:{random}")
}

/// `v` in base 62 (`0-9A-Za-z`), always 11 characters.
fn base62(mut v: u64) -> String {
    const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = [b'0'; 11];
    for slot in out.iter_mut().rev() {
        *slot = DIGITS[(v % 62) as usize];
        v /= 62;
    }
    out.iter().map(|&b| char::from(b)).collect()
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

/// Whether `c` changes how text around it is shown without showing itself: the
/// bidirectional controls (U+202A–U+202E, U+2066–U+2069, U+200E, U+200F, U+061C), which can
/// make `deploy\u{202E}gol` look like `deploylog`, and the other format and default-ignorable
/// characters (zero-width spaces and joiners, word joiner, BOM, soft hyphen, variation
/// selectors, tags, Hangul fillers…). Two names that print alike but differ in one of these
/// would be two mutexes that look like one.
fn is_invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{034F}'
            | '\u{061C}'
            | '\u{115F}'..='\u{1160}'
            | '\u{17B4}'..='\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{200B}'..='\u{200F}'
            | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{206F}'
            | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FEFF}'
            | '\u{FFA0}'
            | '\u{FFF0}'..='\u{FFFB}'
            | '\u{1BCA0}'..='\u{1BCA3}'
            | '\u{1D173}'..='\u{1D17A}'
            | '\u{E0000}'..='\u{E0FFF}'
    )
}

/// The first control or invisible character of `s`, described for an error message.
fn unprintable(s: &str) -> Option<String> {
    s.chars().find_map(|c| {
        if c.is_control() {
            Some(format!("the control character {c:?}"))
        } else if is_invisible(c) {
            Some(format!(
                "the invisible or text-direction character U+{:04X}",
                u32::from(c)
            ))
        } else {
            None
        }
    })
}

/// Checks a mutex name against the rules every backend shares: 1 to
/// [`MAX_MUTEX_NAME_LEN`] bytes, no control characters, no bidirectional controls or other
/// invisible (format, default-ignorable) characters, no whitespace at either end, and no
/// `{` or `}` (on Redis they would make a Cluster hash tag of part of the name; refused on
/// every backend, so that a name that works on one works on all). A backend may refuse
/// more ([`LeaseStore::check_mutex_name`](crate::backend::LeaseStore::check_mutex_name),
/// [`ContendServiceFactory::check_mutex_name`](crate::ContendServiceFactory::check_mutex_name)):
/// a SQL table's narrower `mutex` column, for example.
///
/// # Errors
/// [`Error::InvalidName`] saying what is wrong.
pub fn check_common_mutex_name(name: &str) -> Result<()> {
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
    if let Some(what) = unprintable(name) {
        return fail(format!("contains {what}; use printable characters"));
    }
    if name.trim() != name {
        return fail("starts or ends with whitespace".into());
    }
    if name.contains(['{', '}']) {
        return fail(
            "contains `{` or `}`, which no backend accepts (on Redis they would break the \
             Cluster hash tag of the keys)"
                .into(),
        );
    }
    Ok(())
}

/// Checks a contender id against the rules every backend shares: 1 to
/// [`MAX_CONTENDER_ID_LEN`] bytes, no control characters, invisible characters (as for
/// mutex names) or whitespace, and not starting with [`HELD_PREFIX`](crate::HELD_PREFIX)
/// (the owner id of a mutex kept held after a release, which no contender may have). A
/// backend may refuse more ([`LeaseStore::check_contender_id`](crate::backend::LeaseStore::check_contender_id)):
/// Redis refuses `@@`, the separator of its messages.
///
/// # Errors
/// [`Error::InvalidContenderId`] saying what is wrong.
pub fn check_common_contender_id(id: &str) -> Result<()> {
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
    if let Some(what) = unprintable(id) {
        return fail(format!("contains {what}"));
    }
    if id.starts_with(crate::owner::HELD_PREFIX) {
        return fail(format!(
            "starts with `{}`, which marks a mutex kept held after a release",
            crate::owner::HELD_PREFIX
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
        check_common_contender_id(&a).expect("generated id is valid");
        for _ in 0..1000 {
            let id = generate_contender_id();
            assert!(id.len() <= GENERATED_ID_MAX_LEN, "{id}");
        }
    }

    #[test]
    fn base62_is_fixed_width_and_distinct() {
        assert_eq!(base62(0), "00000000000");
        assert_eq!(base62(61), "0000000000z");
        assert_eq!(base62(u64::MAX).len(), 11);
        assert_ne!(base62(1), base62(62));
    }

    #[test]
    fn names_are_validated() {
        assert!(check_common_mutex_name("orders-migration").is_ok());
        assert!(check_common_mutex_name("ünïcode/ok:1").is_ok());
        for bad in [
            "", " lead", "trail ", "a\nb", "a\u{7}", "x{y}", "open{", "close}",
        ] {
            let err = check_common_mutex_name(bad).expect_err(bad);
            assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err}");
        }
        let long = "n".repeat(MAX_MUTEX_NAME_LEN + 1);
        let msg = check_common_mutex_name(&long)
            .expect_err("too long")
            .to_string();
        assert!(msg.contains("longer than the limit"), "{msg}");
        assert!(msg.len() < 200, "name is shortened in the message: {msg}");
    }

    #[test]
    fn contender_ids_are_validated() {
        for bad in ["", "held@@b", "a b", "a\tb"] {
            assert!(check_common_contender_id(bad).is_err(), "{bad:?}");
        }
        assert!(check_common_contender_id("a@b").is_ok());
        assert!(
            check_common_contender_id("a@@b").is_ok(),
            "`@@` is Redis's rule, not core's"
        );
    }

    #[test]
    fn invisible_and_bidi_characters_are_rejected() {
        // Right-to-left override, isolates, zero-width space and joiner, BOM, soft hyphen,
        // word joiner, a variation selector, a tag character.
        for c in [
            '\u{202E}',
            '\u{2066}',
            '\u{2069}',
            '\u{200B}',
            '\u{200D}',
            '\u{200F}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{2060}',
            '\u{FE0F}',
            '\u{E0041}',
            '\u{061C}',
        ] {
            let name = format!("deploy{c}log");
            let err = check_common_mutex_name(&name).expect_err(&name);
            assert!(matches!(err, Error::InvalidName { .. }), "{name:?}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("U+{:04X}", u32::from(c))) && msg.contains("invisible"),
                "{msg}"
            );
            let err = check_common_contender_id(&name).expect_err(&name);
            assert!(
                matches!(err, Error::InvalidContenderId { .. }),
                "{name:?}: {err}"
            );
        }
        // Visible non-ASCII text stays valid: accents, CJK, Arabic and Hebrew letters, emoji.
        for ok in ["crème-brûlée", "注文", "طلب", "הזמנה", "job-🚀"] {
            assert!(check_common_mutex_name(ok).is_ok(), "{ok}");
            assert!(check_common_contender_id(ok).is_ok(), "{ok}");
        }
    }
}
