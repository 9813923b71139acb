//! HTTP: the axum listener behind `--metrics-addr`, serving `/metrics`
//! (Prometheus text), `/healthz` and `/readyz`, and the one every HTTP
//! front of tally runs on ([`serve`]).
//!
//! Invariant: a request never waits on Redis or Kafka: `/metrics` renders
//! what the recorder holds and `/readyz` reads what [`crate::infra::health`]
//! last saw, so a stalled dependency can never stall a probe or a scrape.
//! Every task started here ends when the shutdown token is cancelled.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::http::header::{ALLOW, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

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
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    })
}

/// Drains `metrics`' histograms into their buckets every few seconds until
/// `shutdown`.
pub fn spawn_upkeep(metrics: PrometheusHandle, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
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
