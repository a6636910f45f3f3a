//! One decoder instance: `DecoderPool.Decode` around a [`DecodeStage`]. A Decode call registers
//! the request with the latent link (its first event is the init segment, which tells the
//! gateway the latent may flow); its chunks are decoded and encoded as they arrive, each segment
//! streamed back the moment it exists. The instance keeps each request's causal VAE cache until
//! its last chunk. A gateway that goes away (the client cancelled or left) ends the decode at the
//! next chunk, or at once while it waits for one.
//!
//! The same service runs behind its own gRPC listener and latent link (`ditstream decoder`) and
//! inside `ditstream serve`, where the gateway calls it directly and the denoiser hands it the
//! latent in memory.

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::decoder_pool_server::{DecoderPool, DecoderPoolServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use ditstream_common::link::pool::{self as link, Pending};
use ditstream_common::mesh::LatentGeometry;
use ditstream_common::{registration, status};

use crate::error::StageError;
use crate::stage::{DecodeJob, DecodeStage, MAX_SEGMENT_FRAMES, SegmentTicket};

/// How long a request may wait for its next latent chunk before the decode fails.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(300);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map operation: a poisoned lock still holds a consistent map.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The request a `Decode` call carries, in domain terms (the one wire → domain conversion).
fn job_of(r: pb::DecodeRequest, geometry: LatentGeometry) -> Result<(String, DecodeJob), Status> {
    let size = geometry.check_size(r.width as usize, r.height as usize, r.num_frames as usize);
    if let Err((field, value, rule)) = size {
        return Err(status::invalid_field(field, value, &rule));
    }
    if r.fps == 0 {
        return Err(status::invalid_field("fps", 0, "must be at least 1"));
    }
    if r.segment_frames == 0 || r.segment_frames > MAX_SEGMENT_FRAMES {
        return Err(status::invalid_field(
            "segment_frames",
            r.segment_frames,
            &format!("must be in 1..={MAX_SEGMENT_FRAMES}"),
        ));
    }
    let job = DecodeJob {
        width: r.width as usize,
        height: r.height as usize,
        num_frames: r.num_frames as usize,
        fps: r.fps,
        segment_frames: r.segment_frames as usize,
    };
    Ok((r.request_id, job))
}

/// What a decode's VAE thread hands its forwarder, in stream order.
enum Out {
    /// An event to send as it is.
    Event(pb::decode_event::Event),
    /// A segment being encoded: sent once encoded.
    Segment(SegmentTicket),
    /// Every latent frame is decoded and every segment submitted: the `Decoded` event, with the
    /// encoders' time summed by the forwarder.
    Decoded {
        decode_ms: f64,
        frames: u32,
        segments: u32,
    },
}

/// How a forwarder ended.
enum Forwarded {
    /// Everything it was handed is sent.
    All,
    /// A segment failed to encode: its INTERNAL status is sent and the stream ends there.
    Failed,
    /// The gateway stopped reading.
    GatewayGone,
}

/// Sends a decode's events to the gateway in order, waiting on each segment's ticket in turn.
async fn forward(
    mut outs: mpsc::Receiver<Out>,
    tx: mpsc::Sender<Result<pb::DecodeEvent, Status>>,
) -> Forwarded {
    let mut encode_ms = 0.0;
    while let Some(out) = outs.recv().await {
        let e = match out {
            Out::Event(e) => e,
            Out::Segment(ticket) => match ticket.recv().await {
                Ok(encoded) => {
                    encode_ms += encoded.encode_ms;
                    let seg = encoded.segment;
                    pb::decode_event::Event::MediaSegment(pb::MediaSegment {
                        sequence_number: seg.sequence_number,
                        first_frame: seg.first_frame as u32,
                        frame_count: seg.frame_count,
                        data: seg.bytes,
                    })
                }
                Err(e) => {
                    tracing::info!(error = %e, "decode ended early");
                    let _ = tx.send(Err(status::internal("decoder", e))).await;
                    return Forwarded::Failed;
                }
            },
            Out::Decoded {
                decode_ms,
                frames,
                segments,
            } => {
                tracing::info!(decode_ms, encode_ms, segments, "decoded");
                pb::decode_event::Event::Decoded(pb::Decoded {
                    decode_ms,
                    encode_ms,
                    frames,
                    segments,
                })
            }
        };
        if tx.send(event(e)).await.is_err() {
            return Forwarded::GatewayGone;
        }
    }
    Forwarded::All
}

/// The instance's gRPC service.
pub struct DecoderService {
    stage: Arc<DecodeStage>,
    pending: Pending,
    active: Arc<AtomicU32>,
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

fn event(e: pb::decode_event::Event) -> Result<pb::DecodeEvent, Status> {
    Ok(pb::DecodeEvent { event: Some(e) })
}

impl DecoderService {
    /// The service over `stage`, whose requests take their chunks from `pending` (fed by the
    /// latent link's listener, or in `serve` by the denoiser directly).
    pub fn new(stage: Arc<DecodeStage>, pending: Pending) -> DecoderService {
        DecoderService {
            stage,
            pending,
            active: Arc::new(AtomicU32::new(0)),
        }
    }
}

impl DecoderService {
    /// The VAE ranks and their devices.
    pub fn description(&self) -> String {
        let devices: Vec<String> = self.stage.devices().iter().map(|d| d.to_string()).collect();
        format!("VAE on {} rank(s): {}", devices.len(), devices.join(", "))
    }
}

#[tonic::async_trait]
impl DecoderPool for DecoderService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let logged_id = registration::request_id_of(&request, &request.get_ref().request_id);
        let (id, job) = job_of(request.into_inner(), self.stage.geometry())?;
        if let Some(why) = self.stage.out_of_service() {
            return Err(status::out_of_service("decoder instance", &why));
        }
        let (chunk_tx, mut chunk_rx) = mpsc::channel::<link::Delivery>(64);
        {
            let mut pending = lock(&self.pending);
            if pending.contains_key(&id) {
                return Err(status::duplicate(&id));
            }
            pending.insert(id.clone(), chunk_tx);
        }
        let (tx, rx) = mpsc::channel::<Result<pb::DecodeEvent, Status>>(64);
        let (stage, pending, active) = (
            Arc::clone(&self.stage),
            Arc::clone(&self.pending),
            Arc::clone(&self.active),
        );
        active.fetch_add(1, Ordering::Relaxed);
        let handle = tokio::runtime::Handle::current();
        // Events in stream order from the VAE's thread; the forwarder waits on each segment's
        // ticket in turn, so segments leave in order the moment each is encoded.
        let (out_tx, out_rx) = mpsc::channel::<Out>(64);
        let forwarder = handle.spawn(forward(out_rx, tx.clone()));
        tokio::task::spawn_blocking(move || {
            let _span = tracing::info_span!("decode", id = %logged_id).entered();
            let gone = || StageError::GatewayGone;
            let result = (|| -> Result<(), StageError> {
                let mut session = stage.start(&job)?;
                let (data, mime_type) = session.init_segment();
                let send = |o: Out| out_tx.blocking_send(o).map_err(|_| gone());
                send(Out::Event(pb::decode_event::Event::InitSegment(
                    pb::InitSegment { data, mime_type },
                )))?;
                let channels = stage.latent_channels() as u64;
                let (_, h, w) = stage
                    .geometry()
                    .latent_grid(job.num_frames, job.height, job.width);
                let (h, w) = (h as u64, w as u64);
                while !session.is_done() {
                    let arrived = handle.block_on(async {
                        tokio::select! {
                            chunk = tokio::time::timeout(CHUNK_TIMEOUT, chunk_rx.recv()) => chunk
                                .map_err(|_| StageError::ChunkTimeout { seconds: CHUNK_TIMEOUT.as_secs() })?
                                .ok_or(StageError::LinkClosed)?
                                .map_err(StageError::from),
                            // The gateway went away (or the forwarder ended on a failed
                            // segment): no need to wait for the chunk.
                            _ = tx.closed() => Err(gone()),
                            _ = out_tx.closed() => Err(gone()),
                        }
                    })?;
                    let s = &arrived.header.shape;
                    if s.len() != 5 || s[0] != 1 || s[1] != channels || s[3] != h || s[4] != w {
                        return Err(StageError::ArrivedShape {
                            chunk_index: arrived.header.chunk_index,
                            shape: s.clone(),
                            channels,
                            height: h,
                            width: w,
                        });
                    }
                    for ticket in session.push(&arrived.latent)? {
                        send(Out::Segment(ticket))?;
                    }
                    send(Out::Event(pb::decode_event::Event::Progress(
                        pb::Progress {
                            phase: pb::Phase::Decode as i32,
                            done: session.frames,
                            total: job.num_frames as u32,
                        },
                    )))?;
                }
                send(Out::Decoded {
                    decode_ms: session.decode_ms,
                    frames: session.frames,
                    segments: session.segments,
                })
            })();
            drop(out_tx);
            // The forwarder ends when it has sent everything, or at the first failed segment
            // (whose status it sent), or when the gateway went away.
            let forwarded = handle.block_on(forwarder).unwrap_or(Forwarded::GatewayGone);
            match (result, forwarded) {
                (Ok(()), _) | (Err(_), Forwarded::Failed | Forwarded::GatewayGone) => {}
                (Err(e), Forwarded::All) => {
                    tracing::info!(error = %e, "decode ended early");
                    let _ = tx.blocking_send(Err(status::internal("decoder", e)));
                }
            }
            lock(&pending).remove(&id);
            active.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// The stage after its warm-up (see [`DecodeStage::warm_up`]): the instance registers only then.
fn warm(stage: DecodeStage, cfg: &Config) -> Result<DecodeStage, StageError> {
    let shapes = cfg.serving.warmup_shapes();
    let took = stage.warm_up(&shapes, cfg.serving.fps)?;
    if !shapes.is_empty() {
        tracing::info!(?shapes, ?took, "decoder warmed up (ms per shape)");
    }
    Ok(stage)
}

/// Builds the VAE, warms it up, listens on gRPC and the latent link, and registers with the
/// gateway.
pub async fn start(cfg: &Config) -> Result<registration::RunningPool, StageError> {
    let build = cfg.clone();
    let stage = Arc::new(
        tokio::task::spawn_blocking(move || warm(DecodeStage::from_config(&build)?, &build))
            .await??,
    );
    let identity = link::identity(cfg)?;
    let pending: Pending = Arc::default();
    let (link_addr, link_task) =
        link::listen(cfg, &identity, Arc::clone(&pending), stage.link_gpu()).await?;
    let health_stage = Arc::clone(&stage);
    let health: registration::Health = Arc::new(move || health_stage.out_of_service());
    let service = DecoderService::new(stage, pending);
    let active = Arc::clone(&service.active);
    let server = DecoderPoolServer::new(service)
        .max_decoding_message_size(cfg.connections.max_request_bytes)
        .max_encoding_message_size(64 << 20);
    let (grpc_addr, grpc_task) = registration::serve(
        cfg,
        "pools.decoder_listen",
        &cfg.pools.decoder_listen,
        &identity,
        server,
    )
    .await?;
    let registration = pb::RegisterRequest {
        role: pb::PoolRole::Decoder as i32,
        address: grpc_addr.to_string(),
        link_address: link_addr.to_string(),
        link_host: cfg.pools.link_host.clone(),
        model: cfg.model_name(),
        link_kind: link::wire_kind(cfg.pools.link) as i32,
    };
    let registration = registration::Registered::start(
        cfg.pools.gateway.clone(),
        Arc::new(identity),
        registration,
        active,
        health,
    );
    tracing::info!(%grpc_addr, %link_addr, "decoder instance up");
    Ok(registration::RunningPool::new(
        grpc_addr,
        Some(link_addr),
        registration,
        vec![link_task, grpc_task],
    ))
}
