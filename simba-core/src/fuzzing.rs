//! Bodies of the fuzz targets of `fuzz/` that reach this crate (`cargo fuzz` builds with
//! `--cfg fuzzing`), the input shaping other crates' bodies share, and [`replay`], which
//! runs a target's committed corpus through its body as an ordinary test on stable.
//!
//! Not part of the API: it exists only under `cfg(fuzzing)`, in this crate's tests, and
//! with the internal feature `fuzzing` (which the other crates of the workspace enable for
//! their tests).

use std::path::Path;

use crate::id::{
    MAX_CONTENDER_ID_LEN, MAX_MUTEX_NAME_LEN, check_common_contender_id, check_common_mutex_name,
};
use crate::redact::{is_secret_key, redact_url_with};

/// The password the structured targets plant; it must never come out of a redactor.
pub const PLANTED: &str = "pw7Planted";

/// Mutex names and contender ids: validation never panics, and what it accepts is within
/// the length limit and free of control characters.
pub fn names(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if check_common_mutex_name(s).is_ok() {
        assert!(s.len() <= MAX_MUTEX_NAME_LEN && !s.is_empty(), "{s:?}");
        assert!(!s.chars().any(char::is_control), "{s:?}");
    }
    if check_common_contender_id(s).is_ok() {
        assert!(s.len() <= MAX_CONTENDER_ID_LEN && !s.is_empty(), "{s:?}");
        assert!(!s.chars().any(char::is_control), "{s:?}");
    }
}

/// Splits fuzz input into up to `n` text parts (at `\n`), without the characters that
/// delimit URL parts, so that a planted password stays where it was put.
pub fn url_parts(data: &[u8], n: usize) -> Vec<String> {
    let s = String::from_utf8_lossy(data);
    let mut parts: Vec<String> = s
        .splitn(n, '\n')
        .map(|p| {
            let mut p: String = p
                .chars()
                .filter(|c| !"/?#&=@:".contains(*c) && !c.is_whitespace())
                .collect();
            // Until none is left: one pass can join a new one (`pw7Plpw7Plantedanted`),
            // which the fuzzer found.
            while p.contains(PLANTED) {
                p = p.replace(PLANTED, "");
            }
            p
        })
        .collect();
    parts.resize(n, String::new());
    parts
}

/// Redaction: any text never panics; a password planted in the userinfo and in a
/// password parameter of a URL built from the input never survives.
pub fn redact(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = redact_url_with(s, is_secret_key);
    }
    let p = url_parts(data, 5);
    let url = format!(
        "{}://{}:{PLANTED}@{}/{}?{}=1&password={PLANTED}",
        p[0], p[1], p[2], p[3], p[4]
    );
    let shown = redact_url_with(&url, is_secret_key);
    assert!(!shown.contains(PLANTED), "{url} -> {shown}");
}

/// Runs every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/` of the
/// workspace through `body`; panics when the corpus is missing or empty, so that a moved
/// corpus cannot make the replay pass without running anything. `crate_dir` is the calling
/// crate's `env!("CARGO_MANIFEST_DIR")` (every crate sits one level below the root).
pub fn replay(crate_dir: &str, target: &str, body: fn(&[u8])) {
    let workspace_root = Path::new(crate_dir).join("..");
    let mut ran = 0;
    for dir in ["corpus", "regressions"] {
        let dir = workspace_root.join("fuzz").join(dir).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let data = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            body(&data);
            ran += 1;
        }
    }
    assert!(
        ran > 0,
        "no corpus for fuzz target {target} under {}",
        workspace_root.display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_names() {
        replay(env!("CARGO_MANIFEST_DIR"), "names", names);
    }

    #[test]
    fn corpus_redact() {
        replay(env!("CARGO_MANIFEST_DIR"), "redact", redact);
    }
}
