//! Stages `queue` and `infer`: a per-model pool of ONNX Runtime sessions on dedicated threads, fed by a
//! bounded queue that micro-batches the rows of concurrent requests.
//!
//! `Session::run` needs `&mut Session` and blocks for the whole forward pass, so each session lives on its
//! own OS thread and the async executor only ever awaits a oneshot reply. A worker takes the first queued
//! request and then whatever else is already queued, up to `max_batch_rows` (waiting up to `max_delay_us`
//! for company only when that is configured, as Triton's dynamic batcher does), runs them as one batch, and
//! hands each request exactly its own rows back.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use ort::environment::Environment;
use ort::session::Session;
use ort::session::builder::{GraphOptimizationLevel, PrepackedWeights};
use ort::value::{TensorElementType, TensorRef, ValueType};
use tokio::sync::oneshot;

use crate::config::{InferenceConfig, MAX_MODEL_THREADS};
use crate::dispatch::{Dispatch, PushError, Rows};
use crate::schema::{DeviceKind, Model};
use crate::telemetry::{ModelStats, us_since};

/// Why inference could not answer.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    #[error("{0}")]
    Runtime(String),
    #[error("{}: model `{model}`, `file: {}`: {message}", schema.display(), path.display())]
    Load {
        model: String,
        /// The model's schema file, where `file:` names the ONNX file.
        schema: PathBuf,
        path: PathBuf,
        message: String,
    },
    #[error("the inference queue of model `{0}` is full")]
    QueueFull(String),
    #[error("the request's deadline passed while it waited in the queue of model `{0}`")]
    Expired(String),
    #[error("the request waited longer than {1:?} in the queue of model `{0}`")]
    QueueTimeout(String, Duration),
    #[error("model `{0}` is shutting down")]
    Closed(String),
    #[error("ONNX Runtime failed running model `{model}`: {message}")]
    Run { model: String, message: String },
}

static ENVIRONMENT: OnceLock<Result<Environment, String>> = OnceLock::new();

/// Loads ONNX Runtime from `library` and creates the process's one environment (ONNX Runtime allows one
/// per process; later calls return the first result whatever path they name).
pub fn runtime(library: &Path) -> Result<&'static Environment, InferError> {
    let env = ENVIRONMENT.get_or_init(|| {
        if !library.exists() {
            return Err(format!(
                "ONNX Runtime library not found at {}: run `make ort` (installs onnxruntime 1.31.1 from its PyPI wheel into .ort/), or point `inference.onnxruntime_library` (or ORT_DYLIB_PATH, which wins) at libonnxruntime.so",
                library.display()
            ));
        }
        let builder = ort::init_from(library).map_err(|e| {
            format!(
                "cannot load ONNX Runtime from {}: {e}. hydrant needs onnxruntime 1.31.x: run `make ort`, or point `inference.onnxruntime_library` (or ORT_DYLIB_PATH, which wins) at it",
                library.display()
            )
        })?;
        builder
            .with_name("hydrant")
            .with_telemetry(false)
            .build()
            .map_err(|e| format!("cannot create the ONNX Runtime environment: {e}"))
    });
    env.as_ref().map_err(|e| InferError::Runtime(e.clone()))
}

/// A model output as served: its name and the numbers per row.
#[derive(Debug, Clone)]
pub struct OutputInfo {
    pub name: String,
    pub shape: Vec<i64>,
}

/// What the loaded ONNX file declares, checked against the binding.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub input_name: String,
    pub input_shape: Vec<i64>,
    pub outputs: Vec<OutputInfo>,
    /// `cpu` or `cuda`: where the sessions actually run.
    pub device: &'static str,
    pub sessions: usize,
}

/// The rows one request gets back.
#[derive(Debug)]
pub struct InferOutput {
    /// Per requested output (in the binding's order): numbers per row, and `rows × width` numbers.
    pub outputs: OutputRows,
    /// The input buffer, for reuse.
    pub input: Vec<f32>,
    /// How long the model run of the batch this request rode in took.
    pub infer_us: u64,
}

/// The numbers of every output for some rows, all in one buffer. The buffers of a request's answer come
/// from, and go back to, its engine's pool, so steady traffic allocates none on the session threads.
#[derive(Debug, Default)]
pub struct OutputRows {
    /// Per output: numbers per row, and where its numbers start in `data`.
    spans: Vec<(usize, usize)>,
    data: Vec<f32>,
}

impl OutputRows {
    fn clear(&mut self) {
        self.spans.clear();
        self.data.clear();
    }

    /// Appends an output: `width` numbers per row.
    pub(crate) fn push(&mut self, width: usize, numbers: &[f32]) {
        self.spans.push((width, self.data.len()));
        self.data.extend_from_slice(numbers);
    }

    /// How many outputs.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Output `i`: numbers per row, and all rows' numbers.
    pub fn get(&self, i: usize) -> (usize, &[f32]) {
        let (width, start) = self.spans[i];
        let end = self.spans.get(i + 1).map_or(self.data.len(), |s| s.1);
        (width, &self.data[start..end])
    }

    /// The first number that is NaN or infinite: its output and row. JSON cannot carry one, and a score
    /// of NaN is no score.
    pub fn first_non_finite(&self) -> Option<(usize, usize)> {
        self.iter().enumerate().find_map(|(o, (width, data))| {
            let at = data.iter().position(|x| !x.is_finite())?;
            Some((o, at / width.max(1)))
        })
    }

    /// Every output in order, as [`OutputRows::get`] gives them.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[f32])> {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// How long a request that reaches the queue after its deadline may still wait there for a session
/// (besides `inference.queue_timeout`, which bounds every wait).
const LATE_ARRIVAL_GRACE: Duration = Duration::from_millis(50);

/// How long any request may wait in the queue before its deadline sheds it: waking an idle session takes
/// 50-100 µs, so a request that reached an idle gateway's queue a few microseconds before its deadline
/// was shed while one that came a little later, past it, was run.
const MIN_QUEUE_WAIT: Duration = Duration::from_millis(1);

struct Job {
    rows: usize,
    input: Vec<f32>,
    output: OutputRows,
    deadline: Instant,
    /// When it is shed if still queued: its deadline, or `inference.queue_timeout` after it was queued.
    expires: Instant,
    reply: oneshot::Sender<Result<InferOutput, InferError>>,
}

impl Rows for Job {
    fn rows(&self) -> usize {
        self.rows
    }
    fn expires(&self) -> Instant {
        self.expires
    }
}

/// The running sessions of one model.
pub struct Engine {
    model: Arc<Model>,
    info: ModelInfo,
    queue: Arc<Dispatch<Job>>,
    workers: Vec<JoinHandle<()>>,
    buffers: ArrayQueue<Vec<f32>>,
    out_buffers: ArrayQueue<OutputRows>,
    stats: Arc<ModelStats>,
    queue_timeout: Duration,
    /// [`file_digest`] of the ONNX file the sessions were loaded from.
    digest: u64,
}

impl Engine {
    /// Runs start-up's checks on `model` without serving it: one session is opened on its device (the
    /// file, the input and outputs, the binding's width, the trial runs and the row of defaults), then
    /// dropped. Answers the device it ran on. Blocking: call it off the async executor.
    pub fn check(
        env: &Environment,
        model: &Model,
        cfg: &InferenceConfig,
    ) -> Result<&'static str, InferError> {
        let load_err = |message: String| InferError::Load {
            model: model.name.clone(),
            schema: model.file.clone(),
            path: model.path.clone(),
            message,
        };
        let prepacked = PrepackedWeights::new();
        let (mut session, device) =
            open_session(env, model, cfg.intra_threads, &prepacked).map_err(load_err)?;
        let info = inspect(&session, model, device, 1).map_err(load_err)?;
        trial_runs(&mut session, &info, model, cfg).map_err(load_err)?;
        Ok(device)
    }

    /// Loads the model into its session pool and starts the workers. Fails, naming the file, when the file
    /// is missing or not ONNX, when the binding does not fit the model's input, or when the device cannot be
    /// used.
    pub fn start(
        env: &Environment,
        model: Arc<Model>,
        cfg: &InferenceConfig,
        stats: Arc<ModelStats>,
    ) -> Result<Self, InferError> {
        let load_err = |message: String| InferError::Load {
            model: model.name.clone(),
            schema: model.file.clone(),
            path: model.path.clone(),
            message,
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let n = model.sessions.unwrap_or(if cfg.default_sessions == 0 {
            (cores / cfg.intra_threads.max(1)).max(1)
        } else {
            cfg.default_sessions
        });
        // Each bound alone is generous; together they could still ask for tens of thousands of threads.
        let threads = n.saturating_mul(cfg.intra_threads.max(1));
        if threads > MAX_MODEL_THREADS {
            let sessions_key = if model.sessions.is_some() {
                format!("`sessions` in {}", model.file.display())
            } else {
                "inference.default_sessions".to_owned()
            };
            return Err(load_err(format!(
                "{n} sessions × {} intra-op threads (inference.intra_threads) is {threads} threads, more than {MAX_MODEL_THREADS}: lower {sessions_key} or inference.intra_threads",
                cfg.intra_threads
            )));
        }
        let before = file_stamp(&model.path);
        let mut sessions = Vec::with_capacity(n);
        let mut device = "cpu";
        // One copy of the pre-packed weights serves every session of the pool.
        let prepacked = PrepackedWeights::new();
        for _ in 0..n {
            let (s, d) =
                open_session(env, &model, cfg.intra_threads, &prepacked).map_err(load_err)?;
            device = d;
            sessions.push(s);
        }
        let info = inspect(&sessions[0], &model, device, n).map_err(load_err)?;
        // The file as it was before the sessions read it and after it was hashed: one copied over
        // meanwhile is not known to hold what they run.
        let digest = file_digest(&model.path)
            .map_err(|e| load_err(format!("the ONNX file cannot be read: {e}")))?;
        if before.is_none() || before != file_stamp(&model.path) {
            return Err(load_err(
                "the ONNX file changed while it was loaded: register it again once it is written"
                    .to_owned(),
            ));
        }
        trial_runs(&mut sessions[0], &info, &model, cfg).map_err(load_err)?;
        // Without batching, a batch is one request.
        let batch_rows = if cfg.batching {
            model.batching.max_batch_rows
        } else {
            1
        };
        let queue = Arc::new(Dispatch::new(cfg.max_queue, n, batch_rows));
        let mut workers = Vec::with_capacity(n);
        for (i, session) in sessions.into_iter().enumerate() {
            let worker = Worker {
                model: model.clone(),
                info: info.clone(),
                queue: queue.clone(),
                index: i,
                session,
                batch: Vec::new(),
                scratch: OutputRows::default(),
                stats: stats.clone(),
                queue_timeout: cfg.queue_timeout,
                batching: cfg.batching,
            };
            let name = format!("infer-{}-{i}", model.name);
            workers.push(start_thread(&queue, name, move || worker.run())?);
        }
        let reaper = Reaper {
            model: model.clone(),
            queue: queue.clone(),
            stats: stats.clone(),
            queue_timeout: cfg.queue_timeout,
        };
        let name = format!("reap-{}", model.name);
        workers.push(start_thread(&queue, name, move || reaper.run())?);
        tracing::info!(model = %model.name, version = model.version, sessions = n, device, "model loaded");
        Ok(Self {
            model,
            info,
            queue,
            workers,
            buffers: ArrayQueue::new(256),
            out_buffers: ArrayQueue::new(256),
            stats,
            queue_timeout: cfg.queue_timeout,
            digest,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// [`file_digest`] of the ONNX file the sessions were loaded from.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The model's counters (resolved once, at start).
    pub fn stats(&self) -> &Arc<ModelStats> {
        &self.stats
    }

    /// Requests waiting for a session now.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// A cleared input buffer from the pool.
    pub fn take_buffer(&self) -> Vec<f32> {
        self.buffers.pop().unwrap_or_default()
    }

    /// Returns a buffer to the pool.
    pub fn give_buffer(&self, buf: Vec<f32>) {
        let _ = self.buffers.push(buf);
    }

    /// Returns an answer's buffers to the pools once the response is written.
    pub fn recycle(&self, out: InferOutput) {
        self.give_buffer(out.input);
        let _ = self.out_buffers.push(out.outputs);
    }

    /// Queues `rows` rows (`input` is `rows × width`, row-major) and waits for their outputs. A request whose
    /// `deadline` passes while queued, or that waits longer than `inference.queue_timeout`, is not run: it
    /// is answered then (by the engine's reaper), even while every session is busy with a long run.
    pub async fn infer(
        &self,
        rows: usize,
        input: Vec<f32>,
        deadline: Instant,
    ) -> Result<InferOutput, InferError> {
        let (reply, rx) = oneshot::channel();
        let enqueued = Instant::now();
        let deadline = queue_deadline(deadline, enqueued);
        let job = Job {
            rows,
            input,
            output: self.out_buffers.pop().unwrap_or_default(),
            deadline,
            expires: deadline.min(enqueued + self.queue_timeout),
            reply,
        };
        match self.queue.push(job) {
            Ok(()) => {}
            Err(PushError::Full(job)) => {
                self.stats.shed_queue_full.fetch_add(1, Relaxed);
                self.give_buffer(job.input);
                return Err(InferError::QueueFull(self.model.name.clone()));
            }
            Err(PushError::Closed(job)) => {
                self.give_buffer(job.input);
                return Err(InferError::Closed(self.model.name.clone()));
            }
        }
        // A session sheds a job it takes past its bounds; one that no session takes by then (all of them
        // busy with long runs) is shed by the engine's reaper.
        rx.await
            .map_err(|_| InferError::Closed(self.model.name.clone()))?
    }
}

/// When a request queued at `enqueued` with `deadline` is shed if no session has taken it. The deadline
/// sheds requests that wait for a session past it, but never before [`MIN_QUEUE_WAIT`]: a deadline that
/// falls within the time it takes to wake a session is no sign of a backlog. One that arrives already past
/// it spent its time in the store, whose miss is answered as degraded (stale values or defaults): it is
/// run, within `queue_timeout` and [`LATE_ARRIVAL_GRACE`], rather than turning that degraded 200 into a 503.
fn queue_deadline(deadline: Instant, enqueued: Instant) -> Instant {
    if deadline <= enqueued {
        enqueued + LATE_ARRIVAL_GRACE
    } else {
        deadline.max(enqueued + MIN_QUEUE_WAIT)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the queue lets each worker finish what is queued and exit.
        self.queue.close();
        // An engine replaced by a registered change is dropped by the last request that held it, on an
        // async worker: its session threads are left to finish on their own rather than joined there.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.workers.clear();
            return;
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn open_session(
    env: &Environment,
    model: &Model,
    intra_threads: usize,
    prepacked: &PrepackedWeights,
) -> Result<(Session, &'static str), String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let cpu = || -> Result<Session, String> {
        Session::builder(env)
            .map_err(|x| e(&x))?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|x| e(&x))?
            .with_intra_threads(intra_threads)
            .map_err(|x| e(&x))?
            .with_inter_threads(1)
            .map_err(|x| e(&x))?
            .with_prepacked_weights(prepacked)
            .map_err(|x| e(&x))?
            .commit_from_file(&model.path)
            .map_err(|x| e(&x))
    };
    let cuda = || -> Result<Session, String> {
        Session::builder(env)
            .map_err(|x| e(&x))?
            .with_execution_providers([ort::ep::CUDA::default()
                // TF32 matrix products round inputs to 10-bit mantissas: scores would differ from the
                // CPU's in the fourth decimal. The same model gives the same scores on either device.
                .with_tf32(false)
                .build()
                .error_on_failure()])
            .map_err(|x| e(&x))?
            .with_optimization_level(GraphOptimizationLevel::Level3)
            .map_err(|x| e(&x))?
            .commit_from_file(&model.path)
            .map_err(|x| e(&x))
    };
    match std::fs::metadata(&model.path) {
        Err(_) => {
            // A folder that is not there (a mistyped registry.models) is what to fix, not each file.
            let folder = model.path.parent().filter(|p| !p.as_os_str().is_empty());
            if let Some(folder) = folder.filter(|f| !f.is_dir()) {
                return Err(format!(
                    "the folder {} {} (`file:` is read from the models folder, registry.models{})",
                    folder.display(),
                    if folder.exists() {
                        "is not a folder"
                    } else {
                        "does not exist"
                    },
                    crate::schema::relative_hint(folder)
                ));
            }
            return Err(format!(
                "the ONNX file does not exist (`file:` is read from the models folder, registry.models{})",
                crate::schema::relative_hint(&model.path)
            ));
        }
        // ONNX Runtime would wait forever on a FIFO and fail obscurely on a folder.
        Ok(meta) if !meta.is_file() => {
            return Err("not a regular file (a folder, FIFO or device)".to_owned());
        }
        Ok(_) => {}
    }
    match model.device {
        DeviceKind::Cpu => cpu().map(|s| (s, "cpu")).map_err(|m| format!("not a loadable ONNX model: {m}")),
        DeviceKind::Cuda => cuda().map(|s| (s, "cuda")).map_err(|m| {
            format!("device = \"cuda\" but the CUDA execution provider cannot be used: {}. Install the onnxruntime-gpu libraries (`make ort-gpu`) on a machine with CUDA, or set `device: cpu` or `device: auto`", m.trim_end_matches('.'))
        }),
        DeviceKind::Auto => match cuda() {
            Ok(s) => Ok((s, "cuda")),
            Err(why) => {
                tracing::warn!(model = %model.name, "device = auto: CUDA unavailable, running on CPU ({why})");
                cpu().map(|s| (s, "cpu")).map_err(|m| format!("not a loadable ONNX model: {m}"))
            }
        },
    }
}

/// Reads the session's input and outputs and checks them against the binding.
fn inspect(
    session: &Session,
    model: &Model,
    device: &'static str,
    sessions: usize,
) -> Result<ModelInfo, String> {
    let inputs = session.inputs();
    let input = match &model.input {
        Some(name) => inputs.iter().find(|i| i.name() == name).ok_or_else(|| {
            let names: Vec<_> = inputs.iter().map(|i| i.name()).collect();
            format!(
                "the binding fills input `{name}`, which the model does not have (inputs: {})",
                names.join(", ")
            )
        })?,
        None if inputs.len() == 1 => &inputs[0],
        None => {
            let names: Vec<_> = inputs.iter().map(|i| i.name()).collect();
            return Err(format!(
                "the model has {} inputs ({}): name the one the binding fills with `input:`",
                names.len(),
                names.join(", ")
            ));
        }
    };
    let ValueType::Tensor { ty, shape, .. } = input.dtype() else {
        return Err(format!("input `{}` is not a tensor", input.name()));
    };
    if *ty != TensorElementType::Float32 {
        return Err(format!(
            "input `{}` is {ty:?}; hydrant fills float32 inputs",
            input.name()
        ));
    }
    let dims: Vec<i64> = shape.iter().copied().collect();
    if dims.len() != 2 {
        return Err(format!(
            "input `{}` has shape {dims:?}; expected [batch, width]",
            input.name()
        ));
    }
    if dims[1] >= 0 && dims[1] as usize != model.width {
        return Err(format!(
            "the binding in {} is {} columns wide, but input `{}` of the ONNX model takes {} (shape {dims:?})",
            model.file.display(),
            model.width,
            input.name(),
            dims[1]
        ));
    }
    let mut outputs = Vec::with_capacity(model.outputs.len());
    for name in &model.outputs {
        let o = session
            .outputs()
            .iter()
            .find(|o| o.name() == name)
            .ok_or_else(|| {
                let names: Vec<_> = session.outputs().iter().map(|o| o.name()).collect();
                format!(
                    "output `{name}` is not an output of the model (outputs: {})",
                    names.join(", ")
                )
            })?;
        let ValueType::Tensor { ty, shape, .. } = o.dtype() else {
            return Err(format!("output `{name}` is not a tensor"));
        };
        if *ty != TensorElementType::Float32 {
            return Err(format!(
                "output `{name}` is {ty:?}; hydrant returns float32 outputs"
            ));
        }
        let dims: Vec<i64> = shape.iter().copied().collect();
        if dims.is_empty() {
            return Err(format!(
                "output `{name}` is a scalar; expected one row per input row"
            ));
        }
        // Numbers per row are read off each run's output (dimensions may be dynamic).
        outputs.push(OutputInfo {
            name: name.clone(),
            shape: dims,
        });
    }
    Ok(ModelInfo {
        input_name: input.name().to_owned(),
        input_shape: dims,
        outputs,
        device,
        sessions,
    })
}

struct Worker {
    model: Arc<Model>,
    info: ModelInfo,
    queue: Arc<Dispatch<Job>>,
    /// This session's place in the pool.
    index: usize,
    session: Session,
    /// Reused buffer for the concatenated rows of a multi-request batch.
    batch: Vec<f32>,
    /// Reused buffer for the outputs of a whole batch.
    scratch: OutputRows,
    stats: Arc<ModelStats>,
    queue_timeout: Duration,
    batching: bool,
}

/// Sheds the requests that no session took within their deadline or `inference.queue_timeout`: a session
/// sheds what it takes late, but while every session is busy with a long run (a slow model, a large
/// batch) the requests behind it would otherwise wait for the run to end, past any bound.
struct Reaper {
    model: Arc<Model>,
    queue: Arc<Dispatch<Job>>,
    stats: Arc<ModelStats>,
    queue_timeout: Duration,
}

impl Reaper {
    fn run(self) {
        let mut expired = Vec::new();
        // It sleeps until the earliest expiry among the queued jobs, so under steady load, where jobs are
        // taken long before their bounds, it wakes a few times a second rather than ticking.
        while self.queue.reap(&mut expired) {
            let now = Instant::now();
            for job in expired.drain(..) {
                shed(job, now, self.queue_timeout, &self.model.name, &self.stats);
            }
        }
    }
}

/// Whether `job` must not run at `now`: its deadline passed, or it waited longer than `inference.queue_timeout`.
fn overdue(job: &Job, now: Instant) -> bool {
    job.expires <= now
}

/// Answers an [`overdue`] job without running it (its caller has given up, or should retry elsewhere),
/// counted by reason.
fn shed(job: Job, now: Instant, queue_timeout: Duration, model: &str, stats: &ModelStats) {
    let err = if job.deadline <= now {
        stats.shed_deadline.fetch_add(1, Relaxed);
        InferError::Expired(model.to_owned())
    } else {
        stats.shed_queue_timeout.fetch_add(1, Relaxed);
        InferError::QueueTimeout(model.to_owned(), queue_timeout)
    };
    let _ = job.reply.send(Err(err));
}

/// Starts one of a model's threads. One that cannot start closes `queue`, so the threads already
/// started, which would wait on it for ever, end.
fn start_thread(
    queue: &Dispatch<Job>,
    name: String,
    run: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, InferError> {
    std::thread::Builder::new()
        .name(name)
        .spawn(run)
        .map_err(|e| {
            queue.close();
            InferError::Runtime(format!("cannot start an inference thread: {e}"))
        })
}

/// Tells the queue that a session is gone when its thread ends, however it ends.
struct Leave<'a>(&'a Dispatch<Job>, usize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.leave(self.1);
    }
}

impl Worker {
    fn run(mut self) {
        let queue = self.queue.clone();
        let _leave = Leave(&queue, self.index);
        let max_rows = queue.batch_rows();
        let max_delay = Duration::from_micros(self.model.batching.max_delay_us);
        let mut jobs: Vec<Job> = Vec::new();
        while queue.next(self.index, max_rows, &mut jobs) {
            if self.batching && !max_delay.is_zero() {
                let rows = jobs.iter().map(|j| j.rows).sum();
                let until = Instant::now() + max_delay;
                queue.gather(self.index, rows, max_rows, until, &mut jobs);
            }
            self.run_batch(&mut jobs);
        }
    }

    fn run_batch(&mut self, jobs: &mut Vec<Job>) {
        // `started` also starts the model run: copying the rows into one batch is part of running it.
        let started = Instant::now();
        self.shed_overdue(jobs, started);
        if jobs.is_empty() {
            return;
        }
        let rows: usize = jobs.iter().map(|j| j.rows).sum();
        self.stats.batch_rows.observe(rows as u64);
        match self.run_together(jobs, started) {
            Ok(infer_us) => self.reply_all(jobs.drain(..), infer_us),
            // One request's rows can fail the run (an index out of a table's range, a value a kernel
            // refuses): its batch-mates are run again apart, so that each gets the answer to its own
            // input, as a non-finite score is answered to its own request only.
            Err(message) if jobs.len() > 1 => {
                tracing::warn!(
                    model = %self.model.name,
                    rows,
                    requests = jobs.len(),
                    "a batch failed ({message}): running its requests apart"
                );
                self.run_apart(std::mem::take(jobs), started);
            }
            Err(message) => {
                for j in jobs.drain(..) {
                    self.fail(j, &message);
                }
            }
        }
    }

    /// Runs the two halves of `jobs`, a batch whose run failed, apart, so that each request gets the
    /// outcome of its own rows: a half that fails again is halved again, down to parts of a few requests,
    /// which are run one by one. One bad request among n costs about 2·log2(n) runs (16 for 256); where
    /// every request fails, about 2n.
    fn run_apart(&mut self, mut jobs: Vec<Job>, started: Instant) {
        /// Parts this small are run request by request rather than halved again.
        const ALONE: usize = 4;
        let second = jobs.split_off(jobs.len() / 2);
        for half in [jobs, second] {
            let Err((part, message)) = self.try_run(half, started) else {
                continue;
            };
            match part.len() {
                // Failed alone: that is its answer.
                1 => {
                    for j in part {
                        self.fail(j, &message);
                    }
                }
                n if n <= ALONE => {
                    for j in part {
                        if let Err((mut j, message)) = self.try_run(vec![j], started)
                            && let Some(j) = j.pop()
                        {
                            self.fail(j, &message);
                        }
                    }
                }
                _ => self.run_apart(part, started),
            }
        }
    }

    /// Runs `jobs` together and answers each with its rows, or hands them back with the failure. Those
    /// past their deadline or queue timeout by now are shed, not run.
    fn try_run(&mut self, mut jobs: Vec<Job>, started: Instant) -> Result<(), (Vec<Job>, String)> {
        let now = Instant::now();
        self.shed_overdue(&mut jobs, now);
        if jobs.is_empty() {
            return Ok(());
        }
        self.stats.batch_reruns.fetch_add(1, Relaxed);
        match self.run_together(&jobs, now) {
            Ok(_) => {
                // The time since the batch that failed began: this request waited through its runs.
                self.reply_all(jobs.into_iter(), us_since(started));
                Ok(())
            }
            Err(message) => Err((jobs, message)),
        }
    }

    /// Answers the requests whose deadline passed, or that waited past the queue timeout, without
    /// running them: their callers have given up or should retry elsewhere.
    fn shed_overdue(&self, jobs: &mut Vec<Job>, now: Instant) {
        let mut i = 0;
        while i < jobs.len() {
            if overdue(&jobs[i], now) {
                let job = jobs.swap_remove(i);
                shed(job, now, self.queue_timeout, &self.model.name, &self.stats);
            } else {
                i += 1;
            }
        }
    }

    /// Runs the rows of `jobs` as one input, into `scratch`, and tells the queue how long it took since
    /// `began`: the microseconds.
    fn run_together(&mut self, jobs: &[Job], began: Instant) -> Result<u64, String> {
        let rows: usize = jobs.iter().map(|j| j.rows).sum();
        let input: &[f32] = match jobs {
            [one] => &one.input,
            _ => {
                self.batch.clear();
                for j in jobs {
                    self.batch.extend_from_slice(&j.input);
                }
                &self.batch
            }
        };
        let result = run_session(
            &mut self.session,
            &self.info,
            input,
            rows,
            self.model.width,
            &mut self.scratch,
        );
        let infer_us = us_since(began);
        self.queue.ran(Duration::from_micros(infer_us));
        result.map(|()| infer_us)
    }

    /// Answers `jobs`, in the order their rows were run, from the last run's outputs.
    fn reply_all(&self, jobs: impl Iterator<Item = Job>, infer_us: u64) {
        let mut at = 0;
        for j in jobs {
            let rows = j.rows;
            self.reply(j, at, infer_us);
            at += rows;
        }
    }

    /// Answers `j` with its rows of the last run's outputs, which start at row `at`.
    fn reply(&self, mut j: Job, at: usize, infer_us: u64) {
        j.output.clear();
        for (w, data) in self.scratch.iter() {
            j.output.push(w, &data[at * w..(at + j.rows) * w]);
        }
        let _ = j.reply.send(Ok(InferOutput {
            outputs: j.output,
            input: j.input,
            infer_us,
        }));
    }

    /// Answers `j` with the run's failure.
    fn fail(&self, j: Job, message: &str) {
        tracing::error!(model = %self.model.name, rows = j.rows, "inference failed: {message}");
        let _ = j.reply.send(Err(InferError::Run {
            model: self.model.name.clone(),
            message: message.to_owned(),
        }));
    }
}

/// The ONNX file each model version was served from in this process, by its bytes' digest: a version
/// loaded again (a change within it, a rollback to it) must find the same bytes, since answers name the
/// version that scored them.
#[derive(Default)]
pub struct ServedFiles(parking_lot::Mutex<HashMap<(String, u32), (PathBuf, u64)>>);

impl ServedFiles {
    /// Refuses `model`, whose file's bytes have `digest` now, where its version was served from the
    /// same file with other bytes.
    pub fn check(&self, model: &Model, digest: u64) -> Result<(), InferError> {
        let served = self.0.lock();
        match served.get(&(model.name.clone(), model.version)) {
            Some((path, d)) if *path == model.path && *d != digest => Err(InferError::Load {
                model: model.name.clone(),
                schema: model.file.clone(),
                path: model.path.clone(),
                message: format!(
                    "its bytes changed since version {v} was served from it, and answers say which version scored them: copy the new ONNX file under a new name and register it with a new version",
                    v = model.version
                ),
            }),
            _ => Ok(()),
        }
    }

    /// [`check`](Self::check) on `model`'s file as it is on disk now (hashed; a file that cannot be
    /// read is for the load to report).
    pub fn check_file(&self, model: &Model) -> Result<(), InferError> {
        file_digest(&model.path).map_or(Ok(()), |digest| self.check(model, digest))
    }

    /// Notes the file each of `engines` serves from, for versions not noted before. Kept for models
    /// deleted since too: one registered again at a kept version must find the same bytes.
    pub fn record<'a>(&self, engines: impl IntoIterator<Item = &'a Arc<Engine>>) {
        let mut served = self.0.lock();
        for e in engines {
            served
                .entry((e.model.name.clone(), e.model.version))
                .or_insert_with(|| (e.model.path.clone(), e.digest));
        }
    }
}

/// What tells the file at `path` as written, without reading it: its length and when it was last
/// written. A copy over it changes them.
fn file_stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

/// A digest of the bytes of the file at `path`: whether a model version's ONNX file changed on disk.
fn file_digest(path: &Path) -> std::io::Result<u64> {
    use std::hash::{BuildHasher, Hasher};
    use std::io::Read;
    // Opening a FIFO would wait for a writer, for ever: only a regular file is read.
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut file = std::fs::File::open(path)?;
    let mut hasher = foldhash::fast::FixedState::with_seed(0x0068_7964_7261_6e74).build_hasher();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        // Whole buffers, so that the same bytes hash the same however the reads split them.
        let mut filled = 0;
        while filled < buf.len() {
            match file.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        hasher.write(&buf[..filled]);
        if filled < buf.len() {
            return Ok(hasher.finish());
        }
    }
}

/// Runs the model once on 1 row and once on 2 rows of zeros, so a model that cannot serve is refused at
/// start-up rather than answering every request with 500: an input the binding does not fill, a fixed
/// batch dimension, a symbolic width the binding does not match.
fn trial_run(session: &mut Session, info: &ModelInfo, width: usize) -> Result<(), String> {
    let zeros = vec![0f32; 2 * width];
    let mut out = OutputRows::default();
    run_session(session, info, &zeros[..width], 1, width, &mut out).map_err(|e| {
        let hint = if e.contains("Missing Input") {
            format!(
                " (the model has another required input: hydrant fills only `{}`)",
                info.input_name
            )
        } else {
            String::new()
        };
        format!("a trial run on one row of zeros failed: {e}{hint}")
    })?;
    run_session(session, info, &zeros, 2, width, &mut out).map_err(|e| {
        format!(
            "a trial run on two rows failed ({e}): hydrant runs several rows (candidates, batched requests) at once, so the input's first dimension must be dynamic"
        )
    })
}

/// Runs the model on the row of fallbacks (every entity not found, no context sent), the row the most
/// common degraded request is scored on. A model that scores it as NaN or infinity would answer every such
/// request with 500, so it is refused at start-up, naming the output.
fn fallback_run(
    session: &mut Session,
    info: &ModelInfo,
    model: &Model,
) -> Result<(Vec<f32>, OutputRows), String> {
    let row = crate::assemble::fallback_row(model);
    let mut out = OutputRows::default();
    run_session(session, info, &row, 1, model.width, &mut out)
        .map_err(|e| format!("a run on the row of defaults failed: {e}"))?;
    match out.first_non_finite() {
        None => Ok((row, out)),
        Some((o, _)) => Err(format!(
            "output `{}` is {} for the row of defaults (every entity not found, no context sent), so every request scored on defaults would fail: check the defaults and `fill_missing` values of the model's inputs ({})",
            info.outputs[o].name,
            out.get(o)
                .1
                .iter()
                .find(|x| !x.is_finite())
                .copied()
                .unwrap_or(f32::NAN),
            fallbacks(model)
        )),
    }
}

/// Start-up's runs of `model` on a session: the trial runs, the row of defaults, and, where the rows of
/// different requests can share a run, whether a row's answer depends on the rows beside it.
fn trial_runs(
    session: &mut Session,
    info: &ModelInfo,
    model: &Model,
    cfg: &InferenceConfig,
) -> Result<(), String> {
    trial_run(session, info, model.width)?;
    let (defaults, scored) = fallback_run(session, info, model)?;
    if cfg.batching && model.batching.max_batch_rows > 1 {
        independence_run(session, info, model.width, (&defaults, &scored))?;
    }
    Ok(())
}

/// Runs two different rows alone and together, and refuses a model whose answer for a row depends on
/// the other rows of its run (rows reordered, a batch mean): batching runs the rows of concurrent
/// requests as one input, so such a model would answer requests with one another's scores. The rows are
/// the row of defaults (`a`, with the outputs it was scored alone) and that row plus one; within float
/// rounding the answers must agree.
fn independence_run(
    session: &mut Session,
    info: &ModelInfo,
    width: usize,
    (a, alone_a): (&[f32], &OutputRows),
) -> Result<(), String> {
    let b: Vec<f32> = a.iter().map(|x| x + 1.0).collect();
    let run = |session: &mut Session, input: &[f32], rows| {
        let mut out = OutputRows::default();
        run_session(session, info, input, rows, width, &mut out).map(|()| out)
    };
    // A row the model cannot run (an index past a table, say) proves nothing either way: the check is
    // then left out, and what requests send decides.
    let (Ok(alone_b), Ok(together)) = (
        run(session, &b, 1),
        run(session, &[a, b.as_slice()].concat(), 2),
    ) else {
        return Ok(());
    };
    let close = |x: f32, y: f32| (x - y).abs() <= 1e-5 + 1e-4 * x.abs().max(y.abs());
    for (o, output) in info.outputs.iter().enumerate() {
        let (w, both) = together.get(o);
        let (first, second) = both.split_at(w.min(both.len()));
        let rows = [(alone_a.get(o).1, first), (alone_b.get(o).1, second)];
        // A non-finite number is the other checks' to report.
        if rows
            .iter()
            .flat_map(|(x, y)| x.iter().chain(y.iter()))
            .any(|v| !v.is_finite())
        {
            continue;
        }
        if rows
            .iter()
            .any(|(x, y)| x.len() != y.len() || x.iter().zip(y.iter()).any(|(&p, &q)| !close(p, q)))
        {
            return Err(format!(
                "a trial run of two rows, alone and then together, gave output `{}` other values for a row beside another row: hydrant runs the rows of concurrent requests together, so the model must score each row on its own",
                output.name
            ));
        }
    }
    Ok(())
}

/// `label = fallback` for the first slots of `model`, for an error message.
fn fallbacks(model: &Model) -> String {
    const SHOWN: usize = 16;
    let mut text = model
        .slots
        .iter()
        .take(SHOWN)
        .map(|s| {
            // A float32 value is held as the float64 nearest it; shown as float32, 0.01 reads 0.01.
            let value = match (s.dtype, s.fallback()) {
                (crate::value::Dtype::Float32, crate::value::Value::Float(f)) => {
                    format!("{}", *f as f32)
                }
                (_, v) => serde_json::to_string(v).unwrap_or_default(),
            };
            // A long list or string default is cut, so the message stays one readable line.
            const LONGEST: usize = 80;
            if value.len() > LONGEST {
                let cut = value.floor_char_boundary(LONGEST);
                format!("{} = {}…", s.label, &value[..cut])
            } else {
                format!("{} = {value}", s.label)
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    if model.slots.len() > SHOWN {
        text.push_str(&format!(", and {} more", model.slots.len() - SHOWN));
    }
    text
}

/// Runs one forward pass; puts, per requested output, its width and all rows' numbers in `out`.
fn run_session(
    session: &mut Session,
    info: &ModelInfo,
    input: &[f32],
    rows: usize,
    width: usize,
    out: &mut OutputRows,
) -> Result<(), String> {
    let tensor = TensorRef::from_array_view(([rows, width], input)).map_err(|e| e.to_string())?;
    let outputs = session
        .run(ort::inputs![info.input_name.as_str() => tensor])
        .map_err(|e| e.to_string())?;
    out.clear();
    for o in &info.outputs {
        let value = outputs
            .get(&o.name)
            .ok_or_else(|| format!("the model produced no `{}`", o.name))?;
        let (shape, data) = value
            .try_extract_tensor::<f32>()
            .map_err(|e| e.to_string())?;
        let per_row = data.len().checked_div(rows).unwrap_or(0);
        if shape.first().copied() != Some(rows as i64) || per_row * rows != data.len() {
            return Err(format!(
                "output `{}` has shape {shape:?} for {rows} input rows",
                o.name
            ));
        }
        out.push(per_row, data);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_sheds_only_after_the_time_a_wake_up_takes_and_a_late_arrival_gets_its_grace() {
        let t = Instant::now();
        let us = Duration::from_micros;
        // Far enough ahead: the deadline itself.
        assert_eq!(queue_deadline(t + us(5_000), t), t + us(5_000));
        // A few microseconds ahead: at least the minimum wait, not a shed before a session can wake.
        assert_eq!(queue_deadline(t + us(5), t), t + MIN_QUEUE_WAIT);
        // Already past, or at it: the late arrival's grace.
        assert_eq!(queue_deadline(t, t), t + LATE_ARRIVAL_GRACE);
        assert_eq!(queue_deadline(t, t + us(5)), t + us(5) + LATE_ARRIVAL_GRACE);
    }
}
