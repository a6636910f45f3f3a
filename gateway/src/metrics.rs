//! What the gateway measures, exported at `/metrics` in the Prometheus text format
//! (`prometheus-client`): requests by outcome, a completed request's duration, its time to
//! first segment, the gap between segments, each phase's duration (the queue's included), bytes
//! streamed, and — read at scrape time — the queue, the
//! running requests and every pool's health and load, so operators can scale the two pools
//! separately; and the gateway's listeners' connections (`ditstream_common::net::ConnMetrics`):
//! open, refused, and closed or cut short by the `connections:` limits.

use std::sync::Mutex;

use ditstream_common::net::ConnMetrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    /// `completed`, or the gRPC code that ended it (`cancelled`, `resource_exhausted`, …).
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    /// The route's template (`/v1/videos/{id}`), or `unmatched`.
    route: String,
    code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Phase {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
    role: &'static str,
}

/// One pool as the registry sees it at scrape time.
pub struct PoolSample {
    /// Its registry id.
    pub id: String,
    /// `denoiser` or `decoder`.
    pub role: &'static str,
    /// Requests routed to it and not finished.
    pub inflight: u32,
}

/// Seconds buckets from 10 ms to ~40 min, doubling.
fn seconds_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.01, 2.0, 18)
}

/// The gateway's metrics.
pub struct Metrics {
    registry: Registry,
    requests: Family<Outcome, Counter>,
    duration: Histogram,
    first_segment: Histogram,
    segment_gap: Histogram,
    phases: Family<Phase, Histogram>,
    streamed: Counter,
    auth_failures: Counter,
    http: Family<HttpLabels, Counter>,
    queued: Gauge,
    running: Gauge,
    pool_up: Family<PoolLabels, Gauge>,
    pool_inflight: Family<PoolLabels, Gauge>,
    connections: ConnMetrics,
    /// Encoding reads the gauges set just before it; one scrape at a time.
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric registered, all zero.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ditstream");
        let requests = Family::<Outcome, Counter>::default();
        registry.register(
            "requests",
            "Requests that ended, by outcome",
            requests.clone(),
        );
        let duration = Histogram::new(seconds_buckets());
        registry.register(
            "request_seconds",
            "Accepted to Completed, for each completed request",
            duration.clone(),
        );
        let first_segment = Histogram::new(seconds_buckets());
        registry.register(
            "time_to_first_segment_seconds",
            "Accepted to the first media segment sent",
            first_segment.clone(),
        );
        let segment_gap = Histogram::new(seconds_buckets());
        registry.register(
            "segment_gap_seconds",
            "Time between consecutive media segments of a request",
            segment_gap.clone(),
        );
        let phases =
            Family::<Phase, Histogram>::new_with_constructor(|| Histogram::new(seconds_buckets()));
        registry.register(
            "phase_seconds",
            "Duration of each phase of a completed request (queue: accepted to the start of \
             work; text, denoise, decode, encode)",
            phases.clone(),
        );
        let streamed = Counter::default();
        registry.register(
            "streamed_bytes",
            "Bytes of video sent to clients",
            streamed.clone(),
        );
        let auth_failures = Counter::default();
        registry.register(
            "auth_failures",
            "Calls refused for a missing or unknown API key (gRPC and HTTP)",
            auth_failures.clone(),
        );
        let http = Family::<HttpLabels, Counter>::default();
        registry.register(
            "http_responses",
            "HTTP answers (the Videos API, the page, /metrics), by route and status code",
            http.clone(),
        );
        let queued = Gauge::default();
        registry.register(
            "queued_requests",
            "Requests waiting for pools",
            queued.clone(),
        );
        let running = Gauge::default();
        registry.register(
            "running_requests",
            "Requests being routed or run",
            running.clone(),
        );
        let pool_up = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_up",
            "1 for each pool the gateway can route to",
            pool_up.clone(),
        );
        let pool_inflight = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_inflight_requests",
            "Requests routed to a pool and not finished",
            pool_inflight.clone(),
        );
        let connections = ConnMetrics::default();
        connections.register(&mut registry);
        Metrics {
            registry,
            requests,
            duration,
            first_segment,
            segment_gap,
            phases,
            streamed,
            auth_failures,
            http,
            queued,
            running,
            pool_up,
            pool_inflight,
            connections,
            scrape: Mutex::new(()),
        }
    }

    /// What the gateway's listeners count into ([`ditstream_common::net::Listener::counted_in`]).
    pub fn connections(&self) -> &ConnMetrics {
        &self.connections
    }

    /// A request ended: `completed` or the gRPC code's name.
    pub fn ended(&self, outcome: &str) {
        self.requests
            .get_or_create(&Outcome {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// A call was refused for its API key.
    pub fn auth_failed(&self) {
        self.auth_failures.inc();
    }

    /// An HTTP answer with status `code` on `route` (its template, or `unmatched`).
    pub fn http_response(&self, route: &str, code: u16) {
        self.http
            .get_or_create(&HttpLabels {
                route: route.to_string(),
                code,
            })
            .inc();
    }

    /// A completed request's timings (milliseconds, as the protocol carries them).
    pub fn timings(&self, t: &ditstream_proto::v1::Timings) {
        self.duration.observe(t.total_ms / 1e3);
        self.first_segment.observe(t.first_segment_ms / 1e3);
        for (phase, ms) in [
            ("queue", t.queue_ms),
            ("text", t.text_ms),
            ("denoise", t.denoise_ms),
            ("decode", t.decode_ms),
            ("encode", t.encode_ms),
        ] {
            self.phases
                .get_or_create(&Phase { phase })
                .observe(ms / 1e3);
        }
    }

    /// A media segment of `bytes` went out, `gap` seconds after the request's previous one.
    pub fn segment(&self, bytes: usize, gap: Option<f64>) {
        self.streamed.inc_by(bytes as u64);
        if let Some(g) = gap {
            self.segment_gap.observe(g);
        }
    }

    /// The text format, with the gauges set from the state now.
    pub fn render(&self, queued: u32, running: u32, pools: &[PoolSample]) -> String {
        let _one = self
            .scrape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.queued.set(i64::from(queued));
        self.running.set(i64::from(running));
        self.pool_up.clear();
        self.pool_inflight.clear();
        for p in pools {
            let labels = PoolLabels {
                pool: p.id.clone(),
                role: p.role,
            };
            self.pool_up.get_or_create(&labels).set(1);
            self.pool_inflight
                .get_or_create(&labels)
                .set(i64::from(p.inflight));
        }
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}
