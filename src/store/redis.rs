//! The Redis store: a pool of fred clients, reading a request's misses in one pipelined round trip, writing
//! batches atomically, and carrying the replicas' invalidations and hot-key sets.
//!
//! Round trips. A standalone server gets one `MGET` for all the keys of a read and one `MULTI`/`EXEC` of
//! `SET ... PX` for a write batch. A cluster refuses `MGET` and `MULTI` across hash slots (`CROSSSLOT`), so
//! there a read is pipelined `GET`s and a write pipelined `SET`s: fred routes each command to the node owning
//! its slot and sends each node its share at once, so a read still costs one round trip (to every node
//! concerned, in parallel), but a cluster write batch is atomic per key only.
//!
//! Failure. Reads fail fast: no queueing behind a reconnection, no retry (a cluster's `ASK` and `MOVED`
//! redirections are followed: they are where the key is, not a failure), and a timeout of
//! `store.redis.command_timeout`, because a read that misses its deadline is worth nothing to the request
//! waiting for it (the hydrator serves stale values or defaults instead). A write is sent only on a live
//! connection (waiting up to a second for one, else refused unsent, so it cannot land after its caller was
//! told it failed), then waits up to `store.redis.write_timeout`; one whose connection closes while it is in
//! flight is not sent again, since it could then land after a newer write of its keys. The pool
//! reconnects forever with exponential backoff, and at most `store.redis.max_command_buffer` commands queue
//! in a client, so a slow Redis turns into fast errors rather than memory growth.
//!
//! Invalidation goes over the pub/sub channel `{prefix}:invalidate`, one message per written batch holding
//! its keys separated by `\n` (entity keys never hold control characters). Redis client-side tracking
//! (`CLIENT TRACKING ... BCAST`) would also see writes made around hydrant, but fred 10.1's
//! `start_tracking` sends BCAST tracking to a single cluster node, which only reports its own keys, so on a
//! cluster most invalidations would be lost; pub/sub works the same on every deployment. Pub/sub delivers at
//! most once, so when the subscription reconnects the subscriber reports [`Invalidation::All`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::prelude::{
    Builder, ClientLike, Config as FredConfig, Error as FredError, ErrorKind, EventInterface,
    Expiration, KeysInterface, Options, Pool, PubsubInterface, ReconnectPolicy, Value,
};
use fred::types::config::{TlsConnector, UnresponsiveConfig};
use parking_lot::Mutex;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::cluster::{self, Op};
use super::{BoxFuture, HotCounts, Invalidation, InvalidationSink, Store, StoreError, Writes};
use crate::config::RedisConfig;

/// How often (in hot-set flushes) a replica offers to decay the hot sets, and how long the decay lock is
/// held: scores halve about once a minute, whichever replica gets there first.
const DECAY_EVERY_FLUSHES: u64 = 60;
const DECAY_LOCK: Duration = Duration::from_secs(60);

/// Options of the hot sets' increments and halving (one attempt, since fred would send a command again
/// after a reconnection when its answer was lost, and an increment sent twice counts twice) and of the
/// heartbeat's pings.
const ONCE: Options = Options {
    max_attempts: Some(1),
    max_redirections: None,
    timeout: None,
    cluster_node: None,
    cluster_hash: None,
    fail_fast: true,
};

/// How often the subscriber's connections are pinged: a ping is how a dead subscription is found, and
/// while Redis exempts a subscribed connection from its idle `timeout`, it does not exempt the
/// subscriber's connections to the other nodes of a cluster, whose closing reconnects the subscription
/// and so flushes the cache. Redis counts the timeout in whole seconds.
pub(super) const SUBSCRIBER_HEARTBEAT: Duration = Duration::from_secs(1);

/// How often each pooled connection is pinged when the server's idle `timeout` is off or cannot be
/// read; a third of it when it is shorter (see [`pool_heartbeat`]).
const POOL_HEARTBEAT: Duration = Duration::from_secs(10);

/// How long a command may wait for its answer before fred takes the connection for dead (a frozen
/// server, a half-open socket) and reconnects, at the least. A pause of the server (a fork, a slow
/// command, a fail-over) shorter than this closes nothing: a reconnected subscription must flush the
/// whole cache, on every replica at once, since messages may have been lost.
const UNRESPONSIVE: Duration = Duration::from_secs(5);

/// How long the subscriber waits after a reconnection for the other connections of the same one (each
/// node's, on a cluster) before it resubscribes and flushes the cache once for them all.
const RECONNECT_SETTLE: Duration = Duration::from_millis(100);

/// Longest wait for a lost connection to come back before a write batch is refused unsent (at most
/// `write_timeout`): a restart or fail-over of a second or so is ridden out, an outage is not queued for.
const CONNECT_WAIT: Duration = Duration::from_secs(1);

pub struct RedisStore {
    pool: Pool,
    /// Cluster deployments get pipelined GET/SET instead of MGET and MULTI (see the module doc).
    clustered: bool,
    /// Options of every read: fail fast, one attempt, `command_timeout`.
    read: Options,
    /// Longest wait for a write batch or an announcement, whatever fred does meanwhile (a transaction
    /// queued behind a reconnection does not time out by itself).
    write_timeout: Duration,
    /// The fred configuration, to open the subscriber's own connection with the same settings.
    builder: Builder,
    /// Clients of cluster nodes that import slots but own none yet (see `cluster`).
    newcomers: Arc<cluster::Newcomers>,
    prefix: String,
    channel: String,
    flushes: AtomicU64,
    /// The announcements made from the background for failed writes: keys announced, and failures.
    announced: Arc<(AtomicU64, AtomicU64)>,
    /// Stops the invalidation subscriber's tasks (which then close its connection); set by
    /// `subscribe_invalidations`.
    subscriber: Mutex<Option<tokio::sync::watch::Sender<bool>>>,
    /// The pool was closed (`close`), so dropping the store does not close it again.
    closed: std::sync::atomic::AtomicBool,
    /// Every view whose hot set this replica has written, so a decay halves all of them, not just the
    /// views sampled in the flush that happened to win the decay lock.
    hot_views: Mutex<std::collections::BTreeSet<String>>,
    /// Why the pool's last reconnection failed, for the log and for the errors of the meantime.
    failures: Arc<ConnectFailures>,
    /// Stops the pool's heartbeat (also when dropped).
    heartbeat: tokio::sync::watch::Sender<bool>,
    /// How long a command may wait for its answer before its connection is taken for dead.
    unresponsive: Duration,
    /// Per pooled client, since when its reads have gone unanswered (see [`Stalls`]).
    stalls: Stalls,
    /// The pool's moves to a master the sentinels announced (see [`super::sentinel`]): the
    /// invalidation subscriber reconnects at each.
    moves: super::sentinel::Moves,
}

/// Why the pool's last (re)connection attempt failed, kept for a while. Without it, a server that
/// refuses the password after a restart (newly required, or rotated: `NOAUTH`, `WRONGPASS`) shows only
/// as "not connected" while it answers, and fred says why only at its debug level.
struct ConnectFailures {
    last: Mutex<Option<(Instant, String)>>,
    /// At most one log line per reason per 10 s: the pool retries every `reconnect_max_delay` per
    /// client.
    logged: crate::telemetry::Throttle,
}

impl ConnectFailures {
    fn new() -> Self {
        Self {
            last: Mutex::new(None),
            logged: crate::telemetry::Throttle::new(Duration::from_secs(10)),
        }
    }

    /// How long a failure is quoted in errors after it happened.
    const RECENT: Duration = Duration::from_secs(60);

    /// Listens to `client`'s connection errors until the client is gone. An error with no server is a
    /// connection attempt that failed; a connected server's errors name it, and fred logs those itself.
    fn watch(self: &Arc<Self>, client: &fred::clients::Client) {
        let mut errors = client.error_rx();
        let failures = self.clone();
        tokio::spawn(async move {
            loop {
                match errors.recv().await {
                    Ok((e, None)) => failures.note(&e),
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break,
                }
            }
        });
    }

    fn note(&self, e: &FredError) {
        let text = e.to_string();
        *self.last.lock() = Some((Instant::now(), text.clone()));
        let Some(more) = self.logged.admit_reason(&text) else {
            return;
        };
        tracing::warn!(
            error = %text,
            more_since_last_line = more,
            "Redis (store.redis.url) refused or failed a reconnection; retrying"
        );
    }

    /// `; the last reconnection failed: ...`, when one failed within [`Self::RECENT`].
    fn hint(&self) -> String {
        match &*self.last.lock() {
            Some((at, text)) if at.elapsed() < Self::RECENT => {
                format!("; the last reconnection failed: {text}")
            }
            _ => String::new(),
        }
    }

    /// `e`, with the last reconnection's failure when `e` is the store being unavailable.
    fn explain(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Unavailable(m) => StoreError::Unavailable(m + &self.hint()),
            other => other,
        }
    }
}

impl RedisStore {
    /// Connects the pool, failing when Redis does not answer within `connect_timeout`.
    pub async fn connect(cfg: &RedisConfig, prefix: &str) -> anyhow::Result<Self> {
        let mut config = FredConfig::from_url(&cfg.url).map_err(|e| {
            // fred's message never echoes the URL, which may hold a password.
            let hint = if cfg.url.contains('@') {
                " (a user name or password holding `/`, `@`, `:`, `?` or `#` must be percent-encoded: `/` is %2F)"
            } else {
                ""
            };
            anyhow::anyhow!(
                "store.redis.url is not a valid Redis URL: {}{hint}",
                e.details()
            )
        })?;
        // Start-up reports a Redis it cannot reach rather than serving defaults from a cold cache.
        config.fail_fast = true;
        if !cfg.tls_ca_file.as_os_str().is_empty() {
            if config.tls.is_none() {
                anyhow::bail!(
                    "store.redis.tls_ca_file is set, but store.redis.url is not a TLS URL (rediss://)"
                );
            }
            config.tls = Some(tls_trusting(&cfg.tls_ca_file)?.into());
        }
        let mut builder = Builder::from_config(config.clone());
        // How long a command may wait for its answer before its connection is taken for dead.
        let unresponsive = cfg.connect_timeout.max(UNRESPONSIVE);
        builder
            .set_policy(ReconnectPolicy::new_exponential(
                0,
                millis(cfg.reconnect_min_delay),
                millis(cfg.reconnect_max_delay),
                2,
            ))
            .with_connection_config(|c| {
                watch_connection(c, cfg.connect_timeout, unresponsive);
                c.max_command_buffer_len = cfg.max_command_buffer;
                // A command whose connection closes while it is in flight is not sent again after the
                // reconnection. A write batch sent again could land after its caller was told it timed
                // out and had written the keys anew (answered 200 meanwhile), undoing that write: a
                // partition of 15 s did this to 2 keys of 8. Reads and hot-set increments ask for one
                // attempt themselves.
                c.max_command_attempts = 1;
                cluster::configure(c);
            })
            .with_performance_config(|p| {
                // Longer than `write_timeout`, which `write` enforces itself: a timed-out batch then always
                // takes the path that announces its keys again once the write ends.
                p.default_command_timeout = cfg.write_timeout.saturating_mul(2);
                // Room for bursts of invalidation messages before the subscriber would lag (and flush).
                p.broadcast_channel_capacity = 1024;
            });
        let pool = builder
            .build_pool(cfg.pool_size)
            .map_err(|e| anyhow::anyhow!("store.redis: {}", e.details()))?;
        match tokio::time::timeout(cfg.connect_timeout, pool.init()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                // Bytes that are not RESP: something else listens there (an HTTP proxy, a TLS port
                // spoken to in plain text).
                let hint = match e.kind() {
                    ErrorKind::Protocol => {
                        ": the server did not answer as Redis does; check the host and port, and whether it wants TLS (rediss://)".to_owned()
                    }
                    // The sentinels answer a name they do not monitor with no address.
                    ErrorKind::Sentinel if e.details().contains("Missing primary address") => {
                        format!(
                            ": the sentinels reached know no master named `{}` (sentinelServiceName in the URL); check the name their `sentinel monitor` lines give",
                            sentinel_service(&cfg.url).unwrap_or("?")
                        )
                    }
                    // The URL's credentials go to the sentinels as well as to the master (fred's way).
                    ErrorKind::Auth | ErrorKind::Sentinel
                        if config.server.is_sentinel()
                            && ["NOAUTH", "WRONGPASS", "invalid password"]
                                .iter()
                                .any(|w| e.details().contains(w)) =>
                    {
                        ": a sentinel or the master wants a password, or refused the URL's: the URL's credentials are sent to both, so sentinels with a password need the master's (`requirepass` as the master's)".to_owned()
                    }
                    // rustls refused the server's certificate.
                    _ if e.details().contains("UnknownIssuer") => {
                        if cfg.tls_ca_file.as_os_str().is_empty() {
                            ": the server's TLS certificate is not signed by a CA this machine trusts; name the CA that signed it in store.redis.tls_ca_file (a PEM file)".to_owned()
                        } else {
                            format!(
                                ": the server's TLS certificate is not signed by the CA in store.redis.tls_ca_file ({})",
                                cfg.tls_ca_file.display()
                            )
                        }
                    }
                    _ if e.details().contains("NotValidForName") => {
                        ": the server's TLS certificate does not name the host in the URL".to_owned()
                    }
                    _ => String::new(),
                };
                anyhow::bail!(
                    "cannot connect to Redis (store.redis.url): {}{hint}",
                    words(&e, true)
                );
            }
            Err(_) => {
                // Stop the connection attempts still running (best-effort: quitting may wait on them too).
                tokio::spawn(async move {
                    let _ = pool.quit().await;
                });
                // rediss:// and rediss-cluster://
                let tls = if cfg
                    .url
                    .get(..6)
                    .is_some_and(|s| s.eq_ignore_ascii_case("rediss"))
                {
                    ": the URL asks for TLS (rediss://); check that the server speaks TLS on that port"
                } else {
                    ""
                };
                anyhow::bail!(
                    "Redis (store.redis.url) did not answer within {:?} (store.redis.connect_timeout){tls}",
                    cfg.connect_timeout
                );
            }
        }
        let clustered = pool.is_clustered();
        if !clustered && cluster_node(&pool).await {
            let _ = pool.quit().await;
            anyhow::bail!(
                "store.redis.url names a node of a Redis Cluster (its INFO says cluster_enabled:1) as a single server: use redis-cluster://HOST:PORT (rediss-cluster:// with TLS), so that each key is read from and written to the node that holds it"
            );
        }
        let failures = Arc::new(ConnectFailures::new());
        for client in pool.clients() {
            failures.watch(client);
        }
        let every = pool_heartbeat(&pool, cfg.connect_timeout).await;
        let stalls = Stalls::new(pool.clients().len(), unresponsive);
        let (heartbeat_stop, stop) = tokio::sync::watch::channel(false);
        let moves = super::sentinel::Moves::new(0);
        super::sentinel::follow(
            &config,
            cfg.connect_timeout,
            unresponsive,
            pool.clone(),
            moves.clone(),
            heartbeat_stop.subscribe(),
        );
        tokio::spawn(heartbeat(
            pool.clients().to_vec(),
            every,
            unresponsive,
            stop,
        ));
        Ok(Self {
            pool,
            clustered,
            read: Options {
                timeout: Some(cfg.command_timeout),
                // One: fred would queue a command whose send failed for another attempt after the
                // reconnection, `fail_fast` or not. A cluster's redirections are not attempts here:
                // fred follows none, `cluster::run` does.
                max_attempts: Some(1),
                fail_fast: true,
                ..Options::default()
            },
            write_timeout: cfg.write_timeout,
            newcomers: Arc::new(cluster::Newcomers::new(
                builder.clone(),
                cfg.connect_timeout,
            )),
            builder,
            prefix: prefix.to_owned(),
            hot_views: Mutex::new(std::collections::BTreeSet::new()),
            channel: format!("{prefix}:invalidate"),
            flushes: AtomicU64::new(0),
            announced: Arc::default(),
            subscriber: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            failures,
            heartbeat: heartbeat_stop,
            unresponsive,
            stalls,
            moves,
        })
    }

    /// The hot-key set of a view: the key of entity `view` in the reserved view `hot`.
    fn hot_key(&self, view: &str) -> String {
        super::key(&self.prefix, crate::schema::HOT_VIEW, view)
    }

    async fn read(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let client = self.pool.next_connected();
        if !self.clustered {
            let mut watch = self.stalls.watch(&self.pool, client);
            let reply = client
                .with_options(&self.read)
                .mget(keys.iter().map(String::as_str).collect::<Vec<_>>())
                .await;
            // Any answer, an error of Redis's included, says the connection works.
            watch.answered = !matches!(&reply, Err(e) if *e.kind() == ErrorKind::Timeout);
            let reply: Value = reply.map_err(|e| self.failures.explain(store_error(e)))?;
            return match reply {
                Value::Array(items) => items.into_iter().map(record_bytes).collect(),
                other => Err(StoreError::Io(format!(
                    "MGET answered {:?}, not an array",
                    other.kind()
                ))),
            };
        }
        let gets: Vec<Op> = keys
            .iter()
            .map(|k| Op::read("GET", vec![Value::from(k.as_str())]))
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for r in cluster::run(client, &self.newcomers, &self.read, &gets).await {
            out.push(match r {
                Ok(v) => record_bytes(v)?,
                // Another type stored at the key reads as absent, as MGET answers it on a standalone server.
                Err(e) if e.details().starts_with("WRONGTYPE") => None,
                Err(e) => return Err(self.failures.explain(store_error(e))),
            });
        }
        Ok(out)
    }

    /// Stops the invalidation subscriber, and says whether the caller is the one to close the pool
    /// (`close` or the drop, whichever comes first).
    fn stop_and_claim_close(&self) -> bool {
        if let Some(stop) = self.subscriber.lock().take() {
            let _ = stop.send(true);
        }
        let _ = self.heartbeat.send(true);
        !self.closed.swap(true, Relaxed)
    }

    /// Writes a batch, or answers [`StoreError::Timeout`] after `write_timeout`. A batch that failed once
    /// sent may have landed in part, so its keys are announced all the same. A timed-out batch may
    /// still be applied later (a server that was busy reads it when it is free again; a batch whose
    /// connection closes is not sent again), so the write goes on in its own task and its keys are
    /// announced twice: at once, and again when the write ends, so a replica that re-read a key in
    /// between drops the old value then.
    async fn write(&self, writes: Writes, ttl: Option<Duration>) -> Result<(), StoreError> {
        // A batch handed to fred while its connection is down would queue behind the reconnection and could
        // land long after its caller was told it failed. So wait a little for the connection, and when none
        // comes refuse the batch unsent: "not written" is then the truth.
        let client = self.pool.next().clone();
        if !client.is_connected() {
            let wait = self.write_timeout.min(CONNECT_WAIT);
            let connected = tokio::time::timeout(wait, client.wait_for_connect()).await;
            if !matches!(connected, Ok(Ok(()))) {
                return Err(StoreError::Unavailable(format!(
                    "Redis is not connected (waited {}), so the batch was not sent{}",
                    crate::config::duration::format(wait),
                    self.failures.hint()
                )));
            }
        }
        let keys: Arc<[String]> = writes.iter().map(|(k, _)| k.clone()).collect();
        let clustered = self.clustered;
        let newcomers = self.newcomers.clone();
        let mut task = tokio::spawn(write_batch(
            client,
            newcomers,
            clustered,
            writes,
            ttl,
            keys.clone(),
        ));
        match tokio::time::timeout(self.write_timeout, &mut task).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => {
                // Failed, but not necessarily whole: a cluster's pipelined SETs land key by key, and a
                // transaction whose EXEC answer was lost may have run.
                self.announce_in_background(&keys, None);
                Err(e)
            }
            Ok(Err(e)) => Err(StoreError::Io(format!("the write task failed: {e}"))),
            Err(_) => {
                // Whatever fred reports when it ends (its own timeout included), the batch may have
                // been applied.
                self.announce_in_background(&keys, Some(task));
                Err(StoreError::Timeout)
            }
        }
    }

    /// Announces `keys` from a task of its own, best effort, so that no replica keeps serving a value
    /// older than what may be stored: at once, and, given the `write` still going on, again once it ends.
    fn announce_in_background(
        &self,
        keys: &[String],
        write: Option<tokio::task::JoinHandle<Result<(), StoreError>>>,
    ) {
        let (pool, channel) = (self.pool.clone(), self.channel.clone());
        let (announced, n) = (self.announced.clone(), keys.len() as u64);
        let message = keys.join("\n");
        tokio::spawn(async move {
            let count = |r: Result<i64, _>| match r {
                Ok(_) => announced.0.fetch_add(n, Relaxed),
                Err(_) => announced.1.fetch_add(1, Relaxed),
            };
            count(pool.next().publish(channel.as_str(), &message).await);
            if let Some(write) = write {
                let _ = write.await;
                count(pool.next().publish(channel.as_str(), message).await);
            }
        });
    }

    async fn publish(&self, keys: &[String]) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let message = keys.join("\n");
        let publish = self
            .pool
            .next()
            .publish::<i64, _, _>(self.channel.as_str(), message);
        match tokio::time::timeout(self.write_timeout, publish).await {
            Ok(r) => r.map(|_| ()).map_err(store_error),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    async fn subscribe(&self, sink: InvalidationSink) -> Result<(), StoreError> {
        let sub = self
            .builder
            .build_subscriber_client()
            .map_err(store_error)?;
        sub.init().await.map_err(store_error)?;
        sub.subscribe(self.channel.as_str())
            .await
            .map_err(store_error)?;
        self.check_subscribed(&sub).await?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        // Heartbeat: an idle subscription has no command in flight, so a dead socket would go unnoticed
        // (an unanswered PING trips the unresponsive check, which reconnects, which flushes: below), and
        // a server's idle `timeout` would close its connections, each node's on a cluster.
        tokio::spawn(heartbeat(
            vec![sub.clone()],
            SUBSCRIBER_HEARTBEAT,
            self.unresponsive,
            stop_rx.clone(),
        ));
        let mut messages = sub.message_rx();
        // Taken after `init`, so the first connection's event has passed: every event is a reconnection.
        let mut reconnects = sub.reconnect_rx();
        let task_sub = sub.clone();
        let task_pool = self.pool.clone();
        let channel = self.channel.clone();
        let clustered = self.clustered;
        let mut stop = stop_rx;
        let mut moves = self.moves.subscribe();
        tokio::spawn(async move {
            // The proof of the last resubscription, while it runs (aborted by the next reconnection).
            let mut proving: Option<tokio::task::JoinHandle<()>> = None;
            loop {
                tokio::select! {
                    _ = stop.changed() => break,
                    // The master moved (a Sentinel fail-over): the subscription is on the old one,
                    // which no longer hears the writes. The reconnection (below) flushes.
                    Ok(()) = moves.changed() => {
                        if let Err(e) = task_sub.force_reconnection().await {
                            tracing::warn!("invalidation channel: reconnecting to the new master failed (fred retries): {e}");
                        }
                    }
                    m = messages.recv() => match m {
                        Ok(m) => {
                            let keys = match m.value {
                                Value::String(s) => split_keys(&s),
                                Value::Bytes(b) => split_keys(&String::from_utf8_lossy(&b)),
                                _ => Vec::new(),
                            };
                            if !keys.is_empty() {
                                sink(Invalidation::Keys(keys));
                            }
                        }
                        // The task fell behind and messages were dropped.
                        Err(RecvError::Lagged(_)) => sink(Invalidation::All),
                        Err(RecvError::Closed) => break,
                    },
                    r = reconnects.recv() => match r {
                        Ok(_) | Err(RecvError::Lagged(_)) => {
                            // On a cluster each node's connection announces itself, within a few ms of
                            // the others: one flush for them all. The announcements queued by then are
                            // taken here; one that comes after the resubscription makes another round.
                            if clustered {
                                tokio::select! {
                                    _ = stop.changed() => break,
                                    () = tokio::time::sleep(RECONNECT_SETTLE) => {}
                                }
                            }
                            let mut connections = 1usize;
                            loop {
                                match reconnects.try_recv() {
                                    Ok(_) => connections += 1,
                                    Err(TryRecvError::Lagged(n)) => {
                                        connections += usize::try_from(n).unwrap_or(usize::MAX);
                                    }
                                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                                }
                            }
                            // Resubscribe first, so nothing written after the flush can be missed.
                            if let Err(e) = task_sub.resubscribe_all().await {
                                tracing::warn!("invalidation channel: resubscribing failed: {e}");
                            }
                            tracing::info!(
                                connections,
                                "invalidation channel reconnected: flushing the feature cache"
                            );
                            sink(Invalidation::All);
                            // A SUBSCRIBE refused (an ACL edited meanwhile) fails in silence, and the
                            // replica would never hear a write again: proven by an echo, beside the
                            // messages, and tried again until it holds.
                            if let Some(old) = proving.take() {
                                old.abort();
                            }
                            proving = Some(tokio::spawn(prove_resubscribed(
                                task_pool.clone(),
                                task_sub.clone(),
                                channel.clone(),
                                sink.clone(),
                                stop.clone(),
                            )));
                        }
                        Err(RecvError::Closed) => break,
                    },
                }
            }
            if let Some(p) = proving {
                p.abort();
            }
            let _ = task_sub.quit().await;
        });
        if let Some(old) = self.subscriber.lock().replace(stop_tx) {
            let _ = old.send(true);
        }
        Ok(())
    }

    /// Proves at start-up that `sub` hears the invalidation channel ([`echoes`]); refused, the
    /// subscriber is closed and the error says what to grant.
    async fn check_subscribed(
        &self,
        sub: &fred::clients::SubscriberClient,
    ) -> Result<(), StoreError> {
        let channel = self.channel.as_str();
        match echoes(&self.pool, sub, channel, false).await {
            Ok(()) => Ok(()),
            Err(why) => {
                let _ = sub.quit().await;
                Err(StoreError::Unavailable(format!(
                    "{why}: the Redis user most likely has no pub/sub access to the invalidation channel `{channel}` (Redis 7 gives new ACL users none), so this replica would never hear of a write through another: grant it, e.g. ACL SETUSER <user> '&{channel}' (or allchannels)"
                )))
            }
        }
    }

    async fn incr_hot(&self, counts: &[HotCounts], keep: usize) -> Result<(), StoreError> {
        let keep = i64::try_from(keep).unwrap_or(i64::MAX);
        let mut ops = Vec::new();
        for c in counts.iter().filter(|c| !c.keys.is_empty()) {
            let key = self.hot_key(&c.view);
            for (member, n) in &c.keys {
                let args = vec![
                    Value::from(key.as_str()),
                    Value::from(f64::from(*n)),
                    Value::from(member.as_str()),
                ];
                ops.push(Op::write("ZINCRBY", args));
            }
            // Ranks ascend with the score: drop everything below the `keep` hottest.
            let args = vec![Value::from(key), Value::from(0), Value::from(-keep - 1)];
            ops.push(Op::write("ZREMRANGEBYRANK", args));
        }
        // Each view's commands stand alone: one view's set holding another Redis type (written by
        // something else) fails that view's, not the others', nor their decay.
        let results = cluster::run(self.pool.next(), &self.newcomers, &ONCE, &ops).await;
        let mut results = results.into_iter();
        let mut failed = None;
        let mut flushed = false;
        {
            let mut views = self.hot_views.lock();
            for c in counts.iter().filter(|c| !c.keys.is_empty()) {
                let mut ok = true;
                for r in results.by_ref().take(c.keys.len() + 1) {
                    if let Err(e) = r {
                        ok = false;
                        failed.get_or_insert_with(|| {
                            StoreError::Io(format!(
                                "the hot set of view `{}` ({}): {}",
                                c.view,
                                self.hot_key(&c.view),
                                store_error(e)
                            ))
                        });
                    }
                }
                if ok {
                    flushed = true;
                    if !views.contains(&c.view) {
                        views.insert(c.view.clone());
                    }
                }
            }
        }
        if flushed
            && self.flushes.fetch_add(1, Relaxed) % DECAY_EVERY_FLUSHES == DECAY_EVERY_FLUSHES - 1
        {
            self.decay_hot().await?;
        }
        failed.map_or(Ok(()), Err)
    }

    /// Halves the hot sets' scores, so yesterday's hot keys give way; at most once per [`DECAY_LOCK`] across
    /// all replicas (the first to set the lock key does it). Every replica first adds the views whose
    /// hot sets it writes to `{prefix}:hot-views`, and the one that decays halves every view listed
    /// there: replicas that serve different views each sample their own, and one replica's decay must
    /// not leave the others' sets growing. A set found gone is taken off the list.
    async fn decay_hot(&self) -> Result<(), StoreError> {
        let client = self.pool.next();
        let listed = format!("{}:hot-views", self.prefix);
        let mine: Vec<String> = self.hot_views.lock().iter().cloned().collect();
        // Best effort: without the list, this replica still halves its own views below.
        if !mine.is_empty() {
            let mut args = vec![Value::from(listed.as_str())];
            args.extend(mine.iter().map(|v| Value::from(v.as_str())));
            let added =
                cluster::run(client, &self.newcomers, &ONCE, &[Op::write("SADD", args)]).await;
            if let Err(e) = one(added) {
                tracing::warn!("cannot list this replica's hot views in {listed}: {e}");
            }
        }
        let lock = format!("{}:hot-decay", self.prefix);
        let px = i64::try_from(DECAY_LOCK.as_millis()).unwrap_or(i64::MAX);
        let take = Op::write(
            "SET",
            vec![
                Value::from(lock),
                Value::from("1"),
                Value::from("PX"),
                Value::from(px),
                Value::from("NX"),
            ],
        );
        let won = one(cluster::run(client, &self.newcomers, &Options::default(), &[take]).await)?;
        // `SET ... NX` answers nil when the key was set already: another replica decays.
        if won.is_null() {
            return Ok(());
        }
        let members = Op::read("SMEMBERS", vec![Value::from(listed.as_str())]);
        let listing = cluster::run(client, &self.newcomers, &self.read, &[members]).await;
        let mut views = match one(listing) {
            Ok(Value::Array(items)) => items
                .into_iter()
                .filter_map(|v| v.into_string())
                .collect::<Vec<String>>(),
            Ok(_) => Vec::new(),
            // This replica's own views are halved all the same.
            Err(e) => {
                tracing::warn!(
                    "cannot read the hot views listed in {listed}: {e}; halving this replica's own"
                );
                Vec::new()
            }
        };
        for v in mine {
            if !views.contains(&v) {
                views.push(v);
            }
        }
        let halve = views
            .iter()
            .map(|view| {
                let key = self.hot_key(view);
                let args = vec![
                    Value::from(key.as_str()),
                    Value::from(1),
                    Value::from(key),
                    Value::from("WEIGHTS"),
                    Value::from(0.5),
                ];
                Op::write("ZUNIONSTORE", args)
            })
            .collect::<Vec<_>>();
        // As in the flush: one view's set of another type does not stop the others' decay.
        // Halving twice would halve too much: one attempt, as the flush's increments.
        let results = cluster::run(client, &self.newcomers, &ONCE, &halve).await;
        let mut failed = None;
        let mut gone = vec![Value::from(listed.as_str())];
        for (view, r) in views.iter().zip(results) {
            match r {
                // The union of a set that is gone is empty, and stores nothing.
                Ok(Value::Integer(0)) => gone.push(Value::from(view.as_str())),
                Ok(_) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if gone.len() > 1 {
            let _ = cluster::run(client, &self.newcomers, &ONCE, &[Op::write("SREM", gone)]).await;
        }
        failed.map_or(Ok(()), |e| Err(store_error(e)))
    }

    async fn top(&self, view: &str, k: usize) -> Result<Vec<String>, StoreError> {
        if k == 0 {
            return Ok(Vec::new());
        }
        let stop = i64::try_from(k).unwrap_or(i64::MAX) - 1;
        let range = Op::read(
            "ZREVRANGE",
            vec![
                Value::from(self.hot_key(view)),
                Value::from(0),
                Value::from(stop),
            ],
        );
        let client = self.pool.next_connected();
        let members = match one(cluster::run(
            client,
            &self.newcomers,
            &Options::default(),
            &[range],
        )
        .await)?
        {
            Value::Array(members) => members,
            Value::Null => Vec::new(),
            other => {
                return Err(StoreError::Io(format!(
                    "ZREVRANGE answered {:?}, not an array",
                    other.kind()
                )));
            }
        };
        // A member that is not text (written by another tool) names no key a request can send: it is
        // skipped, not allowed to stop the view's whole warm start.
        let mut keys = Vec::with_capacity(members.len());
        let mut skipped = 0usize;
        for m in members {
            match m {
                Value::String(s) => keys.push(s.to_string()),
                Value::Bytes(b) => match String::from_utf8(b.to_vec()) {
                    Ok(s) => keys.push(s),
                    Err(_) => skipped += 1,
                },
                _ => skipped += 1,
            }
        }
        if skipped > 0 {
            tracing::warn!(
                view,
                skipped,
                "the hot set {} holds members that are not UTF-8 text (not written by hydrant): skipped",
                self.hot_key(view)
            );
        }
        Ok(keys)
    }
}

/// Since when each pooled client's reads have gone unanswered, in ms since `epoch` (0 while it answers).
/// fred takes a connection for dead when a command has waited its bound, timed from the connection's
/// latest write; while requests keep reading, that never comes for a server that stopped answering but
/// whose host still acknowledges (frozen, or deposed by a Sentinel fail-over and not yet told), and
/// `TCP_USER_TIMEOUT` does not fire either. A client whose reads have gone unanswered this long is made
/// to reconnect, which through Sentinel finds the new master. (Cluster reads are left to fred: a node's
/// stall is not the client's.)
struct Stalls {
    epoch: Instant,
    since: Box<[AtomicU64]>,
    /// How long a client's reads may go unanswered before it is made to reconnect, in ms.
    bound_ms: u64,
    logged: crate::telemetry::Throttle,
}

impl Stalls {
    fn new(clients: usize, bound: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            since: (0..clients).map(|_| AtomicU64::new(0)).collect(),
            bound_ms: u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
            logged: crate::telemetry::Throttle::new(Duration::from_secs(10)),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// A read about to be sent on `client` of `pool`.
    fn watch<'a>(&'a self, pool: &Pool, client: &'a fred::clients::Client) -> ReadWatch<'a> {
        ReadWatch {
            stalls: self,
            place: pool.clients().iter().position(|c| std::ptr::eq(c, client)),
            client,
            sent_ms: self.now_ms(),
            answered: false,
        }
    }
}

/// A read in flight: when it ends, answered or not (given up on, or its request gone), it updates its
/// client's stall record, and makes the client reconnect when the record is older than the bound.
struct ReadWatch<'a> {
    stalls: &'a Stalls,
    place: Option<usize>,
    client: &'a fred::clients::Client,
    sent_ms: u64,
    answered: bool,
}

impl Drop for ReadWatch<'_> {
    fn drop(&mut self) {
        let Some(since) = self.place.and_then(|i| self.stalls.since.get(i)) else {
            return;
        };
        if self.answered {
            since.store(0, Relaxed);
            return;
        }
        let first = match since.compare_exchange(0, self.sent_ms, Relaxed, Relaxed) {
            Ok(_) => return,
            Err(first) => first,
        };
        let stalled = self.stalls.now_ms().saturating_sub(first);
        // One reconnection per stall: whoever clears the record makes it.
        if stalled <= self.stalls.bound_ms
            || since.compare_exchange(first, 0, Relaxed, Relaxed).is_err()
        {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if let Some(more) = self.stalls.logged.admit_reason("stalled") {
            tracing::warn!(
                client = %self.client.id(),
                more_since_last_line = more,
                "Redis (store.redis.url) answered no read on this connection for {stalled} ms: reconnecting (a frozen server, or a master a fail-over deposed)"
            );
        }
        let client = self.client.clone();
        rt.spawn(async move {
            let _ = client.force_reconnection().await;
        });
    }
}

/// After a reconnection whose resubscription did not hold, the first wait before trying again; it doubles
/// up to [`RESUBSCRIBE_MAX_WAIT`].
const RESUBSCRIBE_FIRST_WAIT: Duration = Duration::from_millis(250);
const RESUBSCRIBE_MAX_WAIT: Duration = Duration::from_secs(5);

/// After a reconnection (whose resubscription `sub` has sent, and whose flush is done): proves by an echo
/// that `sub` hears `channel`, and where it does not, subscribes again and tries again (every
/// [`RESUBSCRIBE_FIRST_WAIT`], doubling to [`RESUBSCRIBE_MAX_WAIT`]) until it does, then flushes the cache
/// again, since writes made meanwhile were not heard. Meanwhile other replicas' writes reach this one at
/// the view's `cache.ttl`; a warning says so (then about once a minute while it lasts).
async fn prove_resubscribed(
    pool: Pool,
    sub: fred::clients::SubscriberClient,
    channel: String,
    sink: InvalidationSink,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut wait = RESUBSCRIBE_FIRST_WAIT;
    let mut failures = 0u32;
    loop {
        let attempt = async {
            if failures > 0 {
                sub.subscribe(channel.as_str())
                    .await
                    .map_err(|e| format!("subscribing failed: {e}"))?;
            }
            echoes(&pool, &sub, &channel, true).await
        };
        let outcome = tokio::select! {
            _ = stop.changed() => return,
            r = attempt => r,
        };
        let Err(why) = outcome else {
            if failures > 0 {
                tracing::info!(
                    "invalidation channel `{channel}`: subscribed again after {failures} failed attempt(s): flushing the feature cache"
                );
                sink(Invalidation::All);
            }
            return;
        };
        failures += 1;
        if failures == 1 || failures.is_multiple_of(12) {
            tracing::warn!(
                "invalidation channel `{channel}`: the subscription made after a reconnection is not proven to hear it ({why}): subscribing again every {:?} or less; meanwhile writes through other replicas reach this one only at the view's cache.ttl",
                RESUBSCRIBE_MAX_WAIT
            );
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(RESUBSCRIBE_MAX_WAIT);
    }
}

/// Proves that `sub` hears `channel`: Redis refuses a `SUBSCRIBE` by an ACL user without pub/sub access
/// (Redis 7's default for a new user, or an ACL edited while the subscriber reconnected), and the client
/// does not pass that refusal on, so a replica would run without ever hearing an announcement. An empty
/// message (no keys: every replica ignores it) is published on the channel and must come back; `Err`
/// says why it did not. Where publishing itself fails for another reason than a refusal, nothing can be
/// proven: at start-up (`strict` false) the failure is only logged (writes will say so too); after a
/// reconnection it is an `Err`, and the proof is tried again.
async fn echoes(
    pool: &Pool,
    sub: &fred::clients::SubscriberClient,
    channel: &str,
    strict: bool,
) -> Result<(), String> {
    /// How long the echo may take: a round trip to a store that just answered, on a busy machine.
    const ECHO_WAIT: Duration = Duration::from_secs(3);
    /// How often the message is published again meanwhile: the client answers `subscribe` before the
    /// server has taken the `SUBSCRIBE`, and a message published before that is not delivered.
    const REPUBLISH: Duration = Duration::from_millis(100);
    let mut heard = sub.message_rx();
    let until = Instant::now() + ECHO_WAIT;
    loop {
        let left = until
            .saturating_duration_since(Instant::now())
            .max(REPUBLISH);
        let published =
            match tokio::time::timeout(left, pool.next().publish::<i64, _, _>(channel, "")).await {
                Ok(r) => r.map(drop).map_err(|e| e.to_string()),
                Err(_) => Err(format!("no answer within {left:?}")),
            };
        if let Err(e) = published {
            // The same user subscribes and publishes: refused one, it was refused the other.
            if e.contains("NOPERM") {
                return Err(format!("publishing on the channel was refused ({e})"));
            }
            if strict {
                return Err(format!("publishing on the channel failed ({e})"));
            }
            tracing::warn!(
                "cannot check the subscription to the invalidation channel `{channel}`: publishing on it failed: {e}"
            );
            return Ok(());
        }
        let echo = tokio::time::timeout(REPUBLISH, async {
            loop {
                match heard.recv().await {
                    Ok(m) if m.channel == channel => return true,
                    Ok(_) => {}
                    Err(RecvError::Lagged(_)) => return true,
                    Err(RecvError::Closed) => return false,
                }
            }
        })
        .await;
        match echo {
            Ok(true) => return Ok(()),
            Ok(false) => return Err("the subscriber's connection closed".to_owned()),
            Err(_) if Instant::now() >= until => break,
            Err(_) => {}
        }
    }
    Err(format!(
        "messages published on the invalidation channel did not come back to its subscriber within {ECHO_WAIT:?}"
    ))
}

/// How often [`heartbeat`] pings the pool: every [`POOL_HEARTBEAT`], or within a third of the server's
/// idle `timeout` when that is shorter. A server that does not say (an ACL without `CONFIG`) is pinged
/// every [`POOL_HEARTBEAT`], and the log says so.
async fn pool_heartbeat(pool: &Pool, limit: Duration) -> Duration {
    let config =
        fred::types::CustomCommand::new_static("CONFIG", fred::types::ClusterHash::Random, false);
    let reply = tokio::time::timeout(
        limit,
        pool.next()
            .custom::<Value, &str>(config, vec!["GET", "timeout"]),
    )
    .await;
    let idle = match &reply {
        Ok(Ok(Value::Array(pair))) => pair.get(1).and_then(Value::as_u64),
        Ok(Ok(Value::Map(map))) => map.clone().inner().values().next().and_then(Value::as_u64),
        _ => None,
    };
    match (idle, reply) {
        (Some(secs), _) if secs > 0 => POOL_HEARTBEAT.min(Duration::from_secs(secs) / 3),
        (Some(_), _) => POOL_HEARTBEAT,
        (None, reply) => {
            let why = match reply {
                Ok(Ok(other)) => format!("an answer of {other:?}"),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {limit:?}"),
            };
            tracing::info!(
                "Redis did not say its idle timeout (CONFIG GET timeout: {why}); pooled connections are pinged every {}s, so a server `timeout` under {}s closes the idle ones (fred reconnects them, with a warning)",
                POOL_HEARTBEAT.as_secs(),
                POOL_HEARTBEAT.as_secs() * 3
            );
            POOL_HEARTBEAT
        }
    }
}

/// Pings every connection of `clients` (each node's, on a cluster) every `every` until `stop`, the
/// clients spread over the period: a server whose idle `timeout` is set would otherwise close a quiet
/// replica's connections (fred reconnects, logging a warning for each; a request in that moment is
/// served degraded; the subscriber flushes the cache), and a connection that died silently would be
/// found by a request's read timing out rather than by a ping, whose missing answer trips fred's
/// unresponsive check after `unresponsive`, which reconnects.
pub(super) async fn heartbeat<C: ClientLike>(
    clients: Vec<C>,
    every: Duration,
    unresponsive: Duration,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let n = u32::try_from(clients.len()).unwrap_or(u32::MAX).max(1);
    let beats = clients.iter().zip(0u32..).map(|(client, i)| {
        let mut stop = stop.clone();
        async move {
            let first = tokio::time::Instant::now() + every + every * i / n;
            let mut tick = tokio::time::interval_at(first, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tick.tick() => {}
                }
                // Awaited to its answer or its connection's end: fred times a connection out from its
                // latest write, so a second ping sent while the first is unanswered would keep a dead
                // connection from ever being found.
                tokio::select! {
                    _ = stop.changed() => return,
                    () = ping_every_node(client, unresponsive * 2) => {}
                }
            }
        }
    });
    futures::future::join_all(beats).await;
}

/// One heartbeat `PING` on each of `client`'s connections (each node's on a cluster, else the
/// server's), each waited for up to `limit`. A failure is the reconnection's to report.
async fn ping_every_node<C: ClientLike>(client: &C, limit: Duration) {
    if !client.is_connected() {
        return;
    }
    let nodes = if client.is_clustered() {
        client.active_connections()
    } else {
        Vec::new()
    };
    if nodes.is_empty() {
        let to = client.with_options(&ONCE);
        let _ = tokio::time::timeout(limit, to.ping::<Value>(None)).await;
        return;
    }
    let pings = nodes.into_iter().map(|n| {
        let to = client.with_options(&Options {
            cluster_node: Some(n),
            ..ONCE
        });
        async move {
            let _ = tokio::time::timeout(limit, to.ping::<Value>(None)).await;
        }
    });
    futures::future::join_all(pings).await;
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        // Close the pool's connections (unless `close` did); without a runtime (process exit) there is
        // nothing left to close.
        if !self.stop_and_claim_close() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (pool, newcomers) = (self.pool.clone(), self.newcomers.clone());
            rt.spawn(async move {
                newcomers.close().await;
                let _ = pool.quit().await;
            });
        }
    }
}

/// A rustls connector that trusts the CA certificates of a PEM file (and nothing else).
fn tls_trusting(path: &std::path::Path) -> anyhow::Result<TlsConnector> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let bad = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "store.redis.tls_ca_file {}: not a readable PEM file of certificates: {e}",
            path.display()
        )
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(&e))? {
        roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
    }
    if roots.is_empty() {
        return Err(bad(&"it holds no certificate"));
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config.into())
}

fn split_keys(s: &str) -> Vec<String> {
    s.split('\n')
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect()
}

/// One reply of a read: the record's bytes, or `None` for a missing key.
fn record_bytes(v: Value) -> Result<Option<Vec<u8>>, StoreError> {
    match v {
        Value::Null => Ok(None),
        Value::Bytes(b) => Ok(Some(b.to_vec())),
        Value::String(s) => Ok(Some(s.as_bytes().to_vec())),
        other => Err(StoreError::Io(format!(
            "a read answered {:?}, not a string",
            other.kind()
        ))),
    }
}

/// The answer of a single command run by [`cluster::run`].
fn one(mut answers: Vec<Result<Value, FredError>>) -> Result<Value, StoreError> {
    answers
        .pop()
        .unwrap_or_else(|| Ok(Value::Null))
        .map_err(store_error)
}

fn store_error(e: FredError) -> StoreError {
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout,
        // Canceled: fail-fast while disconnected; Backpressure: the command buffer is full.
        ErrorKind::Canceled | ErrorKind::Backpressure | ErrorKind::IO => {
            StoreError::Unavailable(words(&e, false))
        }
        _ => StoreError::Io(words(&e, false)),
    }
}

/// `e` in words. The client carries a system error as its `Debug` text (`IO Error: Os { code: 111,
/// kind: ConnectionRefused, message: "Connection refused" }`): that becomes its message, with what the
/// usual ones mean for a Redis URL.
fn words(e: &FredError, connecting: bool) -> String {
    let d = e.details();
    if *e.kind() != ErrorKind::IO {
        return e.to_string();
    }
    let field = |name: &str| {
        d.split_once(name)
            .map(|(_, rest)| rest.trim_start_matches('"'))
            .and_then(|rest| rest.split(['"', ',', ' ', '}', ')']).next())
    };
    let message = d
        .split_once("message: \"")
        .or_else(|| d.split_once("error: \""))
        .and_then(|(_, rest)| rest.split('"').next());
    let Some(message) = message.or_else(|| field("Kind(")) else {
        return e.to_string();
    };
    let hint = match field("kind: ").or_else(|| field("Kind(")) {
        Some("ConnectionRefused") => {
            ": nothing listens at that host and port; is redis-server running there?"
        }
        // On a connection that was answering (a restart, a shutdown, `CLIENT KILL`), TLS is no suspect.
        Some("ConnectionReset") if connecting => {
            ": the server closed the connection; if it speaks TLS only, use rediss://"
        }
        Some("ConnectionReset") => ": the server closed the connection",
        _ => "",
    };
    format!("{message}{hint}")
}

/// `d` in whole milliseconds, as fred's reconnect policies take it.
pub(super) fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// The timeouts of every connection hydrant opens to Redis or a sentinel: `connect_timeout` to
/// connect and for fred's own commands, and a connection taken for dead after `unresponsive`.
pub(super) fn watch_connection(
    c: &mut fred::types::config::ConnectionConfig,
    connect_timeout: Duration,
    unresponsive: Duration,
) {
    c.connection_timeout = connect_timeout;
    c.internal_command_timeout = connect_timeout;
    // A connection that stops answering (a frozen server, a half-open socket) is closed and
    // reconnected; for a subscriber this is how a dead subscription is noticed.
    c.unresponsive = UnresponsiveConfig {
        max_timeout: Some(unresponsive),
        interval: unresponsive / 4,
    };
    // fred times a connection out from its latest write, so under steady traffic a connection to a
    // host that is gone (crashed, partitioned away: nothing acknowledges) is never found by that
    // check, and TCP would retry for some 15 minutes, backing off to tens of seconds between tries,
    // so it stays stuck well after the path heals. The kernel's own bound on data left
    // unacknowledged ends it after `unresponsive`; a busy or paused server still acknowledges, so it
    // is not cut off by this.
    c.tcp.user_timeout = Some(unresponsive);
}

/// Whether the server behind `pool` is a node of a Redis Cluster (INFO's `cluster_enabled:1`); not
/// when INFO cannot be read (an ACL that refuses it).
async fn cluster_node(pool: &Pool) -> bool {
    let info = pool
        .next()
        .info::<String>(Some(fred::types::InfoKind::Cluster));
    match tokio::time::timeout(Duration::from_secs(2), info).await {
        Ok(Ok(text)) => text.lines().any(|l| l.trim() == "cluster_enabled:1"),
        _ => false,
    }
}

/// The master a sentinel URL follows (`sentinelServiceName`), which is no secret.
fn sentinel_service(url: &str) -> Option<&str> {
    let query = url.split_once('?')?.1;
    query
        .split('&')
        .find_map(|p| p.strip_prefix("sentinelServiceName="))
}

impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        "redis"
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.stop_and_claim_close() {
                self.newcomers.close().await;
                let _ = self.pool.quit().await;
            }
        })
    }

    fn keeps_hot_keys(&self) -> bool {
        true
    }

    fn shared(&self) -> bool {
        true
    }

    fn background_announcements(&self) -> (u64, u64) {
        (
            self.announced.0.load(Relaxed),
            self.announced.1.load(Relaxed),
        )
    }

    fn get_many<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        Box::pin(async move {
            if keys.is_empty() {
                return Ok(Vec::new());
            }
            self.read(keys).await
        })
    }

    fn put_many(
        &self,
        writes: Writes,
        ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            if writes.is_empty() {
                return Ok(());
            }
            self.write(writes, ttl).await
        })
    }

    fn publish_invalidations<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.publish(keys))
    }

    fn subscribe_invalidations(
        &self,
        sink: InvalidationSink,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.subscribe(sink))
    }

    fn record_hot<'a>(
        &'a self,
        counts: &'a [HotCounts],
        keep: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.incr_hot(counts, keep))
    }

    fn hottest<'a>(
        &'a self,
        view: &'a str,
        k: usize,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(self.top(view, k))
    }
}

/// One batch of `SET ... PX`: a `MULTI`/`EXEC` on a standalone server, pipelined `SET`s on a cluster,
/// which can fail for some of `keys` (the batch's, in order) and not others.
async fn write_batch(
    client: fred::clients::Client,
    newcomers: Arc<cluster::Newcomers>,
    clustered: bool,
    writes: Writes,
    ttl: Option<Duration>,
    keys: Arc<[String]>,
) -> Result<(), StoreError> {
    let expire = ttl.map(|t| Expiration::PX(i64::try_from(t.as_millis()).unwrap_or(i64::MAX)));
    if clustered {
        let sets: Vec<Op> = writes
            .into_iter()
            .map(|(k, v)| {
                let mut args = vec![Value::from(k), Value::Bytes(Bytes::from(v))];
                if let Some(Expiration::PX(ms)) = expire {
                    args.extend([Value::from("PX"), Value::from(ms)]);
                }
                Op::write("SET", args)
            })
            .collect();
        let results = cluster::run(&client, &newcomers, &Options::default(), &sets).await;
        let mut failed = results
            .iter()
            .zip(keys.iter())
            .filter_map(|(r, k)| Some((k, r.as_ref().err()?)));
        let Some((key, first)) = failed.next() else {
            return Ok(());
        };
        let failed = 1 + failed.count();
        if failed == results.len() {
            return Err(store_error(first.clone()));
        }
        return Err(StoreError::Partial(format!(
            "{} of {} keys stored; {failed} not, the first of them {key}: {first}",
            results.len() - failed,
            results.len()
        )));
    }
    // MULTI, the SETs and EXEC as one pipeline of plain commands, each sent once (the connection's
    // `max_command_attempts`): fred sends its own transactions (`multi`, `exec`) again after a
    // reconnection whatever the attempts, and a batch sent again could land after its caller, told it
    // timed out, had written the keys anew. Redis applies the batch whole or, when the connection ends
    // before EXEC, not at all.
    let p = client.pipeline();
    let multi =
        fred::types::CustomCommand::new_static("MULTI", fred::types::ClusterHash::Random, false);
    let exec =
        fred::types::CustomCommand::new_static("EXEC", fred::types::ClusterHash::Random, false);
    let _: () = p
        .custom(multi, Vec::<Value>::new())
        .await
        .map_err(store_error)?;
    queue_sets(&p, writes, expire).await?;
    let _: () = p
        .custom(exec, Vec::<Value>::new())
        .await
        .map_err(store_error)?;
    // A SET refused while queued (out of memory) is answered with its error, and EXEC with EXECABORT:
    // the first error says why.
    match p.try_all::<Value>().await.into_iter().find_map(Result::err) {
        Some(e) => Err(store_error(e)),
        None => Ok(()),
    }
}

/// Queues one `SET key value [PX ttl]` per write on a pipeline (which queues, not sends).
async fn queue_sets<C: KeysInterface + Sync>(
    c: &C,
    writes: Writes,
    expire: Option<Expiration>,
) -> Result<(), StoreError> {
    for (k, v) in writes {
        let _: () = c
            .set(k, Value::Bytes(Bytes::from(v)), expire.clone(), None, false)
            .await
            .map_err(store_error)?;
    }
    Ok(())
}

/// The store as a shared trait object (what [`crate::app::open_store`] hands out).
pub async fn open(cfg: &RedisConfig, prefix: &str) -> anyhow::Result<Arc<dyn Store>> {
    Ok(Arc::new(RedisStore::connect(cfg, prefix).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_errors_are_put_in_words_with_what_they_mean_for_the_url() {
        let refused = FredError::from(std::io::Error::from_raw_os_error(111));
        assert_eq!(
            words(&refused, true),
            "Connection refused: nothing listens at that host and port; is redis-server running there?"
        );
        let reset = FredError::from(std::io::Error::from_raw_os_error(104));
        assert_eq!(
            words(&reset, true),
            "Connection reset by peer: the server closed the connection; if it speaks TLS only, use rediss://"
        );
        // A command on a connection that was answering: no TLS hint.
        assert_eq!(
            words(&reset, false),
            "Connection reset by peer: the server closed the connection"
        );
        let custom = FredError::from(std::io::Error::other("tls handshake eof"));
        assert_eq!(words(&custom, true), "tls handshake eof");
        let bare = FredError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(words(&bare, true), "TimedOut");
        // Anything else keeps the client's words.
        let other = FredError::new(ErrorKind::Auth, "WRONGPASS invalid username-password pair");
        assert_eq!(words(&other, true), other.to_string());
    }

    #[test]
    fn the_sentinel_service_is_read_from_the_query() {
        assert_eq!(
            sentinel_service("redis-sentinel://:pw@h:26379/0?node=h2:26379&sentinelServiceName=m1"),
            Some("m1")
        );
        assert_eq!(sentinel_service("redis-sentinel://h:26379"), None);
    }
}
