//! `ditstream decoder`: one decoder instance. It listens for latent chunks on its QUIC latent
//! link and serves `DecoderPool.Decode` to the gateway: a Decode call registers the request, and
//! its chunks are decoded and encoded as they arrive, each segment streamed back the moment it
//! exists. The instance keeps each request's causal VAE cache until its last chunk.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use ditstream_common::config::Config;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::decoder_pool_server::{DecoderPool, DecoderPoolServer};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

use crate::engine::{Event, Phase};
use crate::pipeline::{DecodeStage, model_name};
use crate::request::GenerateParams;
use crate::roles::link::{self, Pending};
use crate::roles::{addr, link_identity, registration};

/// How long a request may wait for its next latent chunk before the decode fails.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(300);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Each critical section is one map operation: a poisoned lock still holds a consistent map.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct DecoderService {
    stage: Arc<DecodeStage>,
    pending: Pending,
    active: Arc<AtomicU32>,
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

fn event(e: pb::decode_event::Event) -> Result<pb::DecodeEvent, Status> {
    Ok(pb::DecodeEvent { event: Some(e) })
}

#[tonic::async_trait]
impl DecoderPool for DecoderService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let r = request.into_inner();
        if let Some(why) = self.stage.out_of_service() {
            return Err(Status::unavailable(format!(
                "this decoder instance is out of service: {why}"
            )));
        }
        let params = GenerateParams {
            prompt: String::new(),
            negative_prompt: String::new(),
            width: r.width as usize,
            height: r.height as usize,
            num_frames: r.num_frames as usize,
            fps: r.fps,
            steps: 0,
            guidance_scale: 0.0,
            guidance_scale_2: None,
            seed: 0,
            segment_frames: r.segment_frames as usize,
        };
        if params.width == 0
            || params.height == 0
            || !params.width.is_multiple_of(16)
            || !params.height.is_multiple_of(16)
        {
            return Err(Status::invalid_argument(format!(
                "{}x{}: width and height must be positive multiples of 16",
                r.width, r.height
            )));
        }
        if params.num_frames % 4 != 1 || params.fps == 0 || params.segment_frames == 0 {
            return Err(Status::invalid_argument(format!(
                "num_frames = {} (must be 4k+1), fps = {}, segment_frames = {} (must be ≥ 1)",
                r.num_frames, r.fps, r.segment_frames
            )));
        }
        let (chunk_tx, mut chunk_rx) = mpsc::channel::<link::Delivery>(64);
        {
            let mut pending = lock(&self.pending);
            if pending.contains_key(&r.request_id) {
                return Err(Status::already_exists(format!(
                    "request {} is already decoding here",
                    r.request_id
                )));
            }
            pending.insert(r.request_id.clone(), chunk_tx);
        }
        let (tx, rx) = mpsc::channel::<Result<pb::DecodeEvent, Status>>(64);
        let (stage, pending, active) = (
            Arc::clone(&self.stage),
            Arc::clone(&self.pending),
            Arc::clone(&self.active),
        );
        let id = r.request_id.clone();
        active.fetch_add(1, Ordering::Relaxed);
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let _span = tracing::info_span!("decode", id = %id).entered();
            let result = (|| -> anyhow::Result<()> {
                let mut session = stage.start(&params)?;
                let Event::Init { data, mime_type } = session.init_event() else {
                    anyhow::bail!("the init event is always Init");
                };
                let send = |e| {
                    tx.blocking_send(e)
                        .map_err(|_| anyhow::anyhow!("the gateway went away"))
                };
                send(event(pb::decode_event::Event::InitSegment(
                    pb::InitSegment { data, mime_type },
                )))?;
                let channels = stage.latent_channels() as u64;
                let (h, w) = ((params.height / 8) as u64, (params.width / 8) as u64);
                while !session.is_done() {
                    let arrived = handle
                        .block_on(async {
                            tokio::time::timeout(CHUNK_TIMEOUT, chunk_rx.recv()).await
                        })
                        .map_err(|_| {
                            anyhow::anyhow!("no latent chunk for {} s", CHUNK_TIMEOUT.as_secs())
                        })?
                        .context("the latent link closed before the last chunk")??;
                    let s = &arrived.header.shape;
                    if s.len() != 5 || s[0] != 1 || s[1] != channels || s[3] != h || s[4] != w {
                        anyhow::bail!(
                            "chunk {} has shape {s:?}; this request's latent is [1, {channels}, n, {h}, {w}]",
                            arrived.header.chunk_index
                        );
                    }
                    for seg in session.push(&arrived.latent)? {
                        send(event(pb::decode_event::Event::MediaSegment(
                            pb::MediaSegment {
                                sequence_number: seg.sequence_number,
                                first_frame: seg.first_frame,
                                frame_count: seg.frame_count,
                                data: seg.data,
                            },
                        )))?;
                    }
                    send(event(pb::decode_event::Event::Progress(pb::Progress {
                        phase: pb::Phase::from(Phase::Decode) as i32,
                        done: session.frames,
                        total: params.num_frames as u32,
                    })))?;
                }
                send(event(pb::decode_event::Event::Decoded(pb::Decoded {
                    decode_ms: session.decode_ms,
                    encode_ms: session.encode_ms,
                    frames: session.frames,
                    segments: session.segments,
                })))?;
                Ok(())
            })();
            if let Err(e) = result {
                tracing::warn!(error = %format!("{e:#}"), "decode ended early");
                let _ = tx.blocking_send(Err(Status::internal(format!("decoder: {e:#}"))));
            }
            lock(&pending).remove(&id);
            active.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

impl From<Phase> for pb::Phase {
    fn from(p: Phase) -> pb::Phase {
        match p {
            Phase::Text => pb::Phase::Text,
            Phase::Denoise => pb::Phase::Denoise,
            Phase::Decode => pb::Phase::Decode,
        }
    }
}

/// A decoder instance running in this process.
pub struct RunningDecoder {
    /// Its gRPC address.
    pub addr: SocketAddr,
    /// Its latent-link address.
    pub link_addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RunningDecoder {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Builds the VAE, listens on gRPC and the latent link, and registers with the gateway.
pub async fn start(cfg: &Config, config_dir: &Path) -> anyhow::Result<RunningDecoder> {
    let build = cfg.clone();
    let stage =
        Arc::new(tokio::task::spawn_blocking(move || DecodeStage::from_config(&build)).await??);
    let identity = link_identity(cfg, config_dir)?;
    let pending: Pending = Arc::default();
    let (link_addr, link_task) =
        link::listen(cfg, &identity, Arc::clone(&pending), stage.link_gpu()).await?;
    let listener =
        tokio::net::TcpListener::bind(addr("pools.decoder_listen", &cfg.pools.decoder_listen)?)
            .await?;
    let grpc_addr = listener.local_addr()?;
    let active = Arc::new(AtomicU32::new(0));
    let health_stage = Arc::clone(&stage);
    let health: registration::Health = Arc::new(move || health_stage.out_of_service());
    let service = DecoderService {
        stage,
        pending,
        active: Arc::clone(&active),
    };
    let grpc_task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(DecoderPoolServer::new(service).max_encoding_message_size(64 << 20))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "decoder gRPC server failed");
        }
    });
    let registration = pb::RegisterRequest {
        role: pb::PoolRole::Decoder as i32,
        address: grpc_addr.to_string(),
        link_address: link_addr.to_string(),
        link_host: cfg.pools.link_host.clone(),
        model: model_name(cfg),
        link_kind: link::kind_name(cfg.pools.link).to_string(),
    };
    let reg_task = tokio::spawn(registration::keep_registered(
        cfg.pools.gateway.clone(),
        registration,
        active,
        health,
    ));
    tracing::info!(%grpc_addr, %link_addr, "decoder instance up");
    Ok(RunningDecoder {
        addr: grpc_addr,
        link_addr,
        tasks: vec![link_task, grpc_task, reg_task],
    })
}
