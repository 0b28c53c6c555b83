//! The hash behind the names of native locks and of SQLite's bell files.

/// 64-bit FNV-1a: a hash that is the same in every process and every Rust version (the
/// key of a native lock must be, across the processes that share it).
pub(crate) fn stable_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain(std::iter::once(0u8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
