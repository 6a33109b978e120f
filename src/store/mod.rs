//! Storage backends for feature records: the embedded file store and Redis, behind one [`Store`] trait.
//!
//! A store maps full keys (`{prefix}:{view}:{entity_key}`) to encoded [`crate::value::Record`]s. Reads come in
//! batches so a whole request's misses cost one round trip; writes come in batches so a bulk load is atomic
//! per batch.
//!
//! A store shared by several replicas (Redis) also carries what the replicas tell each other: which keys a
//! write changed (so each drops them from its cache) and which keys are hot (so a starting replica can load
//! them before it reports ready). The trait's defaults do nothing, which is right for a store only one
//! process reads.

mod cluster;
pub mod embedded;
pub mod redis;
mod sentinel;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use embedded::EmbeddedStore;
pub use redis::RedisStore;

/// A boxed future, so stores can sit behind `dyn Store`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a store call failed. The request path turns these into degraded answers, never 5xx.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store deadline exceeded")]
    Timeout,
    #[error("store I/O error: {0}")]
    Io(String),
    /// A batch of writes that failed for some keys and was stored for the others (a cluster's
    /// pipelined SETs): the message says how many of each, and why.
    #[error("batch written in part: {0}")]
    Partial(String),
}

/// A batch of writes: full key, encoded record.
pub type Writes = Vec<(String, Vec<u8>)>;

pub trait Store: Send + Sync + 'static {
    /// `embedded` or `redis`, for metrics and logs.
    fn backend(&self) -> &'static str;

    /// Closes the store's connections and waits for that, for a command about to exit. Dropping the store
    /// closes them too, but in the background, which an exiting runtime may cut short.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Reads every key in one round trip; `None` where a key does not exist.
    fn get_many<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>>;

    /// Writes every record atomically where the backend allows it, with an expiry when `ttl` is set.
    fn put_many(
        &self,
        writes: Writes,
        ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Tells every replica that `keys` changed, so each drops them from its cache.
    fn publish_invalidations<'a>(
        &'a self,
        _keys: &'a [String],
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// The announcements the store made on its own, from the background, for a write that failed but may
    /// have landed: (keys announced, announcements that failed). Added to the gateway's own counts in
    /// `hydrant_invalidations_total`.
    fn background_announcements(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Delivers other replicas' [`Invalidation`]s to `sink` from now on, for as long as the store lives;
    /// resolves once subscribed. After the subscription reconnects it delivers [`Invalidation::All`]: messages
    /// sent while it was down are lost.
    fn subscribe_invalidations(
        &self,
        _sink: InvalidationSink,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// Whether other replicas share the store, so a write is announced to them
    /// ([`Store::publish_invalidations`]). An embedded file serves one process: nothing to announce.
    fn shared(&self) -> bool {
        false
    }

    /// Whether the store keeps hot-key sets ([`Store::record_hot`], [`Store::hottest`]). When it does not,
    /// the gateway samples no lookups and runs no flusher.
    fn keeps_hot_keys(&self) -> bool {
        false
    }

    /// Adds sampled lookup counts to the views' hot sets, keeping the `keep` hottest keys of each.
    fn record_hot<'a>(
        &'a self,
        _counts: &'a [HotCounts],
        _keep: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// The `k` hottest entity keys of `view`, hottest first.
    fn hottest<'a>(
        &'a self,
        _view: &'a str,
        _k: usize,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async { Ok(Vec::new()) })
    }
}

/// What changed in the store, as one replica tells the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalidation {
    /// These full keys were written.
    Keys(Vec<String>),
    /// Announcements may have been missed: anything may have changed.
    All,
}

/// Where a store delivers invalidations. Called on the subscriber's task: it must not block.
pub type InvalidationSink = Arc<dyn Fn(Invalidation) + Send + Sync>;

/// Sampled lookups of one view: entity keys and how often each was sampled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HotCounts {
    pub view: String,
    pub keys: Vec<(String, u32)>,
}

/// The store key of an entity in a view. View names never contain `:`, so no entity key, whatever
/// characters it holds, can produce another view's key.
pub fn key(prefix: &str, view: &str, entity_key: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + view.len() + entity_key.len() + 2);
    write_key(&mut k, prefix, view, entity_key);
    k
}

/// Like [`key`], into a reused buffer.
pub fn write_key(buf: &mut String, prefix: &str, view: &str, entity_key: &str) {
    buf.clear();
    buf.push_str(prefix);
    buf.push(':');
    buf.push_str(view);
    buf.push(':');
    buf.push_str(entity_key);
}
