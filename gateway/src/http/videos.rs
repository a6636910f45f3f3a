//! The HTTP API's video jobs and their files. A job is one gateway request (the same lifecycle
//! as a gRPC client's: it is a client of `VideoService::generate`), whose events it turns into
//! the OpenAI Video object's `status` and `progress` and whose segments it appends to
//! `<dir>/<id>.mp4` as they arrive, so the file is playable up to its last complete segment at
//! every moment and can be streamed while it grows. Finished jobs are kept on disk with a
//! `<id>.json` beside the video (the object and its owner), bounded by count and bytes (the
//! oldest go first) and deleted at `expires_at`; a restart reads them back.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ditstream_common::config::VideoStore;
use ditstream_common::status;
use ditstream_proto::v1 as pb;
use pb::generate_event::Event as E;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Why a job failed, as OpenAI's Video object carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VideoError {
    /// A stable code (the gRPC status's name, e.g. `cancelled`).
    pub code: String,
    /// What happened, for people.
    pub message: String,
}

/// OpenAI's Video object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Video {
    /// The job's id (the gateway's request id).
    pub id: String,
    /// Always `video`.
    pub object: String,
    /// The model that makes it.
    pub model: String,
    /// `queued`, `in_progress`, `completed` or `failed`.
    pub status: String,
    /// 0–100.
    pub progress: u32,
    /// Unix seconds.
    pub created_at: u64,
    /// Unix seconds, once finished.
    pub completed_at: Option<u64>,
    /// Unix seconds when the file is deleted, once finished.
    pub expires_at: Option<u64>,
    /// `WxH`.
    pub size: String,
    /// The clip's length in seconds, as a string.
    pub seconds: String,
    /// What was asked for.
    pub prompt: String,
    /// Why it failed.
    pub error: Option<VideoError>,
    /// Remixes do not exist here.
    pub remixed_from_video_id: Option<String>,
    /// The content's MIME type with its codec string, for Media Source Extensions (known once
    /// the first segment is on its way; not an OpenAI field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mime_type: Option<String>,
}

impl Video {
    /// Whether nothing more will change.
    pub fn finished(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "failed")
    }
}

/// What the sidecar file holds.
#[derive(Serialize, Deserialize)]
struct Stored {
    owner: String,
    /// Creation time in nanoseconds, to keep the order of jobs made within one second.
    created_ns: u128,
    video: Video,
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// One job: its object, its file's complete bytes so far, and its owner.
pub struct Job {
    /// The principal (API key name) that made it.
    pub owner: String,
    created_ns: u128,
    state: watch::Sender<(Video, u64)>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Job {
    /// The object as it is now.
    pub fn video(&self) -> Video {
        self.state.borrow().0.clone()
    }

    /// Changes of (object, bytes of complete segments in the file).
    pub fn watch(&self) -> watch::Receiver<(Video, u64)> {
        self.state.subscribe()
    }

    fn update(&self, f: impl FnOnce(&mut Video, &mut u64)) {
        self.state.send_modify(|(v, b)| f(v, b));
    }
}

/// Every job the server knows, in creation order.
pub struct Store {
    cfg: VideoStore,
    dir: PathBuf,
    jobs: Mutex<Vec<(String, Arc<Job>)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is a few vector operations: a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store {
    /// The store in `dir`, with the finished jobs a previous run left there (expired ones are
    /// deleted).
    pub fn open(cfg: &VideoStore, dir: PathBuf) -> Store {
        let store = Store {
            cfg: cfg.clone(),
            dir,
            jobs: Mutex::default(),
        };
        let mut found: Vec<Stored> = std::fs::read_dir(&store.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
            .collect();
        found.sort_by_key(|s| s.created_ns);
        let mut jobs = lock(&store.jobs);
        for s in found {
            let bytes = std::fs::metadata(store.video_path(&s.video.id)).map_or(0, |m| m.len());
            let (state, _) = watch::channel((s.video.clone(), bytes));
            let job = Job {
                owner: s.owner,
                created_ns: s.created_ns,
                state,
                task: Mutex::new(None),
            };
            jobs.push((s.video.id, Arc::new(job)));
        }
        // A video whose job never finished (the server stopped mid-request) has no sidecar:
        // nobody can list it, so it goes.
        let known: std::collections::HashSet<String> =
            jobs.iter().map(|(id, _)| format!("{id}.mp4")).collect();
        drop(jobs);
        for entry in std::fs::read_dir(&store.dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.ends_with(".mp4") && !known.contains(&name) {
                tracing::info!(file = name, "unfinished video from an earlier run: deleted");
                let _ = std::fs::remove_file(entry.path());
            }
        }
        store.enforce();
        store
    }

    /// The MP4 of job `id`.
    pub fn video_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.mp4"))
    }

    fn sidecar(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Job `id` if `owner` made it (another owner's job is not found, like a missing one).
    pub fn get(&self, id: &str, owner: &str) -> Option<Arc<Job>> {
        lock(&self.jobs)
            .iter()
            .find(|(i, j)| i == id && j.owner == owner)
            .map(|(_, j)| Arc::clone(j))
    }

    /// `owner`'s jobs, oldest first.
    pub fn list(&self, owner: &str) -> Vec<Video> {
        lock(&self.jobs)
            .iter()
            .filter(|(_, j)| j.owner == owner)
            .map(|(_, j)| j.video())
            .collect()
    }

    /// Starts a job for `video` (already accepted by the gateway, whose events are `events`).
    pub fn start(
        self: &Arc<Self>,
        owner: String,
        video: Video,
        events: impl Stream<Item = Result<pb::GenerateEvent, tonic::Status>> + Send + Unpin + 'static,
    ) -> Arc<Job> {
        let id = video.id.clone();
        let (state, _) = watch::channel((video, 0));
        let job = Arc::new(Job {
            owner,
            created_ns: now_ns(),
            state,
            task: Mutex::new(None),
        });
        lock(&self.jobs).push((id.clone(), Arc::clone(&job)));
        let task = tokio::spawn(Arc::clone(self).run(Arc::clone(&job), events));
        *lock(&job.task) = Some(task);
        job
    }

    /// Relays one job's events into its object and its file.
    async fn run(
        self: Arc<Self>,
        job: Arc<Job>,
        mut events: impl Stream<Item = Result<pb::GenerateEvent, tonic::Status>> + Unpin,
    ) {
        let id = job.video().id;
        let failed = |code: &str, message: String| {
            job.update(|v, _| {
                v.status = "failed".into();
                v.error = Some(VideoError {
                    code: code.into(),
                    message,
                });
            })
        };
        if let Err(e) = tokio::fs::create_dir_all(&self.dir).await {
            failed("storage", format!("{}: {e}", self.dir.display()));
            return self.finish(&job);
        }
        let path = self.video_path(&id);
        let mut file = match tokio::fs::File::create(&path).await {
            Ok(f) => f,
            Err(e) => {
                failed("storage", format!("{}: {e}", path.display()));
                return self.finish(&job);
            }
        };
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(pb::GenerateEvent { event: Some(e) }) => e,
                Ok(_) => continue,
                Err(status) => {
                    failed(
                        &status::code_name(status.code()),
                        status.message().to_string(),
                    );
                    break;
                }
            };
            let data = match event {
                E::Progress(p) => {
                    job.update(|v, _| {
                        v.status = "in_progress".into();
                        v.progress = v.progress.max(progress(&p));
                    });
                    continue;
                }
                E::InitSegment(i) => {
                    job.update(|v, _| v.mime_type = Some(i.mime_type.clone()));
                    i.data
                }
                E::MediaSegment(m) => m.data,
                E::Completed(_) => {
                    job.update(|v, _| {
                        v.status = "completed".into();
                        v.progress = 100;
                    });
                    break;
                }
                E::Accepted(_) => continue,
            };
            let written = async {
                file.write_all(&data).await?;
                file.flush().await
            }
            .await;
            if let Err(e) = written {
                failed("storage", format!("{}: {e}", path.display()));
                break;
            }
            // Readers see only whole segments.
            job.update(|_, bytes| *bytes += data.len() as u64);
        }
        if !job.video().finished() {
            failed(
                "internal",
                "the request's stream ended before Completed".into(),
            );
        }
        self.finish(&job);
    }

    /// A job ended: stamp it, persist its object, apply the bounds.
    fn finish(&self, job: &Job) {
        let t = now();
        let ttl = self.cfg.ttl_s;
        job.update(|v, _| {
            v.completed_at = Some(t);
            v.expires_at = Some(t.saturating_add(ttl));
        });
        let video = job.video();
        let stored = Stored {
            owner: job.owner.clone(),
            created_ns: job.created_ns,
            video: video.clone(),
        };
        if let Ok(json) = serde_json::to_vec_pretty(&stored)
            && let Err(e) = std::fs::write(self.sidecar(&video.id), json)
        {
            tracing::warn!(id = video.id, error = %e, "cannot persist the video's metadata");
        }
        self.enforce();
    }

    /// Deletes job `id` (cancelling its work if it runs) and its files.
    pub fn delete(&self, id: &str) {
        let job = {
            let mut jobs = lock(&self.jobs);
            let Some(i) = jobs.iter().position(|(j, _)| j == id) else {
                return;
            };
            jobs.remove(i).1
        };
        // Dropping the job's event stream is its client leaving: the gateway stops the
        // work within one transformer block and frees the pools.
        if let Some(task) = lock(&job.task).take() {
            task.abort();
        }
        let _ = std::fs::remove_file(self.video_path(id));
        let _ = std::fs::remove_file(self.sidecar(id));
    }

    /// Waits up to `limit` for every job's relay to end, aborting those still running then. After
    /// a drain their requests have ended, so each has only its last bytes and its metadata to
    /// write; a server that stops without this wait could still be writing into the folder
    /// after it returned, or leave a job without its final metadata.
    pub async fn settle(&self, limit: Duration) {
        let relays: Vec<_> = lock(&self.jobs)
            .iter()
            .filter_map(|(id, job)| Some((id.clone(), lock(&job.task).take()?)))
            .collect();
        let deadline = tokio::time::Instant::now() + limit;
        for (id, mut relay) in relays {
            if tokio::time::timeout_at(deadline, &mut relay).await.is_err() {
                tracing::warn!(id, "the video job's relay outlived the shutdown: aborted");
                relay.abort();
            }
        }
    }

    /// Expired jobs go, then the oldest finished ones until count and bytes fit.
    fn enforce(&self) {
        let t = now();
        let doomed: Vec<String> = {
            let jobs = lock(&self.jobs);
            let mut count = jobs.len();
            let mut bytes: u64 = jobs.iter().map(|(_, j)| j.state.borrow().1).sum();
            let mut doomed = Vec::new();
            for (id, job) in jobs.iter() {
                let (video, size) = job.state.borrow().clone();
                if !video.finished() {
                    continue;
                }
                let expired = video.expires_at.is_some_and(|e| e <= t);
                if expired || count > self.cfg.max_count || bytes > self.cfg.max_bytes {
                    doomed.push(id.clone());
                    count -= 1;
                    bytes -= size;
                }
            }
            doomed
        };
        for id in doomed {
            tracing::info!(id, "video expired or over serving.videos bounds: deleted");
            self.delete(&id);
        }
    }

    /// Deletes expired videos every `period`.
    pub async fn expire_every(self: Arc<Self>, period: Duration) {
        loop {
            tokio::time::sleep(period).await;
            self.enforce();
        }
    }

    /// The store's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A Progress event as 0–99 (100 only at Completed): text 0–5, denoising 5–80, decoding 80–99.
fn progress(p: &pb::Progress) -> u32 {
    let total = p.total.max(1) as f64;
    let done = f64::from(p.done).min(total);
    let (start, span) = match pb::Phase::try_from(p.phase) {
        Ok(pb::Phase::Text) => (0.0, 5.0),
        Ok(pb::Phase::Denoise) => (5.0, 75.0),
        Ok(pb::Phase::Decode) => (80.0, 19.0),
        _ => return 0,
    };
    (start + span * done / total).floor() as u32
}
