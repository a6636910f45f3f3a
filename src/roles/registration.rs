//! A pool's side of the registry: register with the gateway, then send a heartbeat every second,
//! registering again if the gateway forgot the pool (it restarted, or dropped the pool after a
//! pause). Runs until the pool shuts down. A pool that can serve nothing more (a rank thread of
//! its stage is gone) stops its heartbeats, so the gateway drops it and routes elsewhere.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ditstream_proto::v1 as pb;
use ditstream_proto::v1::pool_registry_client::PoolRegistryClient;

/// Why a pool is out of service, if it is (checked before every heartbeat).
pub type Health = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Keeps the pool registered; `active` is the pool's current request count; `health` says when
/// it can serve nothing more (then it stops, for good).
pub async fn keep_registered(
    gateway: String,
    registration: pb::RegisterRequest,
    active: Arc<AtomicU32>,
    health: Health,
) {
    let mut pool_id: Option<String> = None;
    let mut client: Option<PoolRegistryClient<tonic::transport::Channel>> = None;
    loop {
        if let Some(why) = health() {
            tracing::error!(%gateway, %why, "out of service: no more heartbeats");
            return;
        }
        if client.is_none() {
            client = PoolRegistryClient::connect(format!("http://{gateway}"))
                .await
                .ok();
        }
        if let Some(c) = client.as_mut() {
            let result = match &pool_id {
                None => c.register(registration.clone()).await.map(|r| {
                    let id = r.into_inner().pool_id;
                    tracing::info!(%gateway, pool_id = %id, "registered");
                    pool_id = Some(id);
                }),
                Some(id) => {
                    let beat = pb::HeartbeatRequest {
                        pool_id: id.clone(),
                        active: active.load(Ordering::Relaxed),
                    };
                    c.heartbeat(beat).await.map(|r| {
                        if !r.into_inner().known {
                            tracing::warn!(%gateway, "the gateway forgot this pool; registering again");
                            pool_id = None;
                        }
                    })
                }
            };
            if let Err(status) = result {
                tracing::warn!(%gateway, error = %status.message(), "gateway unreachable");
                client = None;
                pool_id = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(if pool_id.is_some() {
            1000
        } else {
            250
        }))
        .await;
    }
}
