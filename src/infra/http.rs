//! HTTP: the axum listener behind `--metrics-addr`, serving `/metrics`
//! (Prometheus text), `/healthz` and `/readyz`, and the one every HTTP
//! front of tally runs on ([`serve`]).
//!
//! Invariant: a request never waits on Redis or Kafka: `/metrics` renders
//! what the recorder holds and `/readyz` reads what [`crate::infra::health`]
//! last saw, so a stalled dependency can never stall a probe or a scrape.
//! Every task started here ends when the shutdown token is cancelled.
//!
//! The read API ([`limited`]) faces the network, so no request can hold more
//! than its share: at most `max_concurrent` are handled at once (one more is
//! answered 503 at once, never queued), each is answered within
//! `request_timeout` (503 after it), and no body longer than `max_body_bytes`
//! is read (413).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::header::{ALLOW, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::infra::config::ServeLimits;

/// How often histograms are drained into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The address cannot be listened on.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct BindError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// Binds `addr` (a port of 0 picks a free one).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { addr, source })
}

/// Serves `router` on `listener` until `shutdown`; connections in progress
/// finish first.
pub fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> JoinHandle<std::io::Result<()>> {
    crate::infra::tasks::spawn("http-listener", async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    })
}

/// Drains `metrics`' histograms into their buckets every few seconds until
/// `shutdown`.
pub fn spawn_upkeep(metrics: PrometheusHandle, shutdown: CancellationToken) -> JoinHandle<()> {
    crate::infra::tasks::spawn("metrics-upkeep", async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = every.tick() => metrics.run_upkeep(),
            }
        }
    })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr` until `shutdown`,
/// with the histogram upkeep beside it; returns the bound address.
pub async fn serve_probes(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    shutdown: CancellationToken,
) -> Result<SocketAddr, BindError> {
    let listener = bind(addr).await?;
    let bound = listener
        .local_addr()
        .map_err(|source| BindError { addr, source })?;
    spawn_upkeep(metrics.clone(), shutdown.clone());
    serve(listener, probe_routes(metrics), shutdown);
    info!(addr = %bound, "Serving /metrics, /healthz and /readyz.");
    Ok(bound)
}

/// The routes of `/metrics`, `/healthz` and `/readyz`, GET and HEAD only.
pub fn probe_routes(metrics: PrometheusHandle) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move {
                    let mut response = text(StatusCode::OK, body);
                    response.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                    );
                    response
                }
            }),
        )
        .route(
            "/healthz",
            get(|| async { text(StatusCode::OK, "ok\n".into()) }),
        )
        .route(
            "/readyz",
            get(|| async {
                let (ready, report) = crate::infra::health::report();
                let status = if ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                text(status, report)
            }),
        )
        .fallback(|| async {
            text(
                StatusCode::NOT_FOUND,
                "not found; try /metrics, /healthz or /readyz\n".into(),
            )
        })
        .method_not_allowed_fallback(|| async {
            let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD only\n".into());
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            response
        })
}

fn text(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// `router` behind `limits`: a cap on requests in progress, a timeout for
/// each, and a limit on the body read. Refusals are JSON, as the read API's
/// answers are (`{"error": "..."}`).
pub fn limited(router: Router, limits: &ServeLimits) -> Router {
    let state = Arc::new(Limits {
        permits: Semaphore::new(limits.max_concurrent),
        limits: limits.clone(),
    });
    router.layer(middleware::from_fn_with_state(state, enforce))
}

struct Limits {
    permits: Semaphore,
    limits: ServeLimits,
}

async fn enforce(State(state): State<Arc<Limits>>, request: Request, next: Next) -> Response {
    let Ok(_permit) = state.permits.try_acquire() else {
        let mut response = refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "more than {} requests at once; try again shortly",
                state.limits.max_concurrent
            ),
        );
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            HeaderValue::from_static("1"),
        );
        return response;
    };
    let timeout = state.limits.request_timeout;
    let handled = within_body_limit(request, state.limits.max_body_bytes, next);
    match tokio::time::timeout(timeout, handled).await {
        Ok(response) => response,
        Err(_) => refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no answer within {} ms", timeout.as_millis()),
        ),
    }
}

/// Reads the body (at most `max` bytes; 413 beyond) before `next` runs, so
/// no handler ever waits on a client's body.
async fn within_body_limit(request: Request, max: usize, next: Next) -> Response {
    let too_long = || {
        refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request bodies are limited to {max} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return too_long();
    }
    let (parts, body) = request.into_parts();
    match axum::body::to_bytes(body, max).await {
        Ok(bytes) => next.run(Request::from_parts(parts, bytes.into())).await,
        Err(_) => too_long(),
    }
}

fn refusal(status: StatusCode, message: String) -> Response {
    let body = serde_json::json!({ "error": message }).to_string();
    let mut response = (status, body).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
