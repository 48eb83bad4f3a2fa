//! Threats to session memory, each a test (R25, R34).

use super::*;
use std::time::Duration;

fn limits() -> SessionLimits {
    SessionLimits {
        max_bytes: 8 * 1024,
        max_entries: 64,
        max_labels: 4,
        max_sessions: 50,
        max_sessions_per_identity: 10,
        ..SessionLimits::default()
    }
}

fn memory() -> SessionMemory {
    SessionMemory::in_memory(limits())
}

fn update_with_call(mem: &SessionMemory, id: &str, tool: &str) -> Update {
    Update {
        calls: vec![mem.call(id, tool, SessionMemory::server_of(tool, None), "{}")],
        ..Update::default()
    }
}

#[tokio::test]
async fn r34_another_identity_claiming_the_session_id_sees_nothing_and_taints_nothing() {
    let mem = memory();
    let alice = SessionKey::new("alice", "s-1");
    let mallory = SessionKey::new("mallory", "s-1");
    let mut update = update_with_call(&mem, "c1", "fs.read_file");
    update.labels = vec!["secret:fs".into()];
    mem.record(&alice, &update).await.unwrap();
    mem.result_seen(
        &alice,
        "c1",
        "fs.read_file",
        "fs",
        r#"{"content":[{"type":"text","text":"API_KEY=s3cr3tV4lue"}]}"#,
        &[],
    )
    .await
    .unwrap();
    let theirs = mem.read(&mallory).await.unwrap();
    assert!(theirs.labels().is_empty());
    assert_eq!(theirs.count("*", Duration::from_secs(3600)).unwrap(), 0);
    assert!(!theirs.seen_from(["s3cr3tV4lue"], "*").unwrap());
    // Mallory's own writes land in Mallory's memory only.
    let mut taint = update_with_call(&mem, "c9", "email.send");
    taint.labels = vec!["approved".into()];
    mem.record(&mallory, &taint).await.unwrap();
    let mine = mem.read(&alice).await.unwrap();
    assert_eq!(mine.labels(), ["secret:fs".to_owned()]);
    assert_eq!(mine.count("email.*", Duration::from_secs(3600)).unwrap(), 0);
    assert!(mine.seen_from(["INSERT 's3cr3tV4lue'"], "fs").unwrap());
}

#[tokio::test]
async fn r34_a_session_past_its_entries_drops_its_oldest_and_says_so() {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    let mut evicted = 0;
    for i in 0..200 {
        let applied = mem
            .record(&key, &update_with_call(&mem, &format!("c{i}"), "t.x"))
            .await
            .unwrap();
        assert!(applied.entries <= limits().max_entries, "{applied:?}");
        assert!(applied.bytes <= limits().max_bytes, "{applied:?}");
        evicted += applied.evicted;
    }
    assert_eq!(evicted, 200 - limits().max_entries);
    assert_eq!(
        mem.stats()
            .evicted_entries
            .load(std::sync::atomic::Ordering::Relaxed),
        evicted as u64
    );
    let view = mem.read(&key).await.unwrap();
    assert_eq!(
        view.evicted(),
        evicted as u64,
        "the session says it lost memory"
    );
    assert_eq!(view.calls_total(), 200);
}

#[tokio::test]
async fn r34_many_distinct_values_stay_within_bytes_and_entries_and_keep_labels() {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    let mut first = update_with_call(&mem, "c0", "fs.read");
    first.labels = vec!["secret:fs".into()];
    mem.record(&key, &first).await.unwrap();
    // A result flooding distinct values: bounded per result, then per session.
    let text: String = (0..5000).map(|i| format!("value{i:08} ")).collect();
    let result = serde_json::json!({"content": [{"type": "text", "text": text}]}).to_string();
    let applied = mem
        .result_seen(&key, "c0", "fs.read", "fs", &result, &[])
        .await
        .unwrap();
    assert!(applied.seen <= limits().max_values_per_result);
    assert!(applied.entries <= limits().max_entries);
    assert!(applied.bytes <= limits().max_bytes);
    let view = mem.read(&key).await.unwrap();
    assert_eq!(
        view.labels(),
        ["secret:fs".to_owned()],
        "a flood of values does not wash a label away"
    );
}

#[tokio::test]
async fn r34_huge_and_malformed_labels_are_refused_and_labels_are_bounded() {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    let update = Update {
        labels: vec![
            "x".repeat(10_000),
            "bad label".into(),
            String::new(),
            "l1".into(),
            "l2".into(),
            "l3".into(),
            "l4".into(),
            "l5".into(),
        ],
        ..Update::default()
    };
    let applied = mem.record(&key, &update).await.unwrap();
    assert_eq!(applied.refused_labels, 3);
    assert_eq!(applied.evicted, 1, "the oldest label went first");
    let view = mem.read(&key).await.unwrap();
    assert_eq!(view.labels(), ["l2", "l3", "l4", "l5"].map(String::from));
}

#[tokio::test]
async fn r25_many_sessions_are_bounded_per_identity_and_mesh_wide() {
    let store = Arc::new(LocalStore::new(limits()));
    let mem = SessionMemory::new(store.clone(), Digester::random(), limits());
    for i in 0..100 {
        let key = SessionKey::new("flood", format!("s{i}"));
        mem.record(&key, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
    }
    let (sessions, _) = store.held().unwrap();
    assert_eq!(sessions, limits().max_sessions_per_identity);
    // Another identity keeps its sessions while the first floods.
    let kept = SessionKey::new("bob", "mine");
    mem.record(&kept, &update_with_call(&mem, "c", "t.x"))
        .await
        .unwrap();
    for i in 0..100 {
        let key = SessionKey::new("flood", format!("t{i}"));
        mem.record(&key, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
    }
    assert_eq!(mem.read(&kept).await.unwrap().calls_total(), 1);
    for i in 0..100 {
        let key = SessionKey::new(format!("id{i}"), "s");
        mem.record(&key, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
    }
    let (sessions, bytes) = store.held().unwrap();
    assert_eq!(sessions, limits().max_sessions);
    assert!(bytes <= limits().max_sessions * limits().max_bytes);
    assert!(store.evicted_sessions() >= 150);
}

/// R34 "forgetting is never innocence": a session dropped to make room
/// for others (per identity or mesh-wide) comes back as a session that
/// lost memory, never as a new one, whether it is read or written first;
/// a session that never was reads as new; the least recently updated
/// session is the one that goes.
#[tokio::test]
async fn r34_a_session_dropped_for_room_reads_as_lost_never_as_new() {
    let store = Arc::new(LocalStore::new(limits()));
    let mem = SessionMemory::new(store.clone(), Digester::random(), limits());
    let victim = SessionKey::new("agent", "victim");
    let kept = SessionKey::new("agent", "kept");
    let mut secret = update_with_call(&mem, "r1", "fs.read_file");
    secret.labels.push("secret:fs".to_owned());
    mem.record(&victim, &secret).await.unwrap();
    mem.record(&kept, &update_with_call(&mem, "c", "t.x"))
        .await
        .unwrap();
    for i in 0..limits().max_sessions_per_identity {
        let key = SessionKey::new("agent", format!("other-{i}"));
        mem.record(&key, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
        // `kept` stays the most recently updated but one.
        mem.record(&kept, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
    }
    assert!(store.evicted_sessions() > 0);
    assert_eq!(
        mem.read(&kept).await.unwrap().calls_total(),
        1 + limits().max_sessions_per_identity as u64,
        "the session updated last was not the one dropped"
    );
    // Read first: lost, not new.
    let view = mem.read(&victim).await.unwrap();
    assert!(
        view.labels().is_empty(),
        "the session updated least recently was not the one dropped"
    );
    assert!(
        view.evicted() > 0,
        "a session dropped for room reads as a new session"
    );
    assert!(view.dropped(), "{view:?}");
    assert!(view.for_guard().dropped && view.for_guard().evicted);
    // Written first (then read): lost too.
    mem.record(&victim, &update_with_call(&mem, "c2", "t.x"))
        .await
        .unwrap();
    let view = mem.read(&victim).await.unwrap();
    assert_eq!(view.calls_total(), 1);
    assert!(
        view.evicted() > 0,
        "a dropped session written again reads as new"
    );
    assert!(view.dropped());
    // Dropped mesh-wide by other identities: lost too.
    let lonely = SessionKey::new("alone", "s");
    mem.record(&lonely, &update_with_call(&mem, "c", "t.x"))
        .await
        .unwrap();
    for i in 0..limits().max_sessions {
        let key = SessionKey::new(format!("id{i}"), "s");
        mem.record(&key, &update_with_call(&mem, "c", "t.x"))
            .await
            .unwrap();
    }
    assert!(mem.read(&lonely).await.unwrap().dropped());
    // A session that never was is new.
    let fresh = mem.read(&SessionKey::new("agent", "fresh")).await.unwrap();
    assert_eq!((fresh.evicted(), fresh.dropped()), (0, false));
    // What is remembered of the dropped sessions is within its own bound,
    // counted with the sessions' bytes.
    let (sessions, bytes) = store.held().unwrap();
    assert_eq!(sessions, limits().max_sessions);
    assert!(
        bytes <= limits().max_sessions * limits().max_bytes,
        "{bytes}"
    );
}

#[tokio::test]
async fn r34_a_result_for_a_call_never_made_is_refused() {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    mem.record(&key, &update_with_call(&mem, "c1", "fs.read"))
        .await
        .unwrap();
    let result = r#"{"content":[]}"#;
    let never = mem
        .result_seen(&key, "c2", "fs.read", "fs", result, &[])
        .await;
    assert!(
        matches!(never, Err(ResultError::NoSuchCall { .. })),
        "{never:?}"
    );
    let other_session = mem
        .result_seen(
            &SessionKey::new("a", "t"),
            "c1",
            "fs.read",
            "fs",
            result,
            &[],
        )
        .await;
    assert!(matches!(other_session, Err(ResultError::NoSuchCall { .. })));
    mem.result_seen(&key, "c1", "fs.read", "fs", result, &[])
        .await
        .unwrap();
}

/// R34: a result belongs to the server of the call it answers, as the
/// session recorded it: its values are remembered from that server whether
/// the result named it in another ASCII case or named none; a result
/// naming another server is refused and teaches nothing; a call recorded
/// without a server takes the one its result names.
#[tokio::test]
async fn r34_a_result_belongs_to_the_server_its_call_was_recorded_with() {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    let mut calls = Update::default();
    for (id, tool) in [
        ("c1", "fs.read_file"),
        ("c2", "fs.read_file"),
        ("c3", "fs.read_file"),
        ("c4", "read_file"),
    ] {
        calls
            .calls
            .push(mem.call(id, tool, SessionMemory::server_of(tool, None), "{}"));
    }
    mem.record(&key, &calls).await.unwrap();
    let text = |v: &str| format!(r#"{{"content":[{{"type":"text","text":"{v}"}}]}}"#);
    mem.result_seen(
        &key,
        "c1",
        "fs.read_file",
        "",
        &text("unknown-server-value"),
        &[],
    )
    .await
    .unwrap();
    mem.result_seen(
        &key,
        "c2",
        "fs.read_file",
        "FS",
        &text("upper-case-server-value"),
        &[],
    )
    .await
    .unwrap();
    let other = mem
        .result_seen(
            &key,
            "c3",
            "fs.read_file",
            "sqlite",
            &text("another-server-value"),
            &[],
        )
        .await;
    assert!(
        matches!(&other, Err(ResultError::OtherServer(Mismatch { sent, recorded, .. }))
            if sent == "sqlite" && recorded == "fs"),
        "{other:?}"
    );
    mem.result_seen(
        &key,
        "c4",
        "read_file",
        "notes",
        &text("named-by-the-result"),
        &[],
    )
    .await
    .unwrap();
    let view = mem.read(&key).await.unwrap();
    assert!(view.seen_from(["unknown-server-value"], "fs").unwrap());
    assert!(view.seen_from(["upper-case-server-value"], "fs").unwrap());
    assert!(!view.seen_from(["another-server-value"], "*").unwrap());
    assert!(view.seen_from(["named-by-the-result"], "notes").unwrap());
    assert_eq!(
        view.call_answered("c3", "fs.read_file", "").unwrap(),
        "fs",
        "the latest call of that id"
    );
    assert!(matches!(
        view.call_answered("c9", "fs.read_file", "fs"),
        Err(ResultError::NoSuchCall { .. })
    ));
}

#[tokio::test]
async fn r34_entries_past_their_age_are_not_read_and_are_dropped() {
    let limits = SessionLimits {
        max_age: Duration::from_millis(1),
        ..limits()
    };
    let mem = SessionMemory::in_memory(limits);
    let key = SessionKey::new("a", "s");
    mem.record(&key, &update_with_call(&mem, "c1", "email.send"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        mem.read(&key)
            .await
            .unwrap()
            .count("*", Duration::from_secs(60))
            .unwrap(),
        0
    );
    let applied = mem.record(&key, &Update::default()).await.unwrap();
    assert_eq!(applied.evicted, 1);
    assert_eq!(applied.entries, 0);
}

/// A store that cannot be reached.
#[derive(Debug)]
struct Down;

#[tonic::async_trait]
impl SessionStore for Down {
    async fn load(&self, _: &SessionKey) -> Result<Option<Memory>, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn update(&self, _: &SessionKey, _: Write<'_>) -> Result<Applied, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    fn kind(&self) -> &'static str {
        "down"
    }
}

/// A store that never answers.
#[derive(Debug)]
struct Hung;

#[tonic::async_trait]
impl SessionStore for Hung {
    async fn load(&self, _: &SessionKey) -> Result<Option<Memory>, StoreError> {
        std::future::pending().await
    }
    async fn update(&self, _: &SessionKey, _: Write<'_>) -> Result<Applied, StoreError> {
        std::future::pending().await
    }
    fn kind(&self) -> &'static str {
        "hung"
    }
}

#[tokio::test]
async fn r34_a_store_down_or_slow_is_an_error_never_an_empty_session() {
    let down = SessionMemory::new(Arc::new(Down), Digester::random(), limits());
    let key = SessionKey::new("a", "s");
    assert!(matches!(
        down.read(&key).await,
        Err(StoreError::Unavailable(_))
    ));
    let hung = SessionMemory::new(Arc::new(Hung), Digester::random(), limits())
        .with_timeout(Duration::from_millis(50));
    assert!(matches!(
        hung.read(&key).await,
        Err(StoreError::TimedOut(_))
    ));
    assert!(matches!(
        hung.record(&key, &Update::default()).await,
        Err(StoreError::TimedOut(_))
    ));
    assert_eq!(
        hung.stats()
            .failures
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[test]
fn r34_windows_parse_and_servers_come_from_metadata_or_the_tool() {
    assert_eq!(view::parse_window("1h"), Some(Duration::from_secs(3600)));
    assert_eq!(view::parse_window("90s"), Some(Duration::from_secs(90)));
    assert_eq!(view::parse_window("15m"), Some(Duration::from_secs(900)));
    assert_eq!(view::parse_window("2d"), Some(Duration::from_secs(172_800)));
    assert_eq!(view::parse_window("1 hour"), None);
    assert_eq!(view::parse_window("h"), None);
    assert_eq!(view::parse_window("99999999999999999999d"), None);
    assert_eq!(SessionMemory::server_of("fs.read_file", None), "fs");
    assert_eq!(
        SessionMemory::server_of("fs.read_file", Some("files")),
        "files"
    );
    assert_eq!(SessionMemory::server_of("read", None), "");
}

/// A store that counts the operations asked of it.
#[derive(Debug)]
struct Counting {
    inner: LocalStore,
    loads: std::sync::atomic::AtomicUsize,
    updates: std::sync::atomic::AtomicUsize,
}

#[tonic::async_trait]
impl SessionStore for Counting {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        self.inner.load(key).await
    }

    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        self.updates.fetch_add(1, Ordering::Relaxed);
        self.inner.update(key, write).await
    }

    fn kind(&self) -> &'static str {
        "counting"
    }
}

#[tokio::test]
async fn r33_r34_a_request_of_results_costs_one_load_and_one_update_of_its_session() {
    let store = Arc::new(Counting {
        inner: LocalStore::new(limits()),
        loads: Default::default(),
        updates: Default::default(),
    });
    let mem = SessionMemory::new(store.clone(), Digester::random(), limits());
    let key = SessionKey::new("alice", "s-1");
    let mut calls = Update::default();
    for id in ["c1", "c2", "c3"] {
        calls.calls.push(mem.call(id, "fs.read", "fs", "{}"));
    }
    mem.record(&key, &calls).await.unwrap();
    let (loads, updates) = (
        store.loads.load(Ordering::Relaxed),
        store.updates.load(Ordering::Relaxed),
    );
    let text = |v: &str| format!(r#"{{"content":[{{"type":"text","text":"{v}"}}]}}"#);
    let (r1, r2, r3, forged) = (
        text("TOKEN=first-secret-value"),
        text("TOKEN=second-secret-value"),
        // The same value as the first: kept once.
        text("TOKEN=first-secret-value"),
        text("TOKEN=forged-result-value"),
    );
    let label = ["secret:fs".to_owned()];
    let results = [
        ResultSeen {
            call_id: "c1",
            tool: "fs.read",
            server: "fs",
            result_json: &r1,
            labels: &label,
        },
        ResultSeen {
            call_id: "c2",
            tool: "fs.read",
            server: "fs",
            result_json: &r2,
            labels: &[],
        },
        // A result for a call that never ran in this session.
        ResultSeen {
            call_id: "c9",
            tool: "fs.read",
            server: "fs",
            result_json: &forged,
            labels: &[],
        },
        ResultSeen {
            call_id: "c3",
            tool: "fs.read",
            server: "fs",
            result_json: &r3,
            labels: &label,
        },
    ];
    let seen = mem.results_seen(&key, &results).await.unwrap();
    assert_eq!(store.loads.load(Ordering::Relaxed) - loads, 1, "loads");
    assert_eq!(
        store.updates.load(Ordering::Relaxed) - updates,
        1,
        "updates"
    );
    assert!(seen.outcomes[0].is_ok() && seen.outcomes[1].is_ok() && seen.outcomes[3].is_ok());
    assert!(
        matches!(&seen.outcomes[2], Err(ResultError::NoSuchCall { call_id, .. }) if call_id == "c9"),
        "{:?}",
        seen.outcomes[2]
    );
    let applied = seen.applied.unwrap();
    assert_eq!(applied.labels, ["secret:fs".to_owned()]);
    let view = mem.read(&key).await.unwrap();
    assert_eq!(view.labels(), ["secret:fs".to_owned()]);
    assert!(view.seen_from(["first-secret-value"], "fs").unwrap());
    assert!(view.seen_from(["second-secret-value"], "fs").unwrap());
    assert!(!view.seen_from(["forged-result-value"], "*").unwrap());
    assert_eq!(view.for_guard().results_total, 3);
    // The values of results 1 and 3 are one value, kept once.
    let after = store.inner.load(&key).await.unwrap().unwrap();
    let digests: std::collections::HashSet<_> = after.seen.iter().map(|s| &s.digest).collect();
    assert_eq!(digests.len(), after.seen.len());

    // Only forged results: the session is loaded, never written.
    let (loads, updates) = (
        store.loads.load(Ordering::Relaxed),
        store.updates.load(Ordering::Relaxed),
    );
    let seen = mem.results_seen(&key, &results[2..3]).await.unwrap();
    assert!(seen.applied.is_none());
    assert_eq!(store.loads.load(Ordering::Relaxed) - loads, 1);
    assert_eq!(store.updates.load(Ordering::Relaxed) - updates, 0);
}

/// Applies `update` to `key`'s memory in `store` at `now`.
async fn write(store: &LocalStore, key: &SessionKey, update: &Update, now: u64) {
    let write = Write {
        update,
        limits: &limits(),
        now,
    };
    store.update(key, write).await.unwrap();
}

#[tokio::test]
async fn r34_a_read_shares_the_memory_and_a_later_write_never_changes_what_it_read() {
    let store = LocalStore::new(limits());
    let mem = SessionMemory::in_memory(limits());
    let key = SessionKey::new("alice", "s-1");
    let now = now_ms();
    let call = update_with_call(&mem, "c1", "fs.read");
    write(&store, &key, &call, now).await;
    // Two reads hand out one memory, not two copies.
    let a = store.snapshot(&key).await.unwrap().unwrap();
    let b = store.snapshot(&key).await.unwrap().unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    drop(b);
    // A write while a batch still reads: the batch keeps what it read, the
    // next read sees the write.
    let mut taint = update_with_call(&mem, "c2", "email.send");
    taint.labels = vec!["secret:fs".into()];
    write(&store, &key, &taint, now).await;
    assert_eq!(a.calls.len(), 1);
    assert!(a.labels.is_empty());
    let c = store.snapshot(&key).await.unwrap().unwrap();
    assert_eq!(c.calls.len(), 2);
    assert_eq!(c.labels.len(), 1);
    // With no reader left, a write updates the memory in place.
    drop(a);
    let before = Arc::as_ptr(&c);
    drop(c);
    let call = update_with_call(&mem, "c3", "fs.read");
    write(&store, &key, &call, now).await;
    let d = store.snapshot(&key).await.unwrap().unwrap();
    assert_eq!(Arc::as_ptr(&d), before);
    assert_eq!(d.calls.len(), 3);
    assert_eq!(store.held().map(|(sessions, _)| sessions), Some(1));
}

/// Log lines written while it runs (a thread's own subscriber, `info` and
/// above).
#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn containing(&self, text: &str) -> usize {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|l| l.contains(text))
            .count()
    }
}

#[tokio::test]
async fn r34_a_session_at_its_bounds_is_logged_once_not_at_every_batch() {
    const PROBE: &str = "log capture probe";
    // tracing's level and call-site caches are global, and other tests'
    // threads make and drop subscribers while this one runs: a rebuild of
    // those caches that missed this thread's subscriber can hide its
    // lines for a while. An attempt counts only if a probe line logged
    // before and after it was captured both times; an attempt whose
    // capture was blind is made again, at most three times.
    for _attempt in 0..3 {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        // (A test runs on one thread: the subscriber sees every line of it.)
        let _logging = tracing::subscriber::set_default(subscriber);
        tracing::callsite::rebuild_interest_cache();
        tracing::info!("{PROBE}");
        let mem = memory();
        let (a, b) = (SessionKey::new("a", "s-1"), SessionKey::new("a", "s-2"));
        for i in 0..500 {
            for key in [&a, &b] {
                mem.record(key, &update_with_call(&mem, &format!("c{i}"), "t.x"))
                    .await
                    .unwrap();
            }
        }
        tracing::info!("{PROBE}");
        let evicted = mem
            .stats()
            .evicted_entries
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            evicted,
            2 * (500 - limits().max_entries as u64),
            "all counted"
        );
        let view = mem.read(&a).await.unwrap();
        assert_eq!(view.evicted(), 500 - limits().max_entries as u64);
        if lines.containing(PROBE) < 2 {
            continue;
        }
        assert_eq!(
            lines.containing("the oldest entries were dropped"),
            2,
            "one line per session that reached its bounds, not one per batch"
        );
        return;
    }
    panic!("three attempts, and the log capture missed its own probe lines in each");
}

/// A view of a memory that `calls` (tool, server) and `labels` were
/// applied to at `now`, one update each.
fn view_of(calls: &[(String, String)], labels: &[String], now: u64) -> SessionView {
    let limits = SessionLimits {
        max_bytes: usize::MAX,
        max_entries: usize::MAX,
        max_labels: usize::MAX,
        max_label_bytes: usize::MAX,
        ..SessionLimits::default()
    };
    let mut memory = Memory::default();
    for (i, (tool, server)) in calls.iter().enumerate() {
        let call = CallRan {
            id: format!("c{i}"),
            tool: tool.clone(),
            server: server.clone(),
            args: digest::to_hex(&[i as u8; 16]),
            at: 0,
            seq: 0,
        };
        let update = Update {
            calls: vec![call],
            results: u64::from(i % 3 == 0),
            ..Update::default()
        };
        memory.apply(&update, &limits, now);
    }
    for label in labels {
        let update = Update {
            labels: vec![label.clone()],
            ..Update::default()
        };
        memory.apply(&update, &limits, now);
    }
    memory.evicted = u64::from(calls.len() % 2 == 1);
    memory.dropped = calls.len() % 3 == 1;
    SessionView::new(
        Arc::new(memory),
        Digester::random(),
        now,
        Duration::from_secs(3600),
    )
}

#[test]
fn r34_the_memory_a_guard_is_sent_is_encoded_as_the_message_it_stands_for() {
    use guardmesh_proto::v1::GuardBatch;
    use prost::Message;
    let named = |n: usize, width: usize, what: &str| format!("{what}{n:0width$}");
    let calls = |n: usize, tools: usize, width: usize| -> Vec<(String, String)> {
        (0..n)
            .map(|i| (named(i % tools, width, "t."), named(i % 5, 3, "srv")))
            .collect()
    };
    let labels = |n: usize, width: usize| -> Vec<String> {
        (0..n).map(|i| named(i, width, "label:")).collect()
    };
    let cases: Vec<(&str, SessionView)> = vec![
        ("empty", SessionView::empty(Digester::random(), 1_000)),
        ("one tool", view_of(&calls(5, 1, 3), &labels(2, 3), 1_000)),
        (
            "at zero, empty names",
            view_of(&[(String::new(), String::new())], &[], 0),
        ),
        (
            "many tools, calls and labels",
            view_of(&calls(300, 100, 3), &labels(100, 3), 1_000),
        ),
        (
            "calls cut by bytes",
            view_of(&calls(64, 3, 400), &labels(3, 3), 1_000),
        ),
        (
            "labels cut by bytes",
            view_of(&calls(64, 64, 180), &labels(64, 120), 1_000),
        ),
        (
            "counts dropped",
            view_of(&calls(64, 64, 400), &labels(64, 120), 1_000),
        ),
    ];
    for (case, view) in cases {
        let message = view.for_guard();
        let (recent, labels, counts) = (
            message.recent.len(),
            message.labels.len(),
            message.counts.len(),
        );
        let cut = match case {
            "many tools, calls and labels" => recent == 64 && labels == 64 && counts == 64,
            "calls cut by bytes" => recent > 0 && recent < 64 && labels == 3,
            "labels cut by bytes" => recent == 0 && labels > 0 && labels < 64 && counts == 64,
            "counts dropped" => recent == 0 && labels == 0 && counts == 0,
            _ => !message.truncated,
        };
        assert!(
            cut,
            "{case}: {recent} calls, {labels} labels, {counts} counts"
        );
        assert_eq!(
            message.truncated,
            case.contains("cut") || case.contains("many") || case.contains("dropped"),
            "{case}"
        );
        let session = crate::wire::fields::guard_batch::SESSION;
        let mut bytes = Vec::new();
        view.encode_for_guard(session, &mut bytes);
        assert_eq!(
            bytes.len(),
            prost::encoding::message::encoded_len(session, &message),
            "{case}"
        );
        let batch = GuardBatch::decode(bytes.as_slice()).unwrap();
        assert_eq!(batch.session.as_ref(), Some(&message), "{case}");
        if message.counts.len() <= 1 {
            // (Where the counts' order cannot differ, byte for byte.)
            let mut expected = Vec::new();
            prost::encoding::message::encode(session, &message, &mut expected);
            assert_eq!(bytes, expected, "{case}");
        }
        assert!(bytes.len() <= view::GUARD_MAX_BYTES + 8, "{case}");
    }
}

// ---------------------------------------------------------------------------
// `seen_from` follows simple encodings (R34)
// ---------------------------------------------------------------------------

/// A value without separators whose standard base64 has `+`, `/` and
/// padding (and so differs from its URL-safe form).
const B64_TRICKY: &str = "S3cr3twH~lb99ÿ$A";

/// The view of a session that read `values` from `fs` (the call ran, its
/// result went through the results phase's hook).
async fn read_from_fs(values: &[&str]) -> Arc<SessionView> {
    let mem = memory();
    let key = SessionKey::new("a", "s");
    mem.record(&key, &update_with_call(&mem, "c1", "fs.read_file"))
        .await
        .unwrap();
    let text: String = values.iter().map(|v| format!("API_KEY={v}\n")).collect();
    let result = serde_json::json!({"content": [{"type": "text", "text": text}]}).to_string();
    mem.result_seen(&key, "c1", "fs.read_file", "fs", &result, &[])
        .await
        .unwrap();
    mem.read(&key).await.unwrap()
}

fn found(view: &SessionView, sent: &str) -> bool {
    view.seen_from([sent], "fs").unwrap()
}

fn hex_of(text: &str, upper: bool) -> String {
    text.bytes()
        .map(|b| {
            if upper {
                format!("{b:02X}")
            } else {
                format!("{b:02x}")
            }
        })
        .collect()
}

#[tokio::test]
async fn r34_seen_from_follows_a_value_sent_as_a_url_path_segment() {
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue"]).await;
    for sent in [
        "https://evil.example/collect/hunter2-Sup3rS3cretValue",
        "https://evil.example/c/hunter2-Sup3rS3cretValue/x.png?size=1",
        "/upload/hunter2-Sup3rS3cretValue",
        "https://evil.example/c/hunter2%2DSup3rS3cretValue",
        "GET /v1/hunter2%2dSup3rS3cretValue HTTP/1.1",
    ] {
        assert!(found(&view, sent), "{sent}");
    }
}

#[tokio::test]
async fn r34_seen_from_follows_a_value_in_another_ascii_case() {
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue", "ANOTHER-SECRET-VALUE"]).await;
    for sent in [
        "HUNTER2-SUP3RS3CRETVALUE",
        "hunter2-sup3rs3cretvalue",
        "INSERT INTO t VALUES ('Hunter2-sup3RS3CRETvalue')",
        "another-secret-value",
        "https://evil.example/c/HUNTER2-sup3rs3cretvalue",
    ] {
        assert!(found(&view, sent), "{sent}");
    }
}

#[tokio::test]
async fn r34_seen_from_follows_a_value_base64_encoded_as_a_whole() {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue", B64_TRICKY]).await;
    let tricky = STANDARD.encode(B64_TRICKY);
    assert!(
        tricky.contains('+') && tricky.contains('/') && tricky.ends_with('='),
        "{tricky}"
    );
    for value in ["hunter2-Sup3rS3cretValue", B64_TRICKY] {
        for engine in [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD] {
            let encoded = engine.encode(value);
            // In a URL path, a `/` of the standard alphabet is escaped.
            let escaped = encoded.replace('/', "%2F").replace('+', "%2B");
            for sent in [
                encoded.clone(),
                format!(r#"{{"data":"{encoded}"}}"#),
                format!("Authorization: Basic {encoded}"),
                format!("https://evil.example/c/{escaped}"),
                format!("https://evil.example/c?d={encoded}&x=1"),
            ] {
                assert!(found(&view, &sent), "{value}: {sent}");
            }
        }
    }
    // A whole line of the result, encoded: its tokens are followed.
    let line = STANDARD.encode("API_KEY=hunter2-Sup3rS3cretValue\n");
    assert!(found(&view, &line), "{line}");
}

#[tokio::test]
async fn r34_seen_from_follows_a_value_hex_encoded_as_a_whole() {
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue", B64_TRICKY]).await;
    for value in ["hunter2-Sup3rS3cretValue", B64_TRICKY] {
        for upper in [false, true] {
            let encoded = hex_of(value, upper);
            for sent in [
                encoded.clone(),
                format!("0x{encoded}"),
                format!("https://evil.example/c/{encoded}"),
                format!("INSERT INTO t VALUES (X'{encoded}')"),
            ] {
                assert!(found(&view, &sent), "{value}: {sent}");
            }
        }
    }
}

#[tokio::test]
async fn r34_seen_from_does_not_find_a_value_not_seen_in_any_encoding() {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue"]).await;
    let other = "correct-horse-battery-staple";
    for sent in [
        other.to_owned(),
        other.to_ascii_uppercase(),
        format!("https://evil.example/c/{other}"),
        STANDARD.encode(other),
        URL_SAFE_NO_PAD.encode(other),
        hex_of(other, false),
        // The value seen, cut or split: not the value.
        "hunter2-Sup3rS3cret".to_owned(),
        "hunter2- Sup3rS3cretValue".to_owned(),
        // Base64 of the value seen, cut in two.
        STANDARD.encode("hunter2-Sup3rS3cretValue")[..16].to_owned(),
    ] {
        assert!(!found(&view, &sent), "{sent}");
    }
    assert!(found(&view, "hunter2-Sup3rS3cretValue"), "the value itself");
}

/// R34: a memory written by an earlier version holds digests of values as
/// they were read, not in lower case: they are still found when sent as
/// read (not in another case) until they age out; values kept since are
/// found in any case.
#[tokio::test]
async fn r34_values_an_earlier_version_kept_as_read_are_still_found_as_sent() {
    let digester = Digester::random();
    let mem = SessionMemory::new(
        Arc::new(LocalStore::new(limits())),
        digester.clone(),
        limits(),
    );
    let key = SessionKey::new("a", "s");
    let earlier = Update {
        seen: vec![Seen {
            server: "fs".into(),
            digest: digest::to_hex(&digester.digest("Kept-As-Read-Value")),
            at: 0,
            seq: 0,
            folded: false,
        }],
        ..Update::default()
    };
    mem.record(&key, &earlier).await.unwrap();
    let view = mem.read(&key).await.unwrap();
    assert!(found(&view, "INSERT 'Kept-As-Read-Value'"));
    assert!(!found(&view, "kept-as-read-value"), "its case is unknown");
    let stored = serde_json::to_string(&mem.store().load(&key).await.unwrap()).unwrap();
    assert!(!stored.contains("\"f\""), "{stored}");
    let view = read_from_fs(&["Kept-Since-Value"]).await;
    assert!(found(&view, "KEPT-SINCE-VALUE"));
}

/// What following the encodings costs a `seen_from` question, printed
/// once (no bound asserted: run with `--ignored --nocapture`): the same
/// arguments looked up as before (each piece digested once, as read) and
/// with every form, in one run so that the two compare.
#[tokio::test]
#[ignore = "a measurement: run it with --ignored --nocapture"]
async fn r34_seen_from_cost_of_following_encodings_printed() {
    use base64::Engine as _;
    let view = read_from_fs(&["hunter2-Sup3rS3cretValue"]).await;
    let digester = Digester::random();
    let words = |n: usize| -> String {
        (0..n)
            .map(|i| format!("Field{i:05} = 'Value{i:07}', "))
            .collect()
    };
    let prose = words(128);
    let urls: String = (0..64)
        .map(|i| format!("https://cdn.example/assets/v{i:03}/Image{i:06}.png "))
        .collect();
    let blob = base64::engine::general_purpose::STANDARD.encode(words(96));
    let worst = words(5400);
    let cases = [
        ("4 KiB of SQL-like text", prose),
        ("4 KiB of URLs", urls),
        ("4 KiB of base64 of text", blob),
        ("the bound (about 16k forms)", worst),
    ];
    for (what, text) in cases {
        let rounds = 20;
        let started = std::time::Instant::now();
        let mut pieces = 0;
        for _ in 0..rounds {
            for piece in digest::pieces(&text) {
                std::hint::black_box(digester.digest(piece));
                pieces += 1;
            }
        }
        let before = started.elapsed() / rounds;
        let started = std::time::Instant::now();
        let mut answer = Ok(false);
        for _ in 0..rounds {
            answer = view
                .seen_from([text.as_str()], "fs")
                .map_err(|e| e.to_string());
        }
        let now = started.elapsed() / rounds;
        eprintln!(
            "seen_from over {what} ({} bytes, {} pieces): {before:?} digesting the pieces as \
             read, {now:?} with every form ({:.1}x); answer {answer:?}",
            text.len(),
            pieces / rounds as usize,
            now.as_secs_f64() / before.as_secs_f64().max(1e-9),
        );
    }
}

/// R34: a store shared by replicas applies a batch's update only if the
/// memory is still as the batch read it: every update applied counts, and
/// an update judged on an older memory (or on none, the session since
/// begun elsewhere) is `Changed`; one that says nothing of its read is
/// applied whatever came before.
#[test]
fn r34_an_update_judged_on_an_older_memory_is_found_changed() {
    use super::store::still_as_read;
    let limits = SessionLimits::default();
    let mut memory = Memory::default();
    let read = |at| Update {
        labels: vec!["l".to_owned()],
        read_at: Some(at),
        ..Update::default()
    };
    assert!(still_as_read(None, &read(0)).is_ok());
    assert!(matches!(
        still_as_read(Some(&memory), &read(1)),
        Err(StoreError::Changed)
    ));
    memory.apply(&read(0), &limits, 1);
    memory.apply(&read(1), &limits, 2);
    assert_eq!(memory.writes, 2);
    assert!(still_as_read(Some(&memory), &read(2)).is_ok());
    assert!(matches!(
        still_as_read(Some(&memory), &read(1)),
        Err(StoreError::Changed)
    ));
    assert!(matches!(
        still_as_read(None, &read(2)),
        Err(StoreError::Changed)
    ));
    assert!(still_as_read(Some(&memory), &Update::default()).is_ok());
}

/// R34: a count over a window whose calls the memory dropped for a bound,
/// or over any window of a session found lost, is refused as incomplete,
/// never too low; a window that begins after the newest call dropped is
/// counted.
#[test]
fn r34_a_count_over_calls_the_memory_dropped_is_refused_as_incomplete() {
    use super::view::CountError;
    let limits = SessionLimits {
        max_entries: 4,
        ..SessionLimits::default()
    };
    let calls = |tool: &str, n: usize| Update {
        calls: (0..n)
            .map(|i| CallRan {
                id: format!("c{i}"),
                tool: tool.to_owned(),
                server: String::new(),
                args: String::new(),
                at: 0,
                seq: 0,
            })
            .collect(),
        ..Update::default()
    };
    let t0 = 10_000_000;
    let mut memory = Memory::default();
    memory.apply(&calls("email.send", 3), &limits, t0);
    memory.apply(&calls("fs.read", 4), &limits, t0 + 1_000);
    assert_eq!(memory.calls_lost_at, t0);
    let view = |memory: &Memory, now| {
        SessionView::new(
            Arc::new(memory.clone()),
            Digester::random(),
            now,
            Duration::from_secs(24 * 3600),
        )
    };
    let later = view(&memory, t0 + 5_000);
    assert!(matches!(
        later.count("email.send", Duration::from_secs(3600)),
        Err(CountError::Forgotten)
    ));
    // A window that begins after the last call dropped is complete.
    assert_eq!(
        later.count("fs.*", Duration::from_millis(4_500)).unwrap(),
        4
    );
    // A session found lost: every window, until it is written again.
    let lost = view(&Memory::dropped_for_room(), t0);
    assert!(matches!(
        lost.count("*", Duration::from_secs(1)),
        Err(CountError::Forgotten)
    ));
}
