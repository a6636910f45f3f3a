//! The gRPC `VideoService`: converts between wire types and the engine's domain types, and maps
//! every failure to a status code once. Streaming replies go engine channel → tonic stream; a
//! stream the client drops closes the channel, which the engine takes as a cancel.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ditstream_common::config::{Config, DeviceKind};
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_server::VideoService;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::engine::{Engine, Event, Failure, Phase, Rejected};
use crate::request::RawRequest;

/// The service over one engine.
pub struct VideoServer {
    engine: Arc<Engine>,
    cfg: Config,
    description: String,
}

impl VideoServer {
    /// Serves `engine`, built from `cfg`.
    pub fn new(engine: Arc<Engine>, cfg: Config) -> VideoServer {
        let description = match cfg.validate(None) {
            Ok(mesh) => {
                let device = format!("{mesh}, device {:?}", cfg.serving.device).to_lowercase();
                match cfg.serving.device {
                    DeviceKind::Cpu => device,
                    DeviceKind::Cuda => {
                        match cfg.rank_gpus("the pipeline", gpus_used(&cfg, &mesh)) {
                            Ok(gpus) => format!("{device} (gpus {gpus:?})"),
                            Err(e) => format!("{device} ({e})"),
                        }
                    }
                }
            }
            Err(e) => e.to_string(),
        };
        VideoServer {
            engine,
            cfg,
            description,
        }
    }
}

/// GPUs one `serve` process uses: denoiser rank r and VAE rank r share `serving.gpus[r]`.
fn gpus_used(cfg: &Config, mesh: &ditstream_common::mesh::Mesh) -> usize {
    mesh.world_size().max(cfg.vae_layout().size())
}

/// The `grpc-timeout` header (e.g. `30S`, `500m`) as a duration.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// An engine event as the client sees it; failures become the stream's final status.
pub fn to_wire(event: Event) -> Result<pb::GenerateEvent, Status> {
    use pb::generate_event::Event as E;
    let event = match event {
        Event::Progress { phase, done, total } => E::Progress(pb::Progress {
            phase: match phase {
                Phase::Text => pb::Phase::Text,
                Phase::Denoise => pb::Phase::Denoise,
                Phase::Decode => pb::Phase::Decode,
            } as i32,
            done,
            total,
        }),
        Event::Init { data, mime_type } => E::InitSegment(pb::InitSegment { data, mime_type }),
        Event::Segment(s) => E::MediaSegment(pb::MediaSegment {
            sequence_number: s.sequence_number,
            first_frame: s.first_frame,
            frame_count: s.frame_count,
            data: s.data,
        }),
        Event::Completed {
            timings: t,
            frames,
            segments,
        } => E::Completed(pb::Completed {
            timings: Some(pb::Timings {
                queue_ms: t.queue_ms,
                text_ms: t.text_ms,
                denoise_ms: t.denoise_ms,
                decode_ms: t.decode_ms,
                encode_ms: t.encode_ms,
                first_segment_ms: t.first_segment_ms,
                total_ms: t.total_ms,
            }),
            frames,
            segments,
        }),
        Event::Failed(Failure::Cancelled) => {
            return Err(Status::cancelled("the request was cancelled"));
        }
        Event::Failed(Failure::DeadlineExceeded) => {
            return Err(Status::deadline_exceeded("the request's deadline passed"));
        }
        Event::Failed(Failure::Internal(message)) => return Err(Status::internal(message)),
    };
    Ok(pb::GenerateEvent { event: Some(event) })
}

impl From<pb::GenerateRequest> for RawRequest {
    fn from(r: pb::GenerateRequest) -> RawRequest {
        RawRequest {
            prompt: r.prompt,
            negative_prompt: r.negative_prompt,
            width: r.width,
            height: r.height,
            num_frames: r.num_frames,
            fps: r.fps,
            steps: r.steps,
            guidance_scale: r.guidance_scale,
            guidance_scale_2: r.guidance_scale_2,
            seed: r.seed,
            model: r.model,
            segment_frames: r.segment_frames,
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl VideoService for VideoServer {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let deadline = grpc_timeout(request.metadata()).map(|d| Instant::now() + d);
        let raw = RawRequest::from(request.into_inner());
        let params = raw
            .validate(&self.cfg, self.engine.model_name())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let accepted = pb::Accepted {
            request_id: String::new(),
            queue_position: 0,
            width: params.width as u32,
            height: params.height as u32,
            num_frames: params.num_frames as u32,
            fps: params.fps,
            steps: params.steps as u32,
            seed: params.seed,
        };
        let submitted = self.engine.submit(params, deadline).map_err(|e| match e {
            Rejected::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
            Rejected::ShuttingDown => Status::unavailable(e.to_string()),
        })?;
        tracing::info!(id = %submitted.id, position = submitted.queue_position, "accepted");
        let first = pb::GenerateEvent {
            event: Some(pb::generate_event::Event::Accepted(pb::Accepted {
                request_id: submitted.id,
                queue_position: submitted.queue_position as u32,
                ..accepted
            })),
        };
        let mut events = submitted.events;
        let stream = async_stream::stream! {
            yield Ok(first);
            while let Some(event) = events.recv().await {
                let last = matches!(event, Event::Completed { .. } | Event::Failed(_));
                let item = to_wire(event);
                let failed = item.is_err();
                yield item;
                if last || failed {
                    break;
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cancel(
        &self,
        request: Request<pb::CancelRequest>,
    ) -> Result<Response<pb::CancelResponse>, Status> {
        let cancelled = self.engine.cancel(&request.into_inner().request_id);
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        let (queued, running) = self.engine.load();
        Ok(Response::new(pb::HealthResponse {
            serving: true,
            queued: queued as u32,
            running: running as u32,
        }))
    }

    async fn list_models(
        &self,
        _: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: self.engine.model_name().to_string(),
                description: self.description.clone(),
            }],
        }))
    }
}
