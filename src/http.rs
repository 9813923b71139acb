//! HTTP: the listener behind `--metrics-addr`, serving `/metrics`
//! (Prometheus text), `/healthz` and `/readyz`.
//!
//! Invariant: a request never waits on Redis or Kafka: `/metrics` renders
//! what the recorder holds and `/readyz` reads what [`crate::health`] last
//! saw, so a stalled dependency can never stall a probe or a scrape.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tracing::{debug, info};

/// How often histograms are drained into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Binds `addr` and serves until the process exits; returns the bound
/// address (a port of 0 picks a free one).
pub async fn serve(addr: SocketAddr, metrics: PrometheusHandle) -> Result<SocketAddr, String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot serve metrics on {addr}: {e} (fix --metrics-addr)"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(UPKEEP_EVERY);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(error) => {
                    debug!(%error, "Accepting an HTTP connection failed.");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let response = respond(&request, &metrics);
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(error) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    debug!(%error, "HTTP connection ended with an error.");
                }
            });
        }
    });
    info!(addr = %bound, "Serving /metrics, /healthz and /readyz.");
    Ok(bound)
}

fn respond(request: &Request<Incoming>, metrics: &PrometheusHandle) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD only\n".into());
        response
            .headers_mut()
            .insert(ALLOW, "GET, HEAD".parse().expect("a valid header"));
        return response;
    }
    match request.uri().path() {
        "/metrics" => {
            let mut response = text(StatusCode::OK, metrics.render());
            response.headers_mut().insert(
                CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8"
                    .parse()
                    .expect("a valid header"),
            );
            response
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            let (ready, report) = crate::health::report();
            let status = if ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            text(status, report)
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        "text/plain; charset=utf-8".parse().expect("a valid header"),
    );
    response
}
