//! The HTTP API, on the public listener beside gRPC (HTTP/1.1 and HTTP/2): OpenAI's Videos
//! API, so generic clients (the official `openai` SDK, LiteLLM, benchmark tools) work
//! unchanged, plus a page that plays the video while it is made, and `/metrics`.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/videos` | JSON or multipart form fields `{model, prompt, size: "WxH", seconds, negative_prompt, num_frames, fps, seed, num_inference_steps, guidance_scale}` → the Video object (`queued`); a file part (`input_reference`) is refused until image input exists |
//! | `GET /v1/videos/{id}` | the Video object, with `openai-poll-after-ms` while it runs |
//! | `GET /v1/videos?after&limit&order` | the caller's videos, a cursor page |
//! | `GET /v1/videos/{id}/content` | the MP4; while the job runs, streamed as segments are made (chunked), playable up to its last complete segment; `variant=thumbnail`: frame 0 as a PNG |
//! | `GET /v1/videos/{id}/events` | server-sent events: the Video object at every change, until it is finished |
//! | `DELETE /v1/videos/{id}` | cancels the work if it runs (the pools stop within one transformer block), deletes the file |
//! | `GET /` | the page: prompt form, progress, a `<video>` fed segment by segment through Media Source Extensions |
//! | `GET /metrics` | Prometheus text format |
//!
//! A job is a client of the gateway's `Generate`, so admission, per-key limits, cancellation
//! and ownership are the gRPC ones; errors come in OpenAI's shape
//! `{error: {message, type, param, code}}` with the matching HTTP status.

pub mod thumbnail;
pub mod videos;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use ditstream_proto::v1 as pb;
use ditstream_proto::v1::video_service_server::VideoService;
use serde::Deserialize;
use tokio_stream::StreamExt;

use crate::gateway::Gateway;
use ditstream_common::status;
use videos::{Store, Video, now};

/// The page at `/`: plain HTML and JS, nothing fetched from elsewhere.
const PAGE: &str = include_str!("page.html");

/// How often a client should poll a running job.
const POLL_AFTER_MS: &str = "250";

/// An error in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: String,
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: "invalid_value".into(),
            param: Some(param),
            message: message.into(),
        }
    }

    /// A body that could not be read: larger than `connections.max_request_bytes` (413), not
    /// in full within `connections.request_timeout_s` (408, the deadline's status found in the
    /// error's sources), or malformed (400).
    fn unreadable_body(
        status: StatusCode,
        text: String,
        error: &(dyn std::error::Error + 'static),
        max_body: usize,
    ) -> ApiError {
        let mut source = Some(error);
        while let Some(e) = source {
            if let Some(s) = e.downcast_ref::<tonic::Status>()
                && s.code() == tonic::Code::DeadlineExceeded
            {
                return ApiError {
                    status: StatusCode::REQUEST_TIMEOUT,
                    kind: "invalid_request_error",
                    code: "request_timeout".into(),
                    param: Some("body"),
                    message: s.message().to_string(),
                };
            }
            source = e.source();
        }
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError {
                status,
                kind: "invalid_request_error",
                code: "request_too_large".into(),
                param: Some("body"),
                message: format!(
                    "the body is over connections.max_request_bytes = {max_body} bytes"
                ),
            };
        }
        ApiError::invalid("body", text)
    }

    fn not_found(id: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: "not_found".into(),
            param: Some("video_id"),
            message: format!("no video {} of this API key", status::shown(id)),
        }
    }
}

impl From<tonic::Status> for ApiError {
    /// The gRPC status a request got, as the matching HTTP error.
    fn from(s: tonic::Status) -> ApiError {
        use tonic::Code as C;
        let (status, kind) = match s.code() {
            C::InvalidArgument | C::FailedPrecondition | C::OutOfRange => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            C::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error"),
            C::PermissionDenied => (StatusCode::FORBIDDEN, "permission_error"),
            C::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error"),
            C::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            C::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            C::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "server_error"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        };
        ApiError {
            status,
            kind,
            code: status::code_name(s.code()),
            param: None,
            message: s.message().to_string(),
        }
    }
}

impl From<axum::extract::rejection::QueryRejection> for ApiError {
    /// A query string that does not parse (`limit=-5`), in OpenAI's shape like every error.
    fn from(e: axum::extract::rejection::QueryRejection) -> ApiError {
        ApiError::invalid("query", e.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        (self.status, axum::Json(body)).into_response()
    }
}

/// What the routes share.
#[derive(Clone)]
struct Http {
    gateway: Gateway,
    store: Arc<Store>,
    fps: u32,
    /// `connections.max_request_bytes`, named when a body is over it.
    max_body: usize,
}

impl Http {
    /// Who the request acts for (the gateway's API keys).
    fn owner(&self, headers: &HeaderMap) -> Result<String, ApiError> {
        Ok(self
            .gateway
            .authenticate(&tonic::metadata::MetadataMap::from_headers(headers.clone()))?)
    }

    fn job(&self, headers: &HeaderMap, id: &str) -> Result<Arc<videos::Job>, ApiError> {
        let owner = self.owner(headers)?;
        self.store
            .get(id, &owner)
            .ok_or_else(|| ApiError::not_found(id))
    }
}

/// The HTTP routes, served beside the gRPC services on the public listener.
pub fn router(gateway: Gateway, store: Arc<Store>, max_body: usize) -> Router {
    let fps = gateway.default_fps();
    let state = Http {
        gateway,
        store,
        fps,
        max_body,
    };
    Router::new()
        .route("/", get(page))
        .route("/metrics", get(metrics))
        .route("/v1/videos", get(list).post(create))
        .route("/v1/videos/{id}", get(retrieve).delete(delete))
        .route("/v1/videos/{id}/content", get(content))
        .route("/v1/videos/{id}/events", get(events))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Counts every HTTP answer at `/metrics`, by route template (so ids add no series) and status:
/// errors the handlers never see (413, 405, 408, an unknown route) included. A gRPC call to
/// no service is answered here too, but as gRPC, and is not counted.
async fn count(State(h): State<Http>, request: axum::extract::Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_string();
    let response = next.run(request).await;
    let grpc = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if !grpc {
        h.gateway.http_response(&route, response.status().as_u16());
    }
    response
}

/// A route nobody serves: gRPC's UNIMPLEMENTED for a gRPC call (tonic's own answer for an
/// unknown service), OpenAI's 404 shape otherwise.
async fn unknown_route(headers: HeaderMap) -> Response {
    let grpc = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/grpc"));
    if grpc {
        return tonic::Status::unimplemented("no such gRPC service or method here").into_http();
    }
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: "unknown_route".into(),
        param: None,
        message: "no such route".into(),
    }
    .into_response()
}

/// A known route with a method it does not serve, in OpenAI's shape (axum's own answer is an
/// empty 405).
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        kind: "invalid_request_error",
        code: "method_not_allowed".into(),
        param: None,
        message: format!("{method} is not served at {}", uri.path()),
    }
}

async fn page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

async fn metrics(State(h): State<Http>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        h.gateway.metrics_text(),
    )
        .into_response()
}

/// `POST /v1/videos`: OpenAI's fields, and Wan's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateVideo {
    prompt: String,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    size: Option<String>,
    #[serde(default)]
    seconds: Option<String>,
    #[serde(default)]
    negative_prompt: Option<String>,
    #[serde(default)]
    num_frames: Option<u32>,
    #[serde(default)]
    fps: Option<u32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    num_inference_steps: Option<u32>,
    #[serde(default)]
    guidance_scale: Option<f64>,
}

/// "WxH" → (W, H).
fn parse_size(size: &str) -> Option<(u32, u32)> {
    let (w, h) = size.split_once(['x', 'X'])?;
    Some((w.trim().parse().ok()?, h.trim().parse().ok()?))
}

/// Seconds at `fps` as a 4k+1 frame count (the nearest, at least 1); `None` past `u32`.
fn frames_for(seconds: f64, fps: u32) -> Option<u32> {
    let k = (seconds * f64::from(fps) / 4.0).round().max(0.0);
    if k >= f64::from(u32::MAX / 4) {
        return None;
    }
    Some(k as u32 * 4 + 1)
}

/// OpenAI's `param` for an INVALID_ARGUMENT from the request's checks, whose messages start
/// with the field they name (`width = 7: …`, `common/src/status.rs`); `seconds` when the frame
/// count came from it.
fn param_of(message: &str, from_seconds: bool) -> Option<&'static str> {
    let (field, _) = message.split_once(" = ")?;
    Some(match field {
        "width" | "height" => "size",
        "num_frames" if from_seconds => "seconds",
        "num_frames" => "num_frames",
        "steps" => "num_inference_steps",
        "prompt" => "prompt",
        "negative_prompt" => "negative_prompt",
        "model" => "model",
        "fps" => "fps",
        "seed" => "seed",
        "guidance_scale" => "guidance_scale",
        _ => return None,
    })
}

/// A clip's length as the Video object writes it ("1", "1.0625").
fn seconds_text(frames: u32, fps: u32) -> String {
    let s = f64::from(frames) / f64::from(fps.max(1));
    let text = format!("{s:.4}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The fields of a multipart body (what the SDK sends): text fields only; a file part (an
/// `input_reference` image) is refused until image input exists.
async fn multipart_fields(
    mut form: axum::extract::Multipart,
    max_body: usize,
) -> Result<serde_json::Value, ApiError> {
    const TEXT: [&str; 5] = ["prompt", "model", "size", "seconds", "negative_prompt"];
    let bad = |e: axum::extract::multipart::MultipartError| {
        ApiError::unreadable_body(e.status(), e.body_text(), &e, max_body)
    };
    let mut fields = serde_json::Map::new();
    while let Some(field) = form.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or("").to_string();
        if field.file_name().is_some() || name == "input_reference" {
            return Err(ApiError::invalid(
                "input_reference",
                "an input_reference image is not supported yet: this server generates video \
                 from text only",
            ));
        }
        let text = field.text().await.map_err(bad)?;
        // Form fields are text; the numeric extras (num_inference_steps, seed, …) as numbers.
        let value = match serde_json::from_str(&text) {
            Ok(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)))
                if !TEXT.contains(&name.as_str()) =>
            {
                v
            }
            _ => serde_json::Value::String(text),
        };
        fields.insert(name, value);
    }
    Ok(serde_json::Value::Object(fields))
}

async fn create(
    State(h): State<Http>,
    request: axum::extract::Request,
) -> Result<Response, ApiError> {
    use axum::extract::FromRequest;
    let headers = request.headers().clone();
    let owner = h.owner(&headers)?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let body = if content_type.starts_with("multipart/form-data") {
        let form = axum::extract::Multipart::from_request(request, &())
            .await
            .map_err(|e| ApiError::invalid("body", e.body_text()))?;
        multipart_fields(form, h.max_body).await?
    } else {
        let bytes = Bytes::from_request(request, &())
            .await
            .map_err(|e| ApiError::unreadable_body(e.status(), e.body_text(), &e, h.max_body))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::invalid("body", format!("not JSON: {e}")))?
    };
    let r: CreateVideo = serde_json::from_value(body)
        .map_err(|e| ApiError::invalid("body", format!("not a video request: {e}")))?;
    let (width, height) = match &r.size {
        Some(s) => {
            let (w, h) = parse_size(s).ok_or_else(|| {
                ApiError::invalid(
                    "size",
                    format!(
                        "size {}: must be \"WIDTHxHEIGHT\", e.g. \"832x480\"",
                        status::shown(s)
                    ),
                )
            })?;
            (Some(w), Some(h))
        }
        None => (None, None),
    };
    let fps = r.fps.unwrap_or(h.fps);
    let num_frames = match (&r.num_frames, &r.seconds) {
        (Some(n), _) => Some(*n),
        (None, Some(s)) => {
            let frames = s
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v > 0.0)
                .and_then(|secs| frames_for(secs, fps))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "seconds",
                        format!(
                            "seconds {}: must be a positive number (e.g. \"4\") of at most \
                             2^32 frames at {fps} fps",
                            status::shown(s)
                        ),
                    )
                })?;
            Some(frames)
        }
        (None, None) => None,
    };
    let from_seconds = r.num_frames.is_none() && r.seconds.is_some();
    let request = pb::GenerateRequest {
        prompt: r.prompt.clone(),
        negative_prompt: r.negative_prompt.unwrap_or_default(),
        width,
        height,
        num_frames,
        fps: r.fps,
        steps: r.num_inference_steps,
        guidance_scale: r.guidance_scale,
        guidance_scale_2: None,
        seed: r.seed,
        model: r.model.unwrap_or_default(),
        segment_frames: None,
    };
    let mut grpc = tonic::Request::new(request);
    *grpc.metadata_mut() = tonic::metadata::MetadataMap::from_headers(headers.clone());
    let mut events = match h.gateway.generate(grpc).await {
        Ok(events) => events.into_inner(),
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            let param = param_of(status.message(), from_seconds);
            let mut e = ApiError::from(status);
            if param == Some("seconds") {
                e.message = format!(
                    "seconds {:?} is {} frames at {fps} fps; {}",
                    r.seconds.as_deref().unwrap_or_default(),
                    num_frames.unwrap_or_default(),
                    e.message
                );
            }
            e.param = param;
            return Err(e);
        }
        Err(status) => return Err(status.into()),
    };
    let accepted = match events.next().await {
        Some(Ok(pb::GenerateEvent {
            event: Some(pb::generate_event::Event::Accepted(a)),
        })) => a,
        Some(Err(status)) => return Err(status.into()),
        _ => {
            return Err(status::internal(
                "http api",
                "the request's stream did not start with Accepted",
            )
            .into());
        }
    };
    let video = Video {
        id: accepted.request_id.clone(),
        object: "video".into(),
        model: h.gateway.model().to_string(),
        status: "queued".into(),
        progress: 0,
        created_at: now(),
        completed_at: None,
        expires_at: None,
        size: format!("{}x{}", accepted.width, accepted.height),
        seconds: r
            .seconds
            .unwrap_or_else(|| seconds_text(accepted.num_frames, accepted.fps)),
        prompt: r.prompt,
        error: None,
        remixed_from_video_id: None,
        mime_type: None,
    };
    let job = h.store.start(owner, video, events);
    Ok(axum::Json(job.video()).into_response())
}

async fn retrieve(
    State(h): State<Http>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let video = h.job(&headers, &id)?.video();
    let mut response = axum::Json(&video).into_response();
    if !video.finished() {
        response.headers_mut().insert(
            "openai-poll-after-ms",
            HeaderValue::from_static(POLL_AFTER_MS),
        );
    }
    Ok(response)
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
}

async fn list(
    State(h): State<Http>,
    headers: HeaderMap,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let owner = h.owner(&headers)?;
    let Query(q) = q?;
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            format!("limit {limit}: must be in 1..=100"),
        ));
    }
    let mut all = h.store.list(&owner);
    match q.order.as_deref() {
        None | Some("desc") => all.reverse(),
        Some("asc") => {}
        Some(o) => {
            return Err(ApiError::invalid(
                "order",
                format!("order {}: must be \"asc\" or \"desc\"", status::shown(o)),
            ));
        }
    }
    let start = match &q.after {
        Some(after) => all
            .iter()
            .position(|v| &v.id == after)
            .map(|i| i + 1)
            .ok_or_else(|| {
                ApiError::invalid(
                    "after",
                    format!("after {}: no such video", status::shown(after)),
                )
            })?,
        None => 0,
    };
    let page: Vec<&Video> = all.iter().skip(start).take(limit).collect();
    let body = serde_json::json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|v| &v.id),
        "last_id": page.last().map(|v| &v.id),
        "has_more": start + page.len() < all.len(),
    });
    Ok(axum::Json(body).into_response())
}

async fn delete(
    State(h): State<Http>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    h.job(&headers, &id)?;
    h.store.delete(&id);
    tracing::info!(id, "video deleted");
    Ok(
        axum::Json(serde_json::json!({"id": id, "object": "video.deleted", "deleted": true}))
            .into_response(),
    )
}

#[derive(Deserialize)]
struct ContentQuery {
    variant: Option<String>,
}

async fn content(
    State(h): State<Http>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ContentQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let job = h.job(&headers, &id)?;
    let Query(q) = q?;
    match q.variant.as_deref() {
        None | Some("video") => {}
        Some("thumbnail") => return thumbnail(&h, &id).await,
        Some(v) => {
            return Err(ApiError::invalid(
                "variant",
                format!(
                    "variant {}: must be \"video\" or \"thumbnail\"",
                    status::shown(v)
                ),
            ));
        }
    }
    let mut rx = job.watch();
    let (video, bytes) = rx.borrow_and_update().clone();
    if video.status == "failed" && bytes == 0 {
        let e = video.error.unwrap_or(videos::VideoError {
            code: "failed".into(),
            message: "the video failed".into(),
        });
        return Err(ApiError {
            status: StatusCode::CONFLICT,
            kind: "invalid_request_error",
            code: e.code,
            param: None,
            message: format!("video {id} failed before any segment: {}", e.message),
        });
    }
    let path = h.store.video_path(&id);
    // Whole segments only, as they are written; the stream ends when the job does.
    let stream = async_stream::try_stream! {
        use tokio::io::{AsyncReadExt, AsyncSeekExt};
        let mut file: Option<tokio::fs::File> = None;
        let mut sent = 0u64;
        loop {
            let (video, bytes) = rx.borrow_and_update().clone();
            if sent < bytes {
                let f = match &mut file {
                    Some(f) => f,
                    None => {
                        let mut f = tokio::fs::File::open(&path).await?;
                        f.seek(std::io::SeekFrom::Start(sent)).await?;
                        file.insert(f)
                    }
                };
                while sent < bytes {
                    let mut buf = vec![0u8; (bytes - sent).min(1 << 16) as usize];
                    let n = f.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    buf.truncate(n);
                    sent += n as u64;
                    yield Bytes::from(buf);
                }
            }
            if video.finished() || rx.changed().await.is_err() {
                break;
            }
        }
    };
    let mut response = Response::new(Body::from_stream(stream.map(|r: std::io::Result<Bytes>| r)));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("video/mp4"));
    if video.finished() {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(bytes));
    }
    Ok(response)
}

/// Frame 0 as a PNG, once the first media segment exists.
async fn thumbnail(h: &Http, id: &str) -> Result<Response, ApiError> {
    let path = h.store.video_path(id);
    let png = tokio::task::spawn_blocking(move || {
        let mp4 = std::fs::read(&path).map_err(|e| e.to_string())?;
        thumbnail::first_frame_png(&mp4).map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| ApiError::from(status::internal("thumbnail task", e)))?
    .map_err(|e| ApiError {
        status: StatusCode::CONFLICT,
        kind: "invalid_request_error",
        code: "not_ready".into(),
        param: Some("variant"),
        message: format!("video {id}: {e}"),
    })?;
    Ok(([(header::CONTENT_TYPE, "image/png")], png).into_response())
}

async fn events(
    State(h): State<Http>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let mut rx = h.job(&headers, &id)?.watch();
    let stream = async_stream::stream! {
        loop {
            let video = rx.borrow_and_update().0.clone();
            let json = serde_json::to_string(&video).unwrap_or_default();
            yield Ok::<_, std::convert::Infallible>(Bytes::from(format!("event: video\ndata: {json}\n\n")));
            if video.finished() {
                break;
            }
            // A slow reader gets the latest state, not every step; a deleted job ends it.
            if rx.changed().await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let mut response = Response::new(Body::from_stream(stream));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_become_4k_plus_1_frames() {
        assert_eq!(frames_for(1.0, 16), Some(17));
        assert_eq!(frames_for(5.0, 16), Some(81));
        assert_eq!(frames_for(0.01, 16), Some(1));
        assert_eq!(frames_for(1e308, 16), None);
        assert_eq!(seconds_text(17, 16), "1.0625");
        assert_eq!(seconds_text(16, 16), "1");
    }

    #[test]
    fn the_checks_fields_become_openai_params() {
        let param = |m| param_of(m, false);
        assert_eq!(
            param("width = 7: must be a positive multiple of 16"),
            Some("size")
        );
        assert_eq!(
            param("steps = 0: must be in 1..=100"),
            Some("num_inference_steps")
        );
        assert_eq!(param("num_frames = 8: must be 4k+1"), Some("num_frames"));
        assert_eq!(
            param_of("num_frames = 8: must be 4k+1", true),
            Some("seconds")
        );
        assert_eq!(param("segment_frames = 3: …"), None);
        assert_eq!(param("the queue is full"), None);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("256x160"), Some((256, 160)));
        assert_eq!(parse_size("256 X 160"), Some((256, 160)));
        assert_eq!(parse_size("256"), None);
    }
}
