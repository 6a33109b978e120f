//! Storage backends for feature records: the embedded file store and Redis, behind one [`Store`] trait.
//!
//! A store maps full keys (`{prefix}:{view}:{entity_key}`) to encoded [`crate::value::Record`]s. Reads come in
//! batches so a whole request's misses cost one round trip; writes come in batches so a bulk load is atomic
//! per batch.

pub mod embedded;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use embedded::EmbeddedStore;

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
}

/// A batch of writes: full key, encoded record.
pub type Writes = Vec<(String, Vec<u8>)>;

pub trait Store: Send + Sync + 'static {
    /// `embedded` or `redis`, for metrics and logs.
    fn backend(&self) -> &'static str;

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

/// The view name of a store key, if it has the expected shape.
pub fn view_of_key<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(':')?;
    rest.split_once(':').map(|(v, _)| v)
}
