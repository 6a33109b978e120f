//! Start-up and shutdown: builds a [`Gateway`] from a [`Config`] (schemas, store, cache, model sessions),
//! binds the listener, and serves until a shutdown signal, draining in-flight requests.
//!
//! With a shared store (Redis) start-up also subscribes to the replicas' invalidations, starts the hot-key
//! flusher, and warms the cache from the hot keys before the gateway reports ready.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use tokio::net::TcpListener;

use crate::cache::FeatureCache;
use crate::clock::Clock;
use crate::config::Config;
use crate::gateway::{Catalog, Gateway};
use crate::hydrate::Hydrator;
use crate::infer::{self, Engine};
use crate::prefetch::{self, HotKeys, Prefetcher};
use crate::schema::Registry;
use crate::store::{EmbeddedStore, Store};
use crate::telemetry::Telemetry;

/// The running model engines by name.
pub type Engines = HashMap<String, Arc<Engine>>;

/// A built gateway with its bound listener, ready to serve.
pub struct Application {
    listener: TcpListener,
    routes: crate::serve::Routes,
    gateway: Arc<Gateway>,
}

/// Opens the configured store: Redis when `store.redis.url` is set, else the embedded file.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    if !config.store.redis.url.is_empty() {
        return crate::store::redis::open(&config.store.redis, &config.store.prefix).await;
    }
    Ok(Arc::new(EmbeddedStore::open(&config.store.embedded.path)?))
}

/// Reads and compiles the schemas folder, after putting back a registration left half done by a process
/// that stopped between renaming its files (see [`crate::journal`]).
pub fn read_registry(config: &Config) -> anyhow::Result<Registry> {
    crate::registrar::recover_interrupted(&config.registry.schemas).map_err(|e| {
        anyhow::anyhow!(
            "registry.schemas {}: {e}",
            config.registry.schemas.display()
        )
    })?;
    Ok(Registry::load_dir(
        &config.registry.schemas,
        &config.registry.models,
    )?)
}

/// Loads and validates the schemas, then starts every model's sessions (which checks each binding's width
/// against its ONNX input).
pub fn load_models(
    config: &Config,
    telemetry: &Telemetry,
) -> anyhow::Result<(Arc<Registry>, Engines)> {
    load_models_until(config, telemetry, &AtomicBool::new(false))
}

/// [`load_models`], stopping before the next model once `stop` is set (a signal during start-up).
fn load_models_until(
    config: &Config,
    telemetry: &Telemetry,
    stop: &AtomicBool,
) -> anyhow::Result<(Arc<Registry>, Engines)> {
    let registry = read_registry(config)?;
    let env = infer::runtime(&config.onnxruntime_library())?;
    let mut engines = HashMap::new();
    let mut names: Vec<_> = registry.models.keys().cloned().collect();
    names.sort();
    // Every model is tried, so one start-up (or `hydrant validate`) names every model that cannot load.
    let mut problems = Vec::new();
    for name in names {
        if stop.load(Relaxed) {
            anyhow::bail!("start-up interrupted while the models loaded");
        }
        let model = registry.models[&name].clone();
        let stats = telemetry.model(&name);
        match Engine::start(env, model, &config.inference, stats) {
            Ok(engine) => {
                engines.insert(name, Arc::new(engine));
            }
            Err(e) => problems.push(format!("{e:#}")),
        }
    }
    match problems.len() {
        0 => Ok((Arc::new(registry), engines)),
        1 => Err(anyhow::anyhow!(problems.remove(0))),
        n => Err(anyhow::anyhow!(
            "{n} models cannot be loaded:\n  {}",
            problems.join("\n  ")
        )),
    }
}

/// What start-up checks before it touches the store: the compiled schemas and the loaded models. (The
/// socket is bound last, once the gateway can serve: a port that accepts connections early would queue
/// callers, and a probe, behind a store that may take seconds to connect.)
struct Prepared {
    telemetry: Arc<Telemetry>,
    registry: Arc<Registry>,
    engines: Engines,
}

impl Prepared {
    async fn new(config: &Config) -> anyhow::Result<Self> {
        /// Tells the loading thread to stop when this future is dropped (a signal ended the start-up):
        /// the runtime's shutdown then waits for one model, not all of them.
        struct StopOnDrop(Arc<AtomicBool>);
        impl Drop for StopOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Relaxed);
            }
        }
        let cfg = config.clone();
        let telemetry = Arc::new(Telemetry::default());
        let t = telemetry.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let _stop_on_drop = StopOnDrop(stop.clone());
        let (registry, engines) =
            tokio::task::spawn_blocking(move || load_models_until(&cfg, &t, &stop))
                .await
                .context("model loading task failed")??;
        Ok(Self {
            telemetry,
            registry,
            engines,
        })
    }
}

impl Application {
    pub async fn build(config: Config) -> anyhow::Result<Self> {
        // Schemas, models and ONNX Runtime first: a start-up that fails on them leaves no new store file
        // behind.
        let ready = Prepared::new(&config).await?;
        let new_store = config.store.redis.url.is_empty() && !config.store.embedded.path.exists();
        let store = open_store(&config).await?;
        if new_store {
            tracing::warn!(
                path = %config.store.embedded.path.display(),
                "serving a new, empty embedded store (store.embedded.path): every key reads as not found until rows are loaded"
            );
        }
        Self::finish(config, store, Clock::default(), ready).await
    }

    /// Builds over a given store and clock (tests move the clock).
    pub async fn build_with_store(
        config: Config,
        store: Arc<dyn Store>,
        clock: Clock,
    ) -> anyhow::Result<Self> {
        let ready = Prepared::new(&config).await?;
        Self::finish(config, store, clock, ready).await
    }

    async fn finish(
        config: Config,
        store: Arc<dyn Store>,
        clock: Clock,
        ready: Prepared,
    ) -> anyhow::Result<Self> {
        let Prepared {
            telemetry,
            registry,
            engines,
        } = ready;
        let cache = FeatureCache::new(config.cache.max_bytes, clock);
        let hot_keys = store.keeps_hot_keys();
        let hydrator = Hydrator::new(
            store.clone(),
            cache,
            config.store.prefix.clone(),
            telemetry.clone(),
            // A store without hot-key sets gets no sampling: it would cost every lookup for nothing.
            if hot_keys {
                HotKeys::new(config.prefetch.hot_sample_every)
            } else {
                HotKeys::disabled()
            },
        );
        // Subscribed before anything is cached, so no write made from here on can be missed.
        let weak = Arc::downgrade(&hydrator);
        store
            .subscribe_invalidations(Arc::new(move |inv| {
                if let Some(h) = weak.upgrade() {
                    h.apply(inv);
                }
            }))
            .await
            .context("cannot subscribe to the store's invalidation channel")?;
        if hot_keys {
            prefetch::spawn_hot_flusher(
                Arc::downgrade(&hydrator),
                config.prefetch.hot_flush_interval,
                config.prefetch.hot_keep,
            );
        }
        let prefetcher = Prefetcher::new(config.prefetch.max_concurrent);
        let auth = crate::auth::Auth::load(&config.auth)
            .map_err(anyhow::Error::msg)?
            .map(ArcSwap::from_pointee)
            .map(Arc::new);
        if let Some(auth) = &auth {
            tracing::info!("authentication on: {:?}", auth.load());
        }
        let listener = crate::serve::listen(config.server.bind)
            .await
            .with_context(|| format!("cannot listen on {} (server.bind)", config.server.bind))?;
        telemetry.know_views(registry.views.values());
        let served = crate::infer::ServedFiles::default();
        served.record(engines.values());
        let gateway = Arc::new(Gateway {
            config,
            catalog: Arc::new(ArcSwap::from_pointee(Catalog::new(registry, engines))),
            hydrator,
            telemetry,
            ready: AtomicBool::new(false),
            prefetcher,
            folder: Default::default(),
            auth,
            served,
        });
        let routes = crate::api::routes(gateway.clone());
        // Warm start while already serving: `/v2/health/ready` answers 503 until the hottest keys are
        // cached or `prefetch.warm_timeout` is over, whichever comes first.
        let gw = gateway.clone();
        tokio::spawn(async move {
            let warmed = prefetch::warm_start(
                &gw.hydrator,
                &gw.registry(),
                &gw.config.prefetch,
                &gw.config.limits,
            )
            .await;
            if warmed.keys.fetched > 0 || warmed.incomplete {
                tracing::info!(
                    keys = warmed.keys.fetched,
                    failed = warmed.keys.failed,
                    incomplete = warmed.incomplete,
                    "warm start done"
                );
            }
            gw.ready.store(true, Relaxed);
        });
        Ok(Self {
            listener,
            routes,
            gateway,
        })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    pub fn gateway(&self) -> Arc<Gateway> {
        self.gateway.clone()
    }

    /// Serves until `shutdown` resolves, then stops accepting, and lets in-flight requests finish for up to
    /// `server.shutdown_grace`.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let addr = self.listener.local_addr()?;
        tracing::info!(%addr, "hydrant listening");
        let grace = self.gateway.config.server.shutdown_grace;
        let gateway = self.gateway.clone();
        // The cache's upkeep (`FeatureCache::upkeep`), as often as it says, on a thread of its own: on
        // the blocking pool, a task every second went to each idle pool thread in turn, so none stayed
        // idle long enough to retire, and the threads a burst of embedded-store reads started stayed for
        // good. Stops when `_stop_upkeep` is dropped, as this function returns.
        let cache = self.gateway.hydrator.cache().clone();
        let (_stop_upkeep, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("hydrant-upkeep".to_owned())
            .spawn(move || {
                let mut pause = std::time::Duration::ZERO;
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(pause)
                {
                    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cache.upkeep()))
                    {
                        Ok(next) => pause = next,
                        Err(_) => {
                            tracing::error!(
                                "the cache's upkeep panicked; it runs again in a second"
                            );
                            pause = std::time::Duration::from_secs(1);
                        }
                    }
                }
            })?;
        let _abort_watch = AbortOnDrop(tokio::spawn(crate::registrar::watch_folder(
            self.gateway.clone(),
        )));
        let _abort_auth = self.gateway.auth.clone().map(|tokens| {
            AbortOnDrop(tokio::spawn(crate::auth::watch_files(
                self.gateway.config.auth.clone(),
                tokens,
                self.gateway.telemetry.clone(),
            )))
        });
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let limits = crate::serve::ConnLimits::from(&self.gateway.config.server);
        let server = crate::serve::serve(self.listener, self.routes, limits, async move {
            shutdown.await;
            gateway.ready.store(false, Relaxed);
            tracing::info!("shutting down: draining in-flight requests");
            let _ = stop_tx.send(true);
        });
        tokio::select! {
            r = server => r,
            _ = async move {
                let _ = stop_rx.wait_for(|s| *s).await;
                tokio::time::sleep(grace).await;
            } => {
                tracing::warn!(?grace, "shutdown grace period over with requests still in flight");
                Ok(())
            }
        }
    }
}

/// Aborts a background task when dropped.
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
