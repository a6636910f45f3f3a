//! One request's life at the gateway, the same in `serve` and in front of remote pools:
//!
//! 1. **Waiting** for a free denoiser and a decoder (and, with `serving.per_key.max_running`,
//!    for one of the key's running requests to end). A cancel, a departed client or the deadline
//!    ends it here at once, with its slot freed.
//! 2. **Starting**: the decoder's `Decode` stream first (it must know the request before the
//!    latent arrives), then the denoiser's `Denoise`. A pool that cannot be reached, or answers
//!    with a transport failure before the request has started, is dropped from the registry and
//!    the request routed again: it waits for, or moves to, a live pool.
//! 3. **Relaying** both streams in the documented order (progress; the init segment just before
//!    the first media segment; media segments; `Completed`). The denoiser is released the moment
//!    its latent is handed over. A pool lost now ends the request with UNAVAILABLE naming the
//!    pool and the reason.
//!
//! Every send to the client is bounded by `serving.client_send_timeout_s`: a client that reads
//! nothing for that long loses its request (its pool streams are dropped, which cancels the work)
//! and nobody else waits on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ditstream_proto::v1 as pb;
use pb::generate_event::Event as G;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::StreamExt;
use tonic::Status;

use super::pools::{LinkTarget, Pool, PoolStream};
use super::{Shared, Stop, lock};
use ditstream_common::{ms, status};

use crate::pipeline::{decode_job, denoise_job};
use crate::request::GenerateParams;

/// How long the gateway waits for a decoder to acknowledge a request (its init segment).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// An admitted request.
pub struct Admitted {
    /// Its id.
    pub id: String,
    /// What it runs with.
    pub params: GenerateParams,
    /// When it must be done.
    pub deadline: Option<Instant>,
    /// Set by `Cancel` or shutdown.
    pub stop: watch::Receiver<Stop>,
    /// The client's first event.
    pub accepted: pb::Accepted,
}

/// The client's end of a request: a bounded channel of events and, once, the failure status.
pub struct Client {
    tx: mpsc::Sender<pb::GenerateEvent>,
    end: oneshot::Sender<Status>,
    timeout: Duration,
}

impl Client {
    /// `tx` feeds the client's stream; `end` carries its final status.
    pub fn new(
        tx: mpsc::Sender<pb::GenerateEvent>,
        end: oneshot::Sender<Status>,
        timeout: Duration,
    ) -> Client {
        Client { tx, end, timeout }
    }

    /// Sends one event; fails when the client has gone or has read nothing for the timeout.
    async fn send(&self, event: G) -> Result<(), Status> {
        let event = pb::GenerateEvent { event: Some(event) };
        match self.tx.send_timeout(event, self.timeout).await {
            Ok(()) => Ok(()),
            Err(SendTimeoutError::Timeout(_)) => Err(status::client_stalled(self.timeout)),
            Err(SendTimeoutError::Closed(_)) => Err(status::client_gone()),
        }
    }
}

/// What ends a request from outside: the client leaving, `Cancel`, the deadline.
async fn stopped(
    client: &Client,
    stop: &mut watch::Receiver<Stop>,
    deadline: Option<Instant>,
) -> Status {
    let deadline = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = client.tx.closed() => status::client_gone(),
        s = stop.wait_for(|s| *s != Stop::No) => match s.map(|s| *s) {
            Ok(Stop::ShuttingDown) => status::shutting_down(),
            _ => status::cancelled(),
        },
        _ = deadline => status::deadline(),
    }
}

/// Returns a pool to the registry when dropped, however the request ends.
struct Lease<'a> {
    shared: &'a Shared,
    id: Option<String>,
}

impl<'a> Lease<'a> {
    fn new(shared: &'a Shared, pool: &Pool) -> Lease<'a> {
        Lease {
            shared,
            id: Some(pool.id.clone()),
        }
    }

    fn release(&mut self) {
        if let Some(id) = self.id.take() {
            lock(&self.shared.registry).release(&id);
            self.shared.changed.notify_waiters();
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Runs one admitted request to its end, then forgets it.
pub async fn run(shared: Arc<Shared>, request: Admitted, client: Client) {
    let id = request.id.clone();
    let started = Instant::now();
    let outcome = async {
        client.send(G::Accepted(request.accepted.clone())).await?;
        route(&shared, &request, &client).await
    }
    .await;
    shared.forget_request(&id);
    match outcome {
        Ok(done) => {
            shared.metrics.ended("completed");
            if let Some(t) = &done.timings {
                shared.metrics.timings(t);
            }
            tracing::info!(
                id,
                total_ms = ms(started.elapsed()),
                frames = done.frames,
                segments = done.segments,
                "completed"
            )
        }
        Err(status) => {
            shared.metrics.ended(&status::code_name(status.code()));
            tracing::info!(id, code = ?status.code(), message = status.message(), "ended early");
            let _ = client.end.send(status);
        }
    }
}

/// A request's two pool streams, once both have started.
struct Started<'a> {
    denoiser: Pool,
    decoder: Pool,
    denoiser_lease: Lease<'a>,
    _decoder_lease: Lease<'a>,
    denoise: PoolStream<pb::DenoiseEvent>,
    decode: PoolStream<pb::DecodeEvent>,
    init: pb::InitSegment,
}

async fn route(
    shared: &Shared,
    request: &Admitted,
    client: &Client,
) -> Result<pb::Completed, Status> {
    let accepted = Instant::now();
    let deadline = request.deadline;
    let mut cancel = request.stop.clone();
    let mut s = loop {
        let changed = shared.changed.notified();
        // A place for this key first (`serving.per_key.max_running`), then the pools.
        let acquired = if shared.claim(&request.id) {
            let acquired = lock(&shared.registry).acquire();
            if acquired.is_none() {
                shared.unclaim(&request.id);
            }
            acquired
        } else {
            None
        };
        let Some((denoiser, decoder)) = acquired else {
            tokio::select! {
                _ = changed => {}
                // Pools in other processes may have come back without a wake-up reaching us.
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                status = stopped(client, &mut cancel, deadline) => return Err(status),
            }
            continue;
        };
        let start = start(shared, request, denoiser, decoder);
        tokio::select! {
            started = start => match started? {
                Some(s) => break s,
                None => continue,
            },
            status = stopped(client, &mut cancel, deadline) => return Err(status),
        }
    };
    let queue_ms = ms(accepted.elapsed());
    tracing::info!(
        id = request.id,
        denoiser = s.denoiser.reach.address(),
        decoder = s.decoder.reach.address(),
        queue_ms,
        "routed"
    );

    let mut timings = pb::Timings {
        queue_ms,
        ..Default::default()
    };
    let mut init = Some(s.init.clone());
    let mut last_segment: Option<Instant> = None;
    let (mut denoised, mut decoded) = (false, None::<pb::Decoded>);
    let lost = |pool: &Pool, e: Status| {
        if status::is_transport_failure(&e) {
            lock(&shared.registry).forget(&pool.id, e.message());
        }
        status::from_pool(pool.what(), pool.reach.address(), e)
    };
    while !(denoised && decoded.is_some()) {
        tokio::select! {
            event = s.denoise.next(), if !denoised => match event {
                Some(Ok(pb::DenoiseEvent { event: Some(e) })) => match e {
                    pb::denoise_event::Event::Progress(p) => client.send(G::Progress(p)).await?,
                    pb::denoise_event::Event::Denoised(d) => {
                        timings.text_ms = d.text_ms;
                        timings.denoise_ms = d.denoise_ms;
                        denoised = true;
                        // The latent is handed over: the denoiser takes its next request now.
                        s.denoiser_lease.release();
                    }
                },
                Some(Ok(pb::DenoiseEvent { event: None })) => {}
                Some(Err(e)) => return Err(lost(&s.denoiser, e)),
                None => {
                    let what = s.denoiser.what();
                    return Err(status::pool_ended(what, s.denoiser.reach.address(), "its latent"));
                }
            },
            event = s.decode.next() => match event {
                Some(Ok(pb::DecodeEvent { event: Some(e) })) => match e {
                    pb::decode_event::Event::MediaSegment(m) => {
                        if let Some(i) = init.take() {
                            client.send(G::InitSegment(i)).await?;
                        }
                        let bytes = m.data.len();
                        client.send(G::MediaSegment(m)).await?;
                        let now = Instant::now();
                        let gap = last_segment.map(|t| (now - t).as_secs_f64());
                        shared.metrics.segment(bytes, gap);
                        last_segment = Some(now);
                        if timings.first_segment_ms == 0.0 {
                            timings.first_segment_ms = ms(accepted.elapsed());
                        }
                    }
                    pb::decode_event::Event::Progress(p) => client.send(G::Progress(p)).await?,
                    pb::decode_event::Event::Decoded(d) => {
                        timings.decode_ms = d.decode_ms;
                        timings.encode_ms = d.encode_ms;
                        decoded = Some(d);
                    }
                    // A second init segment is not part of the protocol.
                    pb::decode_event::Event::InitSegment(_) => {}
                },
                Some(Ok(pb::DecodeEvent { event: None })) => {}
                Some(Err(e)) => return Err(lost(&s.decoder, e)),
                None => {
                    let what = s.decoder.what();
                    return Err(status::pool_ended(what, s.decoder.reach.address(), "its last segment"));
                }
            },
            status = stopped(client, &mut cancel, deadline) => return Err(status),
        }
    }
    timings.total_ms = ms(accepted.elapsed());
    let d = decoded.unwrap_or_default();
    let completed = pb::Completed {
        timings: Some(timings),
        frames: d.frames,
        segments: d.segments,
    };
    client.send(G::Completed(completed)).await?;
    Ok(completed)
}

/// Opens the request's streams on `decoder` and `denoiser`. `Ok(None)` when a pool turned out
/// to be unreachable (it is dropped; route again); `Err` when a pool refused the request.
async fn start<'a>(
    shared: &'a Shared,
    request: &Admitted,
    denoiser: Pool,
    decoder: Pool,
) -> Result<Option<Started<'a>>, Status> {
    let denoiser_lease = Lease::new(shared, &denoiser);
    let decoder_lease = Lease::new(shared, &decoder);
    let (id, p) = (&request.id, &request.params);
    let unreachable = |pool: &Pool, e: Status| -> Result<Option<Started<'a>>, Status> {
        if status::is_unreachable(&e) {
            tracing::warn!(id, pool_id = %pool.id, error = e.message(), "pool unreachable; routing again");
            lock(&shared.registry).forget(&pool.id, e.message());
            shared.changed.notify_waiters();
            Ok(None)
        } else {
            Err(e)
        }
    };
    let mut decode = match decoder.reach.decode(id, decode_request(id, p)).await {
        Ok(s) => s,
        Err(e) => return unreachable(&decoder, e),
    };
    // The decoder answers with the init segment once the request is registered with its link.
    let init = match tokio::time::timeout(START_TIMEOUT, decode.next()).await {
        Ok(Some(Ok(pb::DecodeEvent {
            event: Some(pb::decode_event::Event::InitSegment(i)),
        }))) => i,
        Ok(Some(Err(e))) => return unreachable(&decoder, e),
        Ok(_) => {
            let e = status::pool_ended(decoder.what(), decoder.reach.address(), "its init segment");
            return unreachable(&decoder, e);
        }
        Err(_) => {
            let e = status::unreachable(
                decoder.what(),
                decoder.reach.address(),
                format!("no init segment within {} s", START_TIMEOUT.as_secs()),
            );
            return unreachable(&decoder, e);
        }
    };
    let denoise = match denoiser
        .reach
        .denoise(id, denoise_request(id, p, &decoder.link))
        .await
    {
        Ok(s) => s,
        Err(e) => return unreachable(&denoiser, e),
    };
    Ok(Some(Started {
        denoiser,
        decoder,
        denoiser_lease,
        _decoder_lease: decoder_lease,
        denoise,
        decode,
        init,
    }))
}

/// The denoiser's half of a request on the wire (the gateway's one domain → wire conversion for
/// each pool).
fn denoise_request(id: &str, p: &GenerateParams, link: &LinkTarget) -> pb::DenoiseRequest {
    let job = denoise_job(p);
    pb::DenoiseRequest {
        request_id: id.to_string(),
        prompt: job.prompt,
        negative_prompt: job.negative_prompt,
        width: job.width as u32,
        height: job.height as u32,
        num_frames: job.num_frames as u32,
        steps: job.steps as u32,
        guidance_scale: job.guidance_scale,
        guidance_scale_2: job.guidance_scale_2,
        seed: job.seed,
        decoder_link_address: link.address.clone(),
        decoder_link_host: link.host.clone(),
        decoder_link_kind: link.kind as i32,
    }
}

/// The decoder's half of a request on the wire.
fn decode_request(id: &str, p: &GenerateParams) -> pb::DecodeRequest {
    let job = decode_job(p);
    pb::DecodeRequest {
        request_id: id.to_string(),
        width: job.width as u32,
        height: job.height as u32,
        num_frames: job.num_frames as u32,
        fps: job.fps,
        segment_frames: job.segment_frames as u32,
    }
}
