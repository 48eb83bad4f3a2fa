//! Session memory shared by replicas through Redis or Valkey (R34), for
//! meshes whose write rate is more than the registry's etcd should carry.
//!
//! One key per session, `<prefix>.sessions/<digest>` (the same name as in
//! etcd: the SHA-256 of the identity and session id, so the keys do not
//! list who has sessions), its memory as JSON, on a time to live of the
//! memory's age renewed by every write, so an abandoned session leaves the
//! store by itself.
//!
//! An update reads the session (`GET`), applies the update, and writes it
//! back with a Lua script that compares the value in the store with the
//! SHA-1 of the value read and writes only when they agree (a
//! compare-and-set, as etcd's transaction on the key's revision): two
//! replicas updating one session never lose each other's entries; the one
//! that lost the race reads again, at most [`ATTEMPTS`] times. The script
//! runs atomically in Redis, over the one multiplexed connection the
//! replica keeps (a `WATCH` would need a connection per update).
//!
//! Every request has a deadline (the connection's response timeout; the
//! session memory's own deadline bounds the whole operation too): a slow or
//! unreachable Redis answers as an error, the rules that read the memory
//! then fail per their guard's policy. The connection is made again in the
//! background after it broke.

use super::key::SessionKey;
use super::memory::{Applied, Memory};
use super::store::{Put, Record, SECRET_CHECK, SecretAgreement, SessionStore, StoreError, Write};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::time::Duration;

/// Attempts of one update that meets concurrent updates of its session.
const ATTEMPTS: u32 = 8;

/// Writes `ARGV[2]` at `KEYS[1]` with a time to live of `ARGV[3]`
/// milliseconds when the value there has the SHA-1 `ARGV[1]` (`""`: when
/// there is none); 1 when written, 0 when the value changed since it was
/// read.
const COMPARE_AND_SET: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  if redis.sha1hex(current) ~= ARGV[1] then return 0 end
elseif ARGV[1] ~= '' then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
";

/// Where and how to reach Redis.
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://[user:password@]host:port[/db]` or `rediss://...` (TLS,
    /// verified against the system's roots).
    pub url: String,
    /// Replaces the URL's password, when given (read from a file, so the
    /// secret is not in the config).
    pub password: Option<String>,
    /// The registry's key prefix: sessions live under `<prefix>.sessions/`.
    pub prefix: String,
    /// Deadline of each request to Redis.
    pub request_timeout: Duration,
    /// How long start-up may try to reach Redis.
    pub dial_timeout: Duration,
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password: only its host is shown.
        f.debug_struct("RedisSettings")
            .field("prefix", &self.prefix)
            .field("request_timeout", &self.request_timeout)
            .field("dial_timeout", &self.dial_timeout)
            .finish_non_exhaustive()
    }
}

/// Why the Redis store could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RedisConnectError {
    /// The URL is not one the store accepts.
    #[error("sessions.redis_url: {0}")]
    Url(String),
    /// Redis did not answer, or refused the credentials.
    #[error("cannot reach Redis at {addr}: {cause}")]
    Unreachable { addr: String, cause: String },
}

/// The Redis store.
#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
    script: redis::Script,
    timeout: Duration,
    /// Keys the sessions' names (the session secret).
    names: super::Digester,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Checks a `sessions.redis_url` without connecting: `redis://` or
/// `rediss://`, a host, no fragment (redis-rs reads `#insecure` as "do not
/// verify the server's certificate", which the mesh never does).
pub fn check_url(url: &str) -> Result<(), RedisConnectError> {
    let rest = url
        .strip_prefix("rediss://")
        .or_else(|| url.strip_prefix("redis://"))
        .ok_or_else(|| {
            RedisConnectError::Url(
                "must start with redis:// (or rediss:// for TLS), e.g. redis://127.0.0.1:6379"
                    .into(),
            )
        })?;
    if url.contains('#') {
        return Err(RedisConnectError::Url(
            "must have no #fragment (a certificate is always verified)".into(),
        ));
    }
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    if host.is_empty() || host.starts_with(['/', ':']) {
        return Err(RedisConnectError::Url("names no host".into()));
    }
    redis::Client::open(url).map_err(|e| RedisConnectError::Url(e.to_string()))?;
    Ok(())
}

impl RedisStore {
    /// Connects to Redis (within `dial_timeout`) and authenticates; its
    /// sessions are named by a digest of their key under `names` (the
    /// session secret: [`SessionKey::stored_name`]).
    pub async fn connect(
        settings: &RedisSettings,
        names: &super::Digester,
    ) -> Result<Self, RedisConnectError> {
        check_url(&settings.url)?;
        let client = redis::Client::open(settings.url.as_str())
            .map_err(|e| RedisConnectError::Url(e.to_string()))?;
        let addr = client.get_connection_info().addr().to_string();
        let mut info = client.get_connection_info().clone();
        if let Some(password) = &settings.password {
            let redis = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(redis);
        }
        // Small requests answered one by one: without TCP_NODELAY each
        // waits on Nagle's algorithm (measured: about 3 ms a request on
        // loopback).
        let tcp = redis::io::tcp::TcpSettings::default().set_nodelay(true);
        let client = redis::Client::open(info.set_tcp_settings(tcp))
            .map_err(|e| RedisConnectError::Url(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(settings.request_timeout.min(settings.dial_timeout)))
            .set_response_timeout(Some(settings.request_timeout))
            // Reconnecting in the background after the connection broke:
            // a few tries, then again at the next request.
            .set_number_of_retries(3)
            .set_max_delay(settings.request_timeout);
        let unreachable = |cause: String| RedisConnectError::Unreachable {
            addr: addr.clone(),
            cause,
        };
        let connection = tokio::time::timeout(
            settings.dial_timeout,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| unreachable(format!("no answer within {:?}", settings.dial_timeout)))?
        .map_err(|e| unreachable(e.to_string()))?;
        Ok(Self {
            connection,
            prefix: super::store::sessions_prefix(&settings.prefix),
            script: redis::Script::new(COMPARE_AND_SET),
            timeout: settings.request_timeout,
            names: names.clone(),
        })
    }

    fn key(&self, key: &SessionKey) -> String {
        format!("{}{}", self.prefix, key.stored_name(&self.names))
    }

    fn error(&self, error: &redis::RedisError) -> StoreError {
        if error.is_timeout() {
            return StoreError::TimedOut(self.timeout);
        }
        match error.kind() {
            redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => {
                StoreError::Corrupt(error.to_string())
            }
            _ if error.code() == Some("WRONGTYPE") => StoreError::Corrupt(error.to_string()),
            _ => StoreError::Unavailable(error.to_string()),
        }
    }

    /// The raw value at `key`, if any.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut connection = self.connection.clone();
        redis::cmd("GET")
            .arg(key)
            .query_async::<Option<Vec<u8>>>(&mut connection)
            .await
            .map_err(|e| self.error(&e))
    }
}

fn parse(value: &[u8]) -> Result<Memory, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(e.to_string()))
}

#[tonic::async_trait]
impl SessionStore for RedisStore {
    async fn load(&self, key: &SessionKey) -> Result<Option<Memory>, StoreError> {
        self.get(&self.key(key))
            .await?
            .map(|value| parse(&value))
            .transpose()
    }

    async fn update(&self, key: &SessionKey, write: Write<'_>) -> Result<Applied, StoreError> {
        let (update, limits, now) = (write.update, write.limits, write.now);
        let key = self.key(key);
        let ttl_ms = u64::try_from(limits.max_age.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        for _ in 0..ATTEMPTS {
            let read = self.get(&key).await?;
            let (mut memory, read_digest) = match &read {
                None => (Memory::begun(update), String::new()),
                Some(value) => (
                    parse(value)?,
                    sha1_smol::Sha1::from(value).digest().to_string(),
                ),
            };
            super::store::still_as_read(read.is_some().then_some(&memory), update)?;
            let applied = memory.apply(update, limits, now);
            let value =
                serde_json::to_vec(&memory).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            let mut connection = self.connection.clone();
            let written: i64 = self
                .script
                .key(&key)
                .arg(read_digest)
                .arg(value)
                .arg(ttl_ms)
                .invoke_async(&mut connection)
                .await
                .map_err(|e| self.error(&e))?;
            if written == 1 {
                return Ok(applied);
            }
        }
        Err(StoreError::Contended(ATTEMPTS))
    }

    async fn agree_on_secret(&self, check: &str) -> Result<SecretAgreement, StoreError> {
        let key = format!("{}{SECRET_CHECK}", self.prefix);
        let mut connection = self.connection.clone();
        let written: bool = redis::cmd("SETNX")
            .arg(&key)
            .arg(check)
            .query_async(&mut connection)
            .await
            .map_err(|e| self.error(&e))?;
        if written {
            return Ok(SecretAgreement::First);
        }
        let there = self.get(&key).await?;
        Ok(SecretAgreement::with(there.as_deref(), check))
    }

    async fn record(&self, name: &str) -> Result<Option<Record>, StoreError> {
        let key = format!("{}{name}", self.prefix);
        Ok(self.get(&key).await?.map(|value| Record {
            version: sha1_smol::Sha1::from(&value).digest().to_string(),
            value,
        }))
    }

    async fn put_record(&self, put: Put<'_>) -> Result<bool, StoreError> {
        let Put { name, version, .. } = put;
        let key = format!("{}{name}", self.prefix);
        let ttl_ms = u64::try_from(put.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut connection = self.connection.clone();
        let written: i64 = self
            .script
            .key(&key)
            .arg(version.unwrap_or(""))
            .arg(put.value)
            .arg(ttl_ms)
            .invoke_async(&mut connection)
            .await
            .map_err(|e| self.error(&e))?;
        Ok(written == 1)
    }

    async fn records(&self, prefix: &str, limit: usize) -> Result<Vec<Record>, StoreError> {
        let pattern = format!("{}{prefix}*", self.prefix);
        let mut connection = self.connection.clone();
        let mut cursor = 0u64;
        let mut keys: Vec<String> = Vec::new();
        // Bounded: at most 64 rounds of SCAN, and `limit` keys.
        for _ in 0..64 {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut connection)
                .await
                .map_err(|e| self.error(&e))?;
            keys.extend(found);
            cursor = next;
            if cursor == 0 || keys.len() >= limit {
                break;
            }
        }
        keys.truncate(limit);
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(value) = self.get(&key).await? {
                out.push(Record {
                    version: sha1_smol::Sha1::from(&value).digest().to_string(),
                    value,
                });
            }
        }
        Ok(out)
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r34_redis_urls_that_are_not_plain_redis_or_tls_are_refused() {
        for ok in [
            "redis://127.0.0.1:6379",
            "redis://:pw@10.0.0.1:6380/2",
            "redis://user:pw@cache.internal:6379",
            "rediss://cache.internal:6380",
        ] {
            assert!(check_url(ok).is_ok(), "{ok}: {:?}", check_url(ok));
        }
        for bad in [
            "http://127.0.0.1:6379",
            "unix:///run/redis.sock",
            "redis+unix:///run/redis.sock",
            "rediss://cache.internal:6380/#insecure",
            "redis://",
            "redis:///0",
            "127.0.0.1:6379",
            "",
        ] {
            assert!(check_url(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn r34_settings_never_show_the_url_or_password() {
        let settings = RedisSettings {
            url: "redis://:hunter2pw@127.0.0.1:6379".into(),
            password: Some("s3cr3tpw".into()),
            prefix: "/p/".into(),
            request_timeout: Duration::from_millis(500),
            dial_timeout: Duration::from_secs(5),
        };
        let shown = format!("{settings:?}");
        assert!(
            !shown.contains("hunter2pw") && !shown.contains("s3cr3tpw"),
            "{shown}"
        );
    }
}
