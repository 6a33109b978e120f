//! The embedded store: records in a local redb file, so the gateway runs with no server at all.
//!
//! redb calls block (file I/O, fsync on commit), so every call runs on the blocking pool. Each record is
//! stored with its expiry time (0 = never) so `store.key_ttl` means the same here as in Redis.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use redb::{Builder, Database, DatabaseError, ReadableDatabase, StorageError, TableDefinition};

use super::{BoxFuture, Store, StoreError, Writes};
use crate::value::now_ms;

/// key -> (expires_at_ms or 0, record bytes)
const RECORDS: TableDefinition<&str, (i64, &[u8])> = TableDefinition::new("records");

/// redb's own page cache. hydrant caches decoded records in front of it, so a large one only duplicates
/// them (redb's default, 1 GiB, made a bulk load's memory grow with the file).
const PAGE_CACHE_BYTES: usize = 64 << 20;

/// A redb failure as a store error.
fn io(e: impl std::fmt::Display) -> StoreError {
    StoreError::Io(e.to_string())
}

#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The open database; `None` when opening it again after an I/O error failed.
    db: RwLock<Option<Database>>,
    /// Opens the file again (without the checks of a start).
    reopen: Box<dyn Fn() -> Result<Database, DatabaseError> + Send + Sync>,
    /// When opening it again was last tried, so that a failing reopen is not retried by every call.
    tried: Mutex<Option<Instant>>,
    /// The file, for messages.
    path: PathBuf,
}

/// The database's settings, on every open.
fn builder() -> Builder {
    let mut b = Builder::new();
    b.set_cache_size(PAGE_CACHE_BYTES);
    b
}

/// How often a store that could not be opened again is retried.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

impl EmbeddedStore {
    /// Opens (or creates) the store file, creating its folder if needed (`data/` on a fresh clone), but
    /// not the folders above it: a path whose folders do not exist is more likely a typo than a place
    /// meant for a store, and serving from it would answer every key as not found.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(_) if dir.is_dir() => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
                    "cannot create the embedded store folder {}: the folder above it does not exist (check store.embedded.path, or create it)",
                    dir.display()
                ),
                Err(e) => anyhow::bail!(
                    "cannot create the embedded store folder {}: {e}",
                    dir.display()
                ),
            }
        }
        let existed = path.exists();
        // redb would take an empty file for a new store; a store is never empty on disk, so this is a
        // placeholder or a copy that failed, and serving it would answer every key as not found.
        if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            anyhow::bail!(
                "the embedded store {} is an empty file, not a store: restore it from a copy, or remove it to start a new store and load the rows again (`hydrant load`)",
                path.display()
            );
        }
        // Every page's checksum is verified on open: a damaged file is refused here, with a message,
        // rather than panicking inside redb on the first read that meets the damage.
        let db = builder()
            .set_check_integrity_on_open(true)
            .create(path)
            .map_err(|e| match e {
                DatabaseError::Storage(StorageError::Corrupted(why)) => anyhow::anyhow!(
                    "the embedded store {} is damaged ({why}): restore it from a copy, or move it away and load the rows again (`hydrant load`)",
                    path.display()
                ),
                DatabaseError::DatabaseAlreadyOpen => anyhow::anyhow!(
                    "the embedded store {} is in use by another process (a running `hydrant serve` or `hydrant load`): stop it, or set store.embedded.path to another file",
                    path.display()
                ),
                e => anyhow::anyhow!("cannot open the embedded store {}: {e}", path.display()),
            })?;
        if !existed {
            // `hydrant serve` warns about it (a mistyped path would serve every key as not found); for
            // a first `hydrant load` it is what was meant.
            tracing::info!(path = %path.display(), "created a new, empty embedded store");
        }
        // Create the table up front so reads never see "table does not exist". Records past their
        // `key_ttl` are only hidden on read; they are removed here, at each start and each load, so the
        // file does not keep them for ever (Redis drops them itself).
        let tx = db.begin_write()?;
        let removed = {
            let mut table = tx.open_table(RECORDS).map_err(|e| match e {
                redb::TableError::TableTypeMismatch { .. } => anyhow::anyhow!(
                    "the embedded store {} holds a `records` table that hydrant did not write ({e}): store.embedded.path names another program's redb file",
                    path.display()
                ),
                e => anyhow::anyhow!("cannot open the embedded store {}: {e}", path.display()),
            })?;
            let now = now_ms();
            let mut removed = 0u64;
            table.retain(|_, (expires, _)| {
                let keep = expires == 0 || expires > now;
                removed += u64::from(!keep);
                keep
            })?;
            removed
        };
        tx.commit()?;
        if removed > 0 {
            tracing::info!(path = %path.display(), removed, "removed expired records (store.key_ttl) from the embedded store");
        }
        let file = path.to_owned();
        let reopen = move || builder().create(&file);
        Ok(Self::over(db, Box::new(reopen), path))
    }

    fn over(
        db: Database,
        reopen: Box<dyn Fn() -> Result<Database, DatabaseError> + Send + Sync>,
        path: &Path,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                db: RwLock::new(Some(db)),
                reopen,
                tried: Mutex::new(None),
                path: path.to_owned(),
            }),
        }
    }

    /// Runs `op` on the database. After a write fails on I/O (a full disk), redb refuses every later one
    /// (`PreviousIo`) until the database is opened again: that is done here, and `op` tried once more,
    /// so that the store writes again once the cause is gone, without a restart.
    fn with_db<T>(
        &self,
        op: impl Fn(&Database) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        {
            let db = self.inner.db.read();
            if let Some(db) = db.as_ref() {
                match op(db) {
                    Err(redb::Error::PreviousIo) => {}
                    other => return other.map_err(io),
                }
            }
        }
        self.reopen()?;
        let db = self.inner.db.read();
        let db = db.as_ref().ok_or_else(|| self.closed())?;
        op(db).map_err(io)
    }

    fn closed(&self) -> StoreError {
        StoreError::Unavailable(format!(
            "the embedded store {} failed on I/O and could not be opened again yet (see the log)",
            self.inner.path.display()
        ))
    }

    /// Opens the database again, unless another call already did since it failed.
    fn reopen(&self) -> Result<(), StoreError> {
        let mut db = self.inner.db.write();
        if let Some(open) = db.as_ref() {
            // Opened again by another call meanwhile: its writes go through.
            match open.begin_write().map_err(redb::Error::from) {
                Err(redb::Error::PreviousIo) => {}
                _ => return Ok(()),
            }
        } else if self
            .inner
            .tried
            .lock()
            .is_some_and(|at| at.elapsed() < REOPEN_EVERY)
        {
            return Err(self.closed());
        }
        *self.inner.tried.lock() = Some(Instant::now());
        // Closed first: the file is locked while it is open.
        *db = None;
        match (self.inner.reopen)() {
            Ok(again) => {
                tracing::warn!(
                    path = %self.inner.path.display(),
                    "the embedded store failed a write on I/O (a full disk?) and was opened again"
                );
                *db = Some(again);
                Ok(())
            }
            Err(e) => {
                tracing::error!(
                    path = %self.inner.path.display(),
                    "the embedded store failed on I/O and cannot be opened again (retried each second, on use): {e}"
                );
                Err(self.closed())
            }
        }
    }

    fn read(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        self.with_db(|db| {
            let tx = db.begin_read()?;
            let table = tx.open_table(RECORDS)?;
            let now = now_ms();
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                let v = table.get(k.as_str())?;
                out.push(v.and_then(|g| {
                    let (expires, bytes) = g.value();
                    (expires == 0 || expires > now).then(|| bytes.to_vec())
                }));
            }
            Ok(out)
        })
    }

    fn write(&self, writes: &Writes, ttl: Option<Duration>) -> Result<(), StoreError> {
        let expires = ttl.map_or(0, |t| {
            now_ms().saturating_add(i64::try_from(t.as_millis()).unwrap_or(i64::MAX))
        });
        self.with_db(|db| {
            let tx = db.begin_write()?;
            {
                let mut table = tx.open_table(RECORDS)?;
                for (k, v) in writes {
                    table.insert(k.as_str(), (expires, v.as_slice()))?;
                }
            }
            tx.commit()?;
            Ok(())
        })
    }
}

impl Store for EmbeddedStore {
    fn backend(&self) -> &'static str {
        "embedded"
    }

    fn get_many<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        Box::pin(async move {
            let this = self.clone();
            let keys = keys.to_vec();
            tokio::task::spawn_blocking(move || this.read(&keys))
                .await
                .map_err(|e| StoreError::Io(format!("read task failed: {e}")))?
        })
    }

    fn put_many(
        &self,
        writes: Writes,
        ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let this = self.clone();
            tokio::task::spawn_blocking(move || this.write(&writes, ttl))
                .await
                .map_err(|e| StoreError::Io(format!("write task failed: {e}")))?
        })
    }
}

#[cfg(test)]
mod tests {
    use redb::ReadableTableMetadata;
    use redb::StorageBackend as _;

    use super::*;

    /// Storage that can be made full, refusing to grow as a full disk does (bytes it already holds can
    /// still be written), and that outlives the database over it, as a file does.
    #[derive(Debug, Clone)]
    struct Disk {
        bytes: Arc<redb::backends::InMemoryBackend>,
        full: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Disk {
        /// ENOSPC when full and `end` is past what the storage holds.
        fn check(&self, end: u64) -> std::io::Result<()> {
            if self.full.load(std::sync::atomic::Ordering::Relaxed) && end > self.bytes.len()? {
                Err(std::io::Error::from_raw_os_error(28))
            } else {
                Ok(())
            }
        }
    }

    impl redb::StorageBackend for Disk {
        fn len(&self) -> std::io::Result<u64> {
            self.bytes.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.bytes.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.check(len)?;
            self.bytes.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.bytes.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.check(offset + data.len() as u64)?;
            self.bytes.write(offset, data)
        }
    }

    /// After a write fails on I/O, redb refuses every later write until the database is opened again:
    /// the store does that itself, so it writes again once there is room, without a restart, and
    /// what was written before is still there.
    #[tokio::test]
    async fn writes_resume_once_a_full_disk_has_room_again() {
        let disk = Disk {
            bytes: Arc::new(redb::backends::InMemoryBackend::new()),
            full: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        };
        let opener = {
            let disk = disk.clone();
            move || Builder::new().create_with_backend(disk.clone())
        };
        let db = opener().expect("open");
        let tx = db.begin_write().expect("tx");
        tx.open_table(RECORDS).expect("table");
        tx.commit().expect("commit");
        let s = EmbeddedStore::over(db, Box::new(opener), Path::new("test.redb"));
        let put = |k: &str| s.put_many(vec![(k.into(), k.as_bytes().to_vec())], None);
        put("before").await.expect("written");

        disk.full.store(true, std::sync::atomic::Ordering::Relaxed);
        // Past what the file holds: it must grow.
        let big = |k: &str| s.put_many(vec![(k.into(), vec![7u8; 4 << 20])], None);
        big("full").await.expect_err("no room");
        big("still full").await.expect_err("no room");
        // Reads are served meanwhile.
        assert_eq!(
            s.get_many(&["before".into()]).await.expect("read"),
            vec![Some(b"before".to_vec())]
        );
        tokio::time::sleep(REOPEN_EVERY).await;
        disk.full.store(false, std::sync::atomic::Ordering::Relaxed);
        put("after").await.expect("written once there is room");

        let keys = ["before", "full", "after"].map(String::from);
        assert_eq!(
            s.get_many(&keys).await.expect("read"),
            vec![Some(b"before".to_vec()), None, Some(b"after".to_vec())]
        );
    }

    #[test]
    fn another_programs_records_table_is_named_as_such() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("other.redb");
        {
            let db = Database::create(&path).expect("create");
            let tx = db.begin_write().expect("tx");
            let other: TableDefinition<u64, u64> = TableDefinition::new("records");
            tx.open_table(other)
                .expect("table")
                .insert(1, 2)
                .expect("insert");
            tx.commit().expect("commit");
        }
        let e = EmbeddedStore::open(&path)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("another program's redb file") && e.contains("other.redb"),
            "{e}"
        );
    }

    #[test]
    fn the_store_folder_is_made_but_not_the_folders_above_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        EmbeddedStore::open(&dir.path().join("data/s.redb")).expect("data/ is made");
        let typo = dir.path().join("dta/hydrant/s.redb");
        let e = EmbeddedStore::open(&typo)
            .err()
            .expect("a typo")
            .to_string();
        assert!(
            e.contains("does not exist") && e.contains("store.embedded.path"),
            "{e}"
        );
        assert!(!dir.path().join("dta").exists(), "nothing was made");
    }

    #[tokio::test]
    async fn written_values_are_read_back_and_survive_reopening() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.redb");
        {
            let s = EmbeddedStore::open(&path).expect("open");
            s.put_many(
                vec![
                    ("hy:v:a".into(), b"one".to_vec()),
                    ("hy:v:b".into(), b"two".to_vec()),
                ],
                None,
            )
            .await
            .expect("write");
        }
        let s = EmbeddedStore::open(&path).expect("reopen");
        let got = s
            .get_many(&["hy:v:a".into(), "hy:v:zz".into(), "hy:v:b".into()])
            .await
            .expect("read");
        assert_eq!(
            got,
            vec![Some(b"one".to_vec()), None, Some(b"two".to_vec())]
        );
    }

    #[tokio::test]
    async fn expired_keys_read_as_absent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = EmbeddedStore::open(&dir.path().join("s.redb")).expect("open");
        s.put_many(
            vec![("k".into(), b"x".to_vec())],
            Some(Duration::from_millis(1)),
        )
        .await
        .expect("write");
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(s.get_many(&["k".into()]).await.expect("read"), vec![None]);
    }

    #[tokio::test]
    async fn expired_records_leave_the_file_when_it_is_opened_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.redb");
        let records = |s: &EmbeddedStore| {
            let db = s.inner.db.read();
            let tx = db.as_ref().expect("open").begin_read().expect("read");
            tx.open_table(RECORDS).expect("table").len().expect("len")
        };
        {
            let s = EmbeddedStore::open(&path).expect("open");
            s.put_many(
                vec![("short".into(), b"x".to_vec())],
                Some(Duration::from_millis(1)),
            )
            .await
            .expect("write");
            s.put_many(
                vec![
                    ("long".into(), b"y".to_vec()),
                    ("also".into(), b"z".to_vec()),
                ],
                Some(Duration::from_secs(3600)),
            )
            .await
            .expect("write");
            s.put_many(vec![("kept".into(), b"w".to_vec())], None)
                .await
                .expect("write");
            assert_eq!(records(&s), 4);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let s = EmbeddedStore::open(&path).expect("reopen");
        assert_eq!(records(&s), 3, "the expired record is gone from the file");
        let keys = ["short".into(), "long".into(), "also".into(), "kept".into()];
        assert_eq!(
            s.get_many(&keys).await.expect("read"),
            vec![
                None,
                Some(b"y".to_vec()),
                Some(b"z".to_vec()),
                Some(b"w".to_vec())
            ]
        );
    }
}
