//! The `simba_call` spans of the lease engine, captured: one span per store call, with the
//! fields simba-core's README promises (`op`, `backend`, `mutex`, `contender`, `fence`,
//! `outcome`) and the outcome each call really had.
//!
//! The capturing subscriber is the *thread-local* default (`tracing::subscriber::
//! set_default`) and the test runs on a current-thread runtime in paused time, so every
//! task it spawns reports to it and nothing of another test does.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::until;
use simba_core::fault::{Behavior, FaultStore, Op};
use simba_core::{
    ContendServiceFactory, LeaseConfig, LeaseServiceFactory, MemoryStore, SilentContender,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{Layer, registry};

/// One captured span: its name and every field recorded on it, as text.
#[derive(Debug, Clone, Default)]
struct Captured {
    name: String,
    fields: BTreeMap<String, String>,
}

impl Captured {
    fn get(&self, field: &str) -> Option<&str> {
        self.fields.get(field).map(String::as_str)
    }
}

impl Visit for Captured {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.fields
            .insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.fields
            .insert(field.name().to_owned(), value.to_owned());
    }
}

/// Spans in the order they were opened; `by_id` finds a span again for later records.
#[derive(Default)]
struct Spans {
    all: Vec<Captured>,
    by_id: BTreeMap<u64, usize>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Spans>>);

impl Capture {
    fn calls(&self) -> Vec<Captured> {
        let spans = self.0.lock().unwrap_or_else(|p| p.into_inner());
        spans
            .all
            .iter()
            .filter(|s| s.name == "simba_call")
            .cloned()
            .collect()
    }
}

impl<S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>> Layer<S>
    for Capture
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut span = Captured {
            name: attrs.metadata().name().to_owned(),
            ..Captured::default()
        };
        attrs.record(&mut span);
        let mut spans = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let index = spans.all.len();
        spans.all.push(span);
        spans.by_id.insert(id.into_u64(), index);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut spans = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&index) = spans.by_id.get(&id.into_u64()) {
            values.record(&mut spans.all[index]);
        }
    }
}

/// A acquires, renews, fails one renewal, renews again and stops; B, waiting, sees A own
/// and then acquires after A's release. Each call's span says what it was and how it ended.
#[tokio::test(start_paused = true)]
async fn every_store_call_has_a_span_with_its_outcome() {
    let capture = Capture::default();
    let _default = tracing::subscriber::set_default(registry().with(capture.clone()));

    let store = FaultStore::new(MemoryStore::new());
    let faults = store.control();
    let config = LeaseConfig {
        retry_interval: Duration::from_millis(100),
        ..LeaseConfig::with_lease(Duration::from_millis(1000), Duration::from_millis(500))
    };
    let factory = LeaseServiceFactory::new(store, config).expect("config");
    let a = factory
        .create_contend_service("spans-m", Arc::new(SilentContender))
        .expect("a");
    let b = factory
        .create_contend_service("spans-m", Arc::new(SilentContender))
        .expect("b");
    let (mut sa, mut sb) = (a.status(), b.status());
    a.start().expect("start a");
    until(&mut sa, "a owns", |s| s.held.is_some()).await;
    let fence_a = sa.borrow().held.map(|h| h.fence).expect("a's fence");
    b.start().expect("start b");
    until(&mut sb, "b's first answer", |s| s.attempts >= 1).await;

    let after = sa.borrow().attempts;
    until(&mut sa, "a renews", |s| s.attempts > after).await;
    faults.set(Op::Guard, Behavior::Fail);
    until(&mut sa, "a suspect", |s| s.held.is_some_and(|h| h.suspect)).await;
    faults.set(Op::Guard, Behavior::Pass);
    until(&mut sa, "a no longer suspect", |s| {
        s.held.is_some_and(|h| !h.suspect)
    })
    .await;
    a.stop().await.expect("stop a");
    until(&mut sb, "b owns", |s| s.held.is_some()).await;
    let fence_b = sb.borrow().held.map(|h| h.fence).expect("b's fence");
    b.stop().await.expect("stop b");

    let calls = capture.calls();
    let of = |id: &str| -> Vec<(String, String, Option<String>)> {
        calls
            .iter()
            .filter(|c| c.get("contender") == Some(id))
            .map(|c| {
                (
                    c.get("op").unwrap_or("").to_owned(),
                    c.get("outcome").unwrap_or("").to_owned(),
                    c.get("fence").map(str::to_owned),
                )
            })
            .collect()
    };
    for c in &calls {
        assert_eq!(c.get("backend"), Some("memory"), "{c:?}");
        assert_eq!(c.get("mutex"), Some("spans-m"), "{c:?}");
        assert!(
            c.get("outcome").is_some(),
            "a call without its outcome: {c:?}"
        );
    }
    let fa = Some(fence_a.to_string());
    let fb = Some(fence_b.to_string());

    // A: acquire (owner, with the fence it got), renewals, the failed one, more renewals,
    // then the release.
    let a_calls = of(a.contender_id());
    assert_eq!(
        a_calls.first(),
        Some(&("acquire".into(), "owner".into(), fa.clone())),
        "{a_calls:?}"
    );
    assert_eq!(
        a_calls.last(),
        Some(&("release".into(), "released".into(), fa.clone())),
        "{a_calls:?}"
    );
    let renewals: Vec<_> = a_calls[1..a_calls.len() - 1].to_vec();
    assert!(
        renewals
            .iter()
            .all(|(op, _, fence)| op == "guard" && *fence == fa),
        "{renewals:?}"
    );
    let failed = renewals
        .iter()
        .position(|(_, outcome, _)| outcome == "error")
        .unwrap_or_else(|| panic!("no failed renewal in {renewals:?}"));
    assert!(
        renewals[..failed].iter().any(|(_, o, _)| o == "owner")
            && renewals[failed + 1..].iter().any(|(_, o, _)| o == "owner"),
        "answered renewals before and after the failure: {renewals:?}"
    );

    // B: tries that found A owning (with A's fence), then its own acquisition and release.
    let b_calls = of(b.contender_id());
    assert_eq!(
        b_calls.first(),
        Some(&("acquire".into(), "other".into(), fa.clone())),
        "{b_calls:?}"
    );
    assert!(
        b_calls.contains(&("acquire".into(), "owner".into(), fb.clone())),
        "{b_calls:?}"
    );
    assert_eq!(
        b_calls.last(),
        Some(&("release".into(), "released".into(), fb)),
        "{b_calls:?}"
    );
    assert_eq!(
        a_calls.len() + b_calls.len(),
        calls.len(),
        "spans of no contender: {calls:?}"
    );
}
