//! Bodies of the fuzz targets `sql_url` and `sql_row` (see `fuzz/`), replayed over their
//! committed corpora by this crate's tests. Not part of the API.

use simba_core::fuzzing::{PLANTED, url_parts};
use simba_core::{ContendPeriod, Error, MutexOwner};

use crate::config::{Backend, SqlConfig};
use crate::rows::OwnerRow;
use crate::rows::owner_reply;

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

/// Builds the answer of an owner query from fuzz input: `None` (no row at all), or an
/// [`OwnerRow`] with every column, and the grace a contender without the native lock
/// passes. Layout: a flag byte (bit 0: a row; bits 1–5: `owner_id`, `acquired_at`,
/// `ttl_at`, `transition_at`, `version` are not NULL; bit 6: a grace), then `now_ms` and
/// each present number as 8 bytes little-endian, then the grace, then the owner id as a
/// length byte and that many bytes (lossy UTF-8). Missing bytes read as 0.
pub(crate) fn owner_row(data: &[u8]) -> (Option<OwnerRow>, Option<i64>) {
    fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (head, tail) = data.split_at(n.min(data.len()));
        *data = tail;
        head
    }
    fn number(data: &mut &[u8]) -> i64 {
        let mut w = [0; 8];
        let got = take(data, 8);
        w[..got.len()].copy_from_slice(got);
        i64::from_le_bytes(w)
    }
    let mut data = data;
    let flags = take(&mut data, 1).first().copied().unwrap_or(0);
    let has = |bit: u8| flags & (1 << bit) != 0;
    let now_ms = number(&mut data);
    let mut column = |bit: u8| has(bit).then(|| number(&mut data));
    let acquired_at = column(2);
    let ttl_at = column(3);
    let transition_at = column(4);
    let version = column(5);
    let grace = column(6);
    let owner_id = has(1).then(|| {
        let n = usize::from(take(&mut data, 1).first().copied().unwrap_or(0));
        String::from_utf8_lossy(take(&mut data, n)).into_owned()
    });
    let row = has(0).then_some(OwnerRow {
        now_ms,
        owner_id,
        acquired_at,
        ttl_at,
        transition_at,
        version,
        waiter_id: None,
    });
    (row, grace)
}

/// Owner rows: whatever the database (or something posing as it) answers, turning it into
/// a lease reply never panics, for every backend, and the reply is what the row says:
///
/// - an error is a backend error naming the backend, and only for no row at all or for an
///   owner within its lease whose version (the fence) is negative;
/// - an owner (non-empty id) is within its lease (`transition_at > now`), with the row's
///   times and its version as the fence;
/// - an owner whose lease is over is no owner ([`MutexOwner::NONE`]);
/// - a released row seen with a grace is held by nobody (empty id, no fence) until
///   `transition_at + grace` (saturating) if that is still ahead, and free otherwise;
/// - the lease engine's first use of the reply (when to contend next, for the owner and
///   for anyone else) never panics either.
pub fn row(data: &[u8]) {
    let (row, grace) = owner_row(data);
    for kind in [Backend::Mysql, Backend::Postgres, Backend::Sqlite] {
        let result = owner_reply(kind, row.clone(), grace);
        let Some(row) = &row else {
            assert!(
                matches!(&result, Err(Error::Backend { backend, .. }) if *backend == kind.name()),
                "{kind}: no row gave {result:?}"
            );
            continue;
        };
        let transition_at = row.transition_at.unwrap_or(0);
        let id = row.owner_id.as_deref();
        let owned = id.is_some_and(|id| !id.is_empty()) && transition_at > row.now_ms;
        let reply = match result {
            Ok(reply) => reply,
            Err(e) => {
                assert!(
                    matches!(&e, Error::Backend { backend, .. } if *backend == kind.name()),
                    "{kind}: {row:?} gave another error: {e:?}"
                );
                assert!(
                    owned && row.version.is_some_and(|v| v < 0),
                    "{kind}: {row:?} refused for no reason: {e}"
                );
                continue;
            }
        };
        assert_eq!(reply.now, row.now_ms, "{kind}: {row:?}");
        let owner = &reply.owner;
        match id {
            Some(id) if !id.is_empty() => {
                if owned {
                    let version = row.version.unwrap_or(0);
                    assert_eq!(owner.owner_id, id, "{kind}: {row:?}");
                    assert_eq!(u64::try_from(version).ok(), Some(owner.fence), "{row:?}");
                    assert_eq!(owner.transition_at, transition_at, "{row:?}");
                    assert_eq!(owner.ttl_at, row.ttl_at.unwrap_or(0), "{row:?}");
                    assert_eq!(owner.acquired_at, row.acquired_at.unwrap_or(0), "{row:?}");
                    assert!(owner.is_in_lease(reply.now), "{kind}: {row:?} -> {owner:?}");
                } else {
                    assert_eq!(*owner, MutexOwner::NONE, "{kind}: past lease {row:?}");
                }
            }
            Some(_) => {
                let until = grace.map(|g| transition_at.saturating_add(g));
                match until.filter(|&u| u > row.now_ms) {
                    Some(until) => {
                        assert!(owner.owner_id.is_empty(), "{kind}: {row:?} -> {owner:?}");
                        assert_eq!(owner.fence, 0, "{kind}: a placeholder with a fence");
                        assert_eq!(owner.acquired_at, 0, "{kind}: {row:?} -> {owner:?}");
                        assert_eq!(owner.ttl_at, until, "{kind}: {row:?} -> {owner:?}");
                        assert_eq!(owner.transition_at, until, "{kind}: {row:?}");
                    }
                    None => assert_eq!(*owner, MutexOwner::NONE, "{kind}: {row:?} {grace:?}"),
                }
            }
            None => assert_eq!(*owner, MutexOwner::NONE, "{kind}: no owner id in {row:?}"),
        }
        // Whatever the row: a named owner is within its lease, nobody has no fence.
        if owner.has_owner() {
            assert!(
                owner.transition_at > reply.now,
                "{kind}: {row:?} -> {owner:?}"
            );
        } else {
            assert_eq!(owner.fence, 0, "{kind}: {row:?} -> {owner:?}");
        }
        // What the lease engine does with it first: when to contend next, as the owner
        // and as anyone else, with the default and the widest jitter, rolled at both ends.
        for me in [owner.owner_id.as_str(), "fuzz-other"] {
            if me.is_empty() {
                continue;
            }
            let default = ContendPeriod::new(me);
            let wide = default
                .clone()
                .with_jitter(i64::MIN..i64::MAX, i64::MIN..i64::MAX);
            for period in std::iter::once(default).chain(wide.ok()) {
                let low = period.next_delay_with(owner, reply.now, |r| r.start);
                let high = period.next_delay_with(owner, reply.now, |r| r.end - 1);
                assert!(low >= 0 && high >= 0, "{kind}: {row:?} -> {low} / {high}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn corpus_sql_url() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "sql_url", super::url);
    }

    #[test]
    fn corpus_sql_row() {
        simba_core::fuzzing::replay(env!("CARGO_MANIFEST_DIR"), "sql_row", super::row);
    }

    /// The seeds decode to the rows they are named after (so the corpus starts from real
    /// shapes, not noise).
    #[test]
    fn seed_shapes() {
        use crate::config::Backend;
        use crate::rows::owner_reply;
        let seed = |name: &str| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fuzz/corpus/sql_row")
                .join(name);
            let data = std::fs::read(&path).expect("seed");
            let (row, grace) = super::owner_row(&data);
            owner_reply(Backend::Postgres, row, grace)
        };
        let owner = seed("owner").expect("an owner").owner;
        assert_eq!((owner.owner_id.as_str(), owner.fence), ("c1", 7));
        let held = seed("held").expect("a hold").owner;
        assert_eq!(held.held_after_release_by(), Some("svc:host:4242"));
        let grace = seed("grace").expect("a placeholder");
        assert!(grace.owner.owner_id.is_empty());
        assert_eq!(grace.owner.transition_at, grace.now - 100 + 16_000);
        for free in ["past_lease", "grace_over", "nulls"] {
            assert_eq!(seed(free).expect(free).owner, simba_core::MutexOwner::NONE);
        }
        for refused in ["negative_version", "no_row"] {
            assert!(seed(refused).is_err(), "{refused}");
        }
    }
}
