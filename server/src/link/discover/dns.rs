//! The replicas of a guard whose endpoint is a DNS name (R32).
//!
//! A registration whose endpoint host is a name (`http://guard.ns.svc:7001`)
//! names a service: every A and AAAA address the name resolves to is one
//! replica, dialed on the endpoint's port with the endpoint's scheme. The
//! name is resolved when the watch starts, again every interval
//! ([`DEFAULT_RESOLVE_INTERVAL`], `guard_links.resolve_interval_ms`), and
//! whenever a link asks for it ([`ResolveHandle::resolve_now`], after a
//! connection failure), no more often than [`MIN_RESOLVE_GAP`].
//!
//! Every address, at every resolution, is held to the endpoint policy, as
//! the single link's dial is: a name that later resolves to a metadata or
//! link-local address loses that address (refused, logged and counted), it
//! is never published and so never dialed. A name gives at most
//! [`MAX_ADDRESSES_PER_NAME`] replicas (the first ones in address order).
//!
//! A failed resolution keeps the last set: a DNS outage does not empty a
//! guard's replica set (the links to the replicas already known keep
//! working, or fail on their own). A name that resolves to nothing that is
//! allowed publishes an empty set; the guard stays in the chain and fails
//! per R13 (R15).
//!
//! An endpoint whose host is an IP address is one replica that never
//! changes, exactly as before R32.

use super::sources::NameSettings;
use super::{ReplicaTarget, Replicas, fixed};
use crate::link::dial::{EndpointPolicy, ambiguous_host};
use futures::future::BoxFuture;
use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// How often a guard's DNS name is resolved again when nothing asks sooner.
pub const DEFAULT_RESOLVE_INTERVAL: Duration = Duration::from_secs(30);

/// The shortest time between two resolutions of one name, however often
/// its links ask (a guard whose replicas all fail must not turn into a
/// stream of DNS queries).
pub const MIN_RESOLVE_GAP: Duration = Duration::from_secs(1);

/// The most replicas one name gives.
pub const MAX_ADDRESSES_PER_NAME: usize = 64;

/// Resolves a host name to its addresses: the system's resolver
/// ([`SystemResolver`]), or a test's.
pub trait Resolve: Send + Sync + 'static {
    fn lookup<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>>;
}

/// `getaddrinfo` through tokio: `/etc/hosts`, then DNS, as the rest of the
/// process resolves.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn lookup<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
        Box::pin(async move {
            Ok(tokio::net::lookup_host((host, port))
                .await?
                .map(|a: SocketAddr| a.ip())
                .collect())
        })
    }
}

/// Why an endpoint gives no replica watch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {endpoint:?} is not an http:// or https:// URL with a host: {reason}")]
    Malformed { endpoint: String, reason: String },
    #[error("endpoint {endpoint:?}: {reason}")]
    AmbiguousHost {
        endpoint: String,
        reason: &'static str,
    },
}

/// An endpoint taken apart: scheme, host as written, port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedEndpoint {
    /// `http` or `https`.
    pub scheme: &'static str,
    /// The host without brackets.
    pub host: String,
    pub port: u16,
    /// The host is an IP address.
    pub literal: Option<IpAddr>,
}

/// Reads `endpoint` (`http://host:port`, `https://host:port`, or
/// `host:port`, read as `http://`) as the links dial it.
pub fn parse_endpoint(endpoint: &str) -> Result<ParsedEndpoint, EndpointError> {
    let malformed = |reason: &str| EndpointError::Malformed {
        endpoint: endpoint.to_owned(),
        reason: reason.to_owned(),
    };
    let (scheme, rest) = if let Some(rest) = endpoint.strip_prefix("https://") {
        ("https", rest)
    } else if let Some(rest) = endpoint.strip_prefix("http://") {
        ("http", rest)
    } else if endpoint.contains("://") {
        return Err(malformed("the scheme must be http:// or https://"));
    } else {
        ("http", endpoint)
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#', '@']) {
        return Err(malformed("only scheme, host and port are allowed"));
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => {
            let port = port
                .parse::<u16>()
                .map_err(|_| malformed("the port is not a number from 1 to 65535"))?;
            (host, port)
        }
        _ => (authority, if scheme == "https" { 443 } else { 80 }),
    };
    if port == 0 {
        return Err(malformed("the port is not a number from 1 to 65535"));
    }
    if let Some(reason) = ambiguous_host(host) {
        return Err(EndpointError::AmbiguousHost {
            endpoint: endpoint.to_owned(),
            reason,
        });
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Ok(ParsedEndpoint {
        scheme,
        host: bare.to_owned(),
        port,
        literal: bare.parse::<IpAddr>().ok(),
    })
}

/// The endpoint of the replica at `ip` of an endpoint `scheme://name:port`.
pub fn address_endpoint(scheme: &str, ip: IpAddr, port: u16) -> String {
    format!("{scheme}://{}", SocketAddr::new(ip, port))
}

/// Asks a name's watch to resolve again, and reads what it refused.
#[derive(Debug, Clone, Default)]
pub struct ResolveHandle {
    now: Arc<Notify>,
    refused: Arc<AtomicU64>,
    resolutions: Arc<AtomicU64>,
}

impl ResolveHandle {
    /// Resolve again soon (at most once per [`MIN_RESOLVE_GAP`]): what a
    /// link calls when a replica's connection fails, so that a replica that
    /// moved is found without waiting for the interval. A no-op for an
    /// endpoint that is an address.
    pub fn resolve_now(&self) {
        self.now.notify_one();
    }

    /// Addresses the endpoint policy refused, over all resolutions (an
    /// address refused at each of three resolutions counts three).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Resolutions made (successful or not).
    pub fn resolutions(&self) -> u64 {
        self.resolutions.load(Ordering::Relaxed)
    }
}

/// The watch of `endpoint`'s name for the guard `guard`, or None when the
/// endpoint is an address (a fixed set of itself).
fn name_watch(
    guard: &str,
    endpoint: &str,
    names: &NameSettings,
    handle: &ResolveHandle,
) -> Result<Option<NameWatch>, EndpointError> {
    let parsed = parse_endpoint(endpoint)?;
    if parsed.literal.is_some() {
        return Ok(None);
    }
    Ok(Some(NameWatch {
        guard: guard.to_owned(),
        endpoint: endpoint.to_owned(),
        parsed,
        policy: names.policy.clone(),
        resolver: names.resolver.clone(),
        handle: handle.clone(),
    }))
}

/// A guard's replica set and the handle that asks for a new resolution,
/// or why its endpoint cannot be watched.
pub type Watched = Result<(Replicas, ResolveHandle), EndpointError>;

/// The replica set of the guard `guard` registered at `endpoint`, its
/// names resolved with `names`, and the handle that asks for a new
/// resolution.
///
/// An address endpoint gives a fixed set of that one endpoint. A name is
/// resolved once before this returns (so the set starts as the name's
/// addresses, or empty when it resolves to none), then by a task that
/// lives as long as a receiver of the watch does.
pub async fn watch_endpoint(guard: &str, endpoint: &str, names: &NameSettings) -> Watched {
    let handle = ResolveHandle::default();
    let Some(mut name) = name_watch(guard, endpoint, names, &handle)? else {
        return Ok((fixed([endpoint.to_owned()]), handle));
    };
    let first = name.resolve().await.unwrap_or_default();
    let (tx, rx) = watch::channel(first);
    tokio::spawn(name.run(tx, names.interval.max(MIN_RESOLVE_GAP)));
    Ok((rx, handle))
}

/// [`watch_endpoint`] without waiting for the first resolution, for a
/// caller that must not block (the mesh building its chain): a name's set
/// starts as the name's own endpoint (dialed as written, its addresses
/// checked against the policy at dial, as before R32), and a task replaces
/// it with the name's addresses once the first resolution answers, so the
/// guard is never without a replica meanwhile. A first resolution that
/// fails keeps the name's endpoint, as any failed resolution keeps the
/// last set; one that finds no allowed address publishes an empty set.
/// Must be called within a tokio runtime.
pub fn watch_name(guard: &str, endpoint: &str, names: &NameSettings) -> Watched {
    let handle = ResolveHandle::default();
    let Some(mut name) = name_watch(guard, endpoint, names, &handle)? else {
        return Ok((fixed([endpoint.to_owned()]), handle));
    };
    let itself: Arc<[ReplicaTarget]> = Arc::from(vec![ReplicaTarget::of_name(endpoint, endpoint)]);
    let (tx, rx) = watch::channel(itself);
    let interval = names.interval.max(MIN_RESOLVE_GAP);
    tokio::spawn(async move {
        tokio::select! {
            first = name.resolve() => {
                if let Some(first) = first {
                    name.publish(&tx, first);
                }
            }
            () = tx.closed() => return,
        }
        name.run(tx, interval).await;
    });
    Ok((rx, handle))
}

struct NameWatch {
    guard: String,
    /// The endpoint as registered (`scheme://name:port`).
    endpoint: String,
    parsed: ParsedEndpoint,
    policy: Arc<EndpointPolicy>,
    resolver: Arc<dyn Resolve>,
    handle: ResolveHandle,
}

impl NameWatch {
    /// The name's allowed addresses as targets, in address order, at most
    /// [`MAX_ADDRESSES_PER_NAME`]; `None` when the name cannot be resolved.
    async fn resolve(&mut self) -> Option<Arc<[ReplicaTarget]>> {
        let host = self.parsed.host.as_str();
        self.handle.resolutions.fetch_add(1, Ordering::Relaxed);
        let addresses = match self.resolver.lookup(host, self.parsed.port).await {
            Ok(addresses) => addresses,
            Err(error) => {
                tracing::warn!(guard = %self.guard, host, %error, "guard endpoint: cannot resolve; keeping its last replica set");
                return None;
            }
        };
        let mut allowed = BTreeSet::new();
        for ip in addresses {
            match self.policy.check_ip(ip, Some(host)) {
                Ok(()) => {
                    allowed.insert(ip);
                }
                Err(why) => {
                    self.handle.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(guard = %self.guard, host, %ip, %why, "guard endpoint: the endpoint policy refuses a resolved address; it is not dialed");
                }
            }
        }
        if allowed.len() > MAX_ADDRESSES_PER_NAME {
            tracing::warn!(
                guard = %self.guard,
                host,
                addresses = allowed.len(),
                kept = MAX_ADDRESSES_PER_NAME,
                "guard endpoint: the name resolves to more addresses than a guard may have replicas; the first are kept"
            );
        }
        Some(
            allowed
                .into_iter()
                .take(MAX_ADDRESSES_PER_NAME)
                .map(|ip| {
                    ReplicaTarget::of_name(
                        address_endpoint(self.parsed.scheme, ip, self.parsed.port),
                        self.endpoint.as_str(),
                    )
                })
                .collect(),
        )
    }

    async fn run(mut self, tx: watch::Sender<Arc<[ReplicaTarget]>>, interval: Duration) {
        let now = self.handle.now.clone();
        loop {
            let started = tokio::time::Instant::now();
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = now.notified() => {
                    // Asked early: still no sooner than the gap since the last.
                    tokio::select! {
                        () = tokio::time::sleep_until(started + MIN_RESOLVE_GAP) => {}
                        () = tx.closed() => return,
                    }
                }
                () = tx.closed() => return,
            }
            if let Some(next) = self.resolve().await {
                self.publish(&tx, next);
            }
        }
    }

    /// Publishes `next` when it differs from the current set.
    fn publish(&self, tx: &watch::Sender<Arc<[ReplicaTarget]>>, next: Arc<[ReplicaTarget]>) {
        tx.send_if_modified(|current| {
            if *current == next {
                return false;
            }
            tracing::info!(
                guard = %self.guard,
                host = %self.parsed.host,
                replicas = next.len(),
                "guard endpoint: replica set changed"
            );
            *current = next;
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A resolver whose answer the test sets.
    struct Scripted {
        answer: Mutex<std::io::Result<Vec<IpAddr>>>,
        asked: AtomicU64,
    }

    impl Scripted {
        fn new(ips: &[&str]) -> Arc<Self> {
            let resolver = Arc::new(Self {
                answer: Mutex::new(Ok(Vec::new())),
                asked: AtomicU64::new(0),
            });
            resolver.set(ips);
            resolver
        }

        fn set(&self, ips: &[&str]) {
            *self.answer.lock().unwrap() = Ok(ips.iter().map(|ip| ip.parse().unwrap()).collect());
        }

        fn fail(&self) {
            *self.answer.lock().unwrap() = Err(std::io::Error::other("no such host"));
        }
    }

    impl Resolve for Scripted {
        fn lookup<'a>(&'a self, _: &'a str, _: u16) -> BoxFuture<'a, std::io::Result<Vec<IpAddr>>> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            let answer = match &*self.answer.lock().unwrap() {
                Ok(ips) => Ok(ips.clone()),
                Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            };
            Box::pin(async move { answer })
        }
    }

    fn endpoints(rx: &Replicas) -> Vec<String> {
        rx.borrow().iter().map(|t| t.endpoint.clone()).collect()
    }

    fn policy() -> Arc<EndpointPolicy> {
        Arc::new(EndpointPolicy::default())
    }

    /// The watch of the guard "g" at `endpoint` under the default policy,
    /// names resolved every `interval` by a resolver that first answers
    /// `ips`.
    async fn watch(
        endpoint: &str,
        ips: &[&str],
        interval: Duration,
    ) -> (Arc<Scripted>, Replicas, ResolveHandle) {
        watch_under(policy(), endpoint, ips, interval).await
    }

    /// [`watch`] under `policy`.
    async fn watch_under(
        policy: Arc<EndpointPolicy>,
        endpoint: &str,
        ips: &[&str],
        interval: Duration,
    ) -> (Arc<Scripted>, Replicas, ResolveHandle) {
        let resolver = Scripted::new(ips);
        let names = NameSettings {
            policy,
            interval,
            resolver: resolver.clone(),
        };
        let (rx, handle) = watch_endpoint("g", endpoint, &names).await.unwrap();
        (resolver, rx, handle)
    }

    /// Waits until the set changes, at most `within`.
    async fn changed_within(rx: &mut Replicas, within: Duration) {
        tokio::time::timeout(within, rx.changed())
            .await
            .expect("changed in time")
            .expect("the watch is open");
    }

    #[test]
    fn r32_endpoints_parse_as_links_dial_them() {
        let p = parse_endpoint("http://guard.ns.svc:7001").unwrap();
        assert_eq!(
            (p.scheme, p.host.as_str(), p.port),
            ("http", "guard.ns.svc", 7001)
        );
        assert_eq!(p.literal, None);
        let p = parse_endpoint("https://[::1]:9").unwrap();
        assert_eq!((p.scheme, p.host.as_str(), p.port), ("https", "::1", 9));
        assert!(p.literal.is_some());
        assert_eq!(parse_endpoint("guard:7").unwrap().scheme, "http");
        assert_eq!(parse_endpoint("https://guard").unwrap().port, 443);
        for bad in [
            "ftp://guard:1",
            "http://guard:0",
            "http://guard:99999",
            "http://user@guard:1",
            "http://guard:1/path",
            "http://0x7f.1:1",
            "http://guard.:1",
            "http://:1",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
        assert_eq!(
            address_endpoint("https", "::1".parse().unwrap(), 7),
            "https://[::1]:7"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn r32_an_address_endpoint_is_one_fixed_replica() {
        let (resolver, rx, handle) = watch(
            "http://127.0.0.2:7001",
            &["127.0.0.9"],
            DEFAULT_RESOLVE_INTERVAL,
        )
        .await;
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:7001"]);
        handle.resolve_now();
        assert_eq!(
            resolver.asked.load(Ordering::Relaxed),
            0,
            "an address is never resolved"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn r32_a_name_is_every_address_it_resolves_to_and_follows_changes() {
        let (resolver, mut rx, _handle) = watch(
            "https://guard.test:7001",
            &["127.0.0.3", "127.0.0.2", "127.0.0.4", "127.0.0.2"],
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(
            endpoints(&rx),
            [
                "https://127.0.0.2:7001",
                "https://127.0.0.3:7001",
                "https://127.0.0.4:7001"
            ]
        );
        rx.mark_unchanged();
        // One added, one removed: seen at the next interval.
        resolver.set(&["127.0.0.3", "127.0.0.4", "127.0.0.5"]);
        changed_within(&mut rx, Duration::from_secs(31)).await;
        assert_eq!(
            endpoints(&rx),
            [
                "https://127.0.0.3:7001",
                "https://127.0.0.4:7001",
                "https://127.0.0.5:7001"
            ]
        );
        // The same answer publishes nothing.
        rx.mark_unchanged();
        tokio::time::sleep(Duration::from_secs(65)).await;
        assert!(!rx.has_changed().unwrap());
        // A failed resolution keeps the last set.
        resolver.fail();
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert!(!rx.has_changed().unwrap());
        assert_eq!(endpoints(&rx).len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn ssrf_a_name_that_re_resolves_to_metadata_loses_that_address() {
        let (resolver, mut rx, handle) = watch(
            "http://guard.test:7001",
            &["127.0.0.2", "127.0.0.3"],
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(handle.refused(), 0);
        resolver.set(&["127.0.0.2", "169.254.169.254", "fe80::1", "0.0.0.0"]);
        changed_within(&mut rx, Duration::from_secs(31)).await;
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:7001"]);
        assert_eq!(handle.refused(), 3, "each refused address is counted");
        // Only metadata left: the set is empty, never the metadata address.
        resolver.set(&["169.254.169.254"]);
        changed_within(&mut rx, Duration::from_secs(31)).await;
        assert!(endpoints(&rx).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn ssrf_an_allow_list_applies_to_every_resolved_address() {
        let allow = Arc::new(EndpointPolicy::new(&["127.0.0.0/30".into()], true).unwrap());
        let (_, rx, handle) = watch_under(
            allow,
            "http://guard.test:1",
            &["127.0.0.2", "10.0.0.7", "127.0.0.9"],
            DEFAULT_RESOLVE_INTERVAL,
        )
        .await;
        assert_eq!(endpoints(&rx), ["http://127.0.0.2:1"]);
        assert_eq!(handle.refused(), 2);
        // A name on the allow-list may resolve to any address not denied.
        let by_name = Arc::new(EndpointPolicy::new(&["*.guards.svc".into()], true).unwrap());
        let (_, rx, _) = watch_under(
            by_name,
            "http://a.guards.svc:1",
            &["10.0.0.7", "169.254.169.254"],
            DEFAULT_RESOLVE_INTERVAL,
        )
        .await;
        assert_eq!(endpoints(&rx), ["http://10.0.0.7:1"]);
    }

    #[tokio::test(start_paused = true)]
    async fn r32_addresses_per_name_are_bounded() {
        let many: Vec<String> = (0..300u32)
            .map(|i| format!("10.0.{}.{}", i / 250, i % 250 + 1))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let (_, rx, _) = watch("http://guard.test:1", &many, DEFAULT_RESOLVE_INTERVAL).await;
        assert_eq!(rx.borrow().len(), MAX_ADDRESSES_PER_NAME);
        assert_eq!(rx.borrow()[0].endpoint, "http://10.0.0.1:1");
    }

    #[tokio::test(start_paused = true)]
    async fn r32_a_link_can_ask_for_a_new_resolution_no_more_than_once_a_gap() {
        let (resolver, mut rx, handle) = watch(
            "http://guard.test:1",
            &["127.0.0.2"],
            Duration::from_secs(3600),
        )
        .await;
        assert_eq!(handle.resolutions(), 1);
        resolver.set(&["127.0.0.3"]);
        handle.resolve_now();
        // Resolved again on request, long before the interval.
        changed_within(&mut rx, Duration::from_secs(2)).await;
        assert_eq!(endpoints(&rx), ["http://127.0.0.3:1"]);
        // A storm of requests: at most one resolution per gap.
        for _ in 0..100 {
            handle.resolve_now();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let made = handle.resolutions();
        assert!(made <= 2 + 5 + 1, "{made} resolutions in 5 s");
    }

    #[tokio::test(start_paused = true)]
    async fn r32_the_task_ends_with_its_last_reader() {
        let (_, rx, handle) = watch(
            "http://guard.test:1",
            &["127.0.0.2"],
            Duration::from_secs(1),
        )
        .await;
        drop(rx);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            handle.resolutions(),
            1,
            "no resolution after the last reader left"
        );
    }
}
