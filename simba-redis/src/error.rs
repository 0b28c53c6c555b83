//! Mapping of fred errors and server replies into [`simba_core::Error`].

use fred::error::{Error as FredError, ErrorKind};
use fred::types::Value;
use simba_core::backend::{LeaseReply, PermitHolders};
use simba_core::{Error, MutexOwner, Result};

/// The backend name in errors and traces.
pub(crate) const BACKEND: &str = "redis";

/// A backend error for a failed `what`, keeping the fred error as the source.
pub(crate) fn backend(what: &str, e: FredError) -> Error {
    let details = e.details();
    let (retryable, hint) = match e.kind() {
        ErrorKind::Auth => (
            false,
            " (check the user name and password, in the URL or RedisConfig)",
        ),
        ErrorKind::Config | ErrorKind::Url | ErrorKind::InvalidArgument => (false, ""),
        _ if details.starts_with("NOPERM") => (
            false,
            " (the ACL user lacks a permission: it needs EVALSHA, SCRIPT LOAD, PUBLISH, \
             SUBSCRIBE, INFO (the scripts read the replication section) and WAIT, and access \
             to the key prefix)",
        ),
        _ if details.starts_with("WRONGPASS") || details.starts_with("NOAUTH") => (
            false,
            " (check the user name and password, in the URL or RedisConfig)",
        ),
        _ => (true, ""),
    };
    Error::backend_source(BACKEND, format!("{what}: {e}{hint}"), retryable, e)
}

/// A reply the store cannot make sense of.
pub(crate) fn bad_reply(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("unexpected reply to {what}: {detail}"),
        retryable: false,
        source: None,
    }
}

fn as_text(what: &str, v: &Value) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.to_string()),
        Value::Bytes(b) => String::from_utf8(b.to_vec())
            .map_err(|_| bad_reply(what, "an owner id that is not UTF-8")),
        Value::Null => Ok(String::new()),
        other => Err(bad_reply(
            what,
            format_args!("expected text, got {other:?}"),
        )),
    }
}

fn as_i64(what: &str, v: &Value) -> Result<i64> {
    match v {
        Value::Integer(i) => Ok(*i),
        Value::String(s) => s
            .trim()
            .parse()
            .map_err(|_| bad_reply(what, format_args!("expected a number, got {s:?}"))),
        Value::Bytes(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| bad_reply(what, "expected a number, got bytes")),
        Value::Double(d) if d.is_finite() && d.fract() == 0.0 && d.abs() < 9.0e15 =>
        {
            #[allow(clippy::cast_possible_truncation)]
            Ok(*d as i64)
        }
        other => Err(bad_reply(
            what,
            format_args!("expected a number, got {other:?}"),
        )),
    }
}

/// Parses `{owner id, acquired_at, ttl_at, transition_at, fence, now}`.
pub(crate) fn lease_reply(what: &str, v: Value) -> Result<LeaseReply> {
    let Value::Array(items) = v else {
        return Err(bad_reply(
            what,
            format_args!("expected an array, got {v:?}"),
        ));
    };
    let [id, acquired_at, ttl_at, transition_at, fence, now] = items.as_slice() else {
        return Err(bad_reply(
            what,
            format_args!("expected 6 values, got {}", items.len()),
        ));
    };
    let owner_id = as_text(what, id)?;
    let now = as_i64(what, now)?;
    if owner_id.is_empty() {
        // No owner. The times, when set, say when to look again: a free mutex that the
        // restart quarantine or a handoff reservation keeps from the caller until then.
        return Ok(LeaseReply {
            owner: MutexOwner {
                ttl_at: as_i64(what, ttl_at)?,
                transition_at: as_i64(what, transition_at)?,
                ..MutexOwner::NONE
            },
            now,
        });
    }
    let fence = as_i64(what, fence)?;
    let fence = u64::try_from(fence)
        .map_err(|_| bad_reply(what, format_args!("negative fence {fence}")))?;
    Ok(LeaseReply {
        owner: MutexOwner {
            owner_id,
            acquired_at: as_i64(what, acquired_at)?,
            ttl_at: as_i64(what, ttl_at)?,
            transition_at: as_i64(what, transition_at)?,
            fence,
        },
        now,
    })
}

/// Parses the release script's `{released (0/1), notified waiter}`.
/// The semaphore owners script's reply: `{count (-1: none), now, then per holder id,
/// acquired_at, ttl_at, transition_at, fence}`; holders in the order they acquired.
pub(crate) fn permit_holders(v: Value) -> Result<PermitHolders> {
    const WHAT: &str = "semaphore owners script";
    let Value::Array(items) = v else {
        return Err(bad_reply(
            WHAT,
            format_args!("expected an array, got {v:?}"),
        ));
    };
    let [count, now, rest @ ..] = items.as_slice() else {
        return Err(bad_reply(WHAT, "fewer than 2 values"));
    };
    if rest.len() % 5 != 0 {
        return Err(bad_reply(
            WHAT,
            format_args!("{} holder values, not a multiple of 5", rest.len()),
        ));
    }
    let count = as_i64(WHAT, count)?;
    let mut holders = Vec::with_capacity(rest.len() / 5);
    for h in rest.chunks_exact(5) {
        let fence = as_i64(WHAT, &h[4])?;
        holders.push(MutexOwner {
            owner_id: as_text(WHAT, &h[0])?,
            acquired_at: as_i64(WHAT, &h[1])?,
            ttl_at: as_i64(WHAT, &h[2])?,
            transition_at: as_i64(WHAT, &h[3])?,
            fence: u64::try_from(fence)
                .map_err(|_| bad_reply(WHAT, format_args!("negative fence {fence}")))?,
        });
    }
    holders.sort_by_key(|h| h.fence);
    Ok(PermitHolders {
        permits: u32::try_from(count).ok(),
        holders,
        now: as_i64(WHAT, now)?,
    })
}

pub(crate) fn release_reply(v: Value) -> Result<(bool, String)> {
    const WHAT: &str = "release script";
    let Value::Array(items) = v else {
        return Err(bad_reply(
            WHAT,
            format_args!("expected an array, got {v:?}"),
        ));
    };
    let [released, waiter] = items.as_slice() else {
        return Err(bad_reply(
            WHAT,
            format_args!("expected 2 values, got {}", items.len()),
        ));
    };
    Ok((as_i64(WHAT, released)? == 1, as_text(WHAT, waiter)?))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::String(x.into())
    }

    #[test]
    fn parses_lease_replies() {
        let r = lease_reply(
            "t",
            Value::Array(vec![
                s("c1"),
                Value::Integer(1),
                Value::Integer(2),
                Value::Integer(3),
                s("1795240434559808"),
                Value::Integer(4),
            ]),
        )
        .unwrap();
        assert_eq!(r.owner.owner_id, "c1");
        assert_eq!(r.owner.fence, 1_795_240_434_559_808);
        assert_eq!((r.owner.ttl_at, r.owner.transition_at, r.now), (2, 3, 4));

        let none = lease_reply(
            "t",
            Value::Array(vec![
                s(""),
                Value::Integer(0),
                Value::Integer(0),
                Value::Integer(0),
                Value::Integer(0),
                Value::Integer(9),
            ]),
        )
        .unwrap();
        assert_eq!(none.owner, MutexOwner::NONE);
        assert_eq!(none.now, 9);
    }

    #[test]
    fn rejects_garbage() {
        for v in [
            Value::Null,
            Value::Integer(1),
            Value::Array(vec![s("x")]),
            Value::Array(vec![s("c"), s("x"), s("1"), s("1"), s("1"), s("1")]),
            Value::Array(vec![
                s("c"),
                Value::Integer(1),
                Value::Integer(1),
                Value::Integer(1),
                Value::Integer(-5),
                Value::Integer(1),
            ]),
        ] {
            let e = lease_reply("t", v).unwrap_err();
            assert!(!e.is_retryable());
            assert!(e.to_string().contains("unexpected reply"), "{e}");
        }
        assert!(release_reply(Value::Integer(1)).is_err());
        assert_eq!(
            release_reply(Value::Array(vec![Value::Integer(1), s("w")])).unwrap(),
            (true, "w".to_owned())
        );
    }
}
