//! Serve: the read path over HTTP (`tally serve`).
//!
//! * `GET /v1/posts/{id}/likes` → `{"post_id": 1, "likes": 10, "as_of_ms": ...}`
//! * `GET /v1/likes?post_id=1&post_id=2` (1 to [`MAX_IDS`] ids) →
//!   `{"likes": [{"post_id": 1, ...}, ...]}`, in the order asked
//! * `GET /healthz` → `{"status": "ok"}`
//! * `GET /metrics` → Prometheus text: requests by route and status, their
//!   latency, read-cache hits and misses, fetches sent to Redis
//!
//! Invariant: every answer is JSON, errors included (`{"error": "..."}` with
//! 400 for a bad or missing id or too many ids, 404 for an unknown path, 405
//! for another method, 503 when Redis fails); a handler never panics on
//! input. Counts come from [`tally::read::Reader`], with its cache.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use axum::Json;
use axum::Router;
use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Args;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tally::read::Reader;
use tracing::info;

use crate::settings::StoreArgs;

/// Ids one `/v1/likes` request may ask for.
pub const MAX_IDS: usize = 1_000;

/// Settings of `tally serve`.
#[derive(Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on; loopback by default, put a proxy in front to publish it.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// How long a count is served from the cache (milliseconds; 0 turns the cache off).
    #[arg(long, env = "TALLY_CACHE_TTL_MS", default_value_t = 1_000)]
    pub cache_ttl_ms: u64,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// An error answer.
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad_request(message: impl Into<String>) -> Failure {
    Failure(StatusCode::BAD_REQUEST, message.into())
}

fn parse_id(raw: &str) -> Result<u64, Failure> {
    raw.parse::<u64>()
        .map_err(|_| bad_request(format!("post id '{raw}' is not an unsigned 64-bit integer")))
}

async fn one(State(reader): State<Reader>, Path(raw): Path<String>) -> Result<Response, Failure> {
    let post = parse_id(&raw)?;
    let count = reader
        .count(post)
        .await
        .map_err(|e| Failure(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    Ok(Json(count).into_response())
}

async fn many(
    State(reader): State<Reader>,
    RawQuery(query): RawQuery,
) -> Result<Response, Failure> {
    let query = query.unwrap_or_default();
    let mut posts = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name != "post_id" {
            return Err(bad_request(format!(
                "unknown parameter '{name}'; use post_id=<id>, repeated"
            )));
        }
        if posts.len() == MAX_IDS {
            return Err(bad_request(format!(
                "at most {MAX_IDS} post ids per request"
            )));
        }
        posts.push(parse_id(value)?);
    }
    if posts.is_empty() {
        return Err(bad_request("give at least one post_id=<id>"));
    }
    let counts = reader
        .counts(&posts)
        .await
        .map_err(|e| Failure(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    Ok(Json(json!({ "likes": counts })).into_response())
}

/// Counts and times every answer, by the route it matched.
async fn measured(request: Request, next: Next) -> Response {
    let route = match request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/posts/{id}/likes") => "/v1/posts/{id}/likes",
        Some("/v1/likes") => "/v1/likes",
        Some("/healthz") => "/healthz",
        Some("/metrics") => "/metrics",
        _ => "other",
    };
    let began = std::time::Instant::now();
    let response = next.run(request).await;
    tally::infra::metrics::read_request(route, response.status().as_u16(), began.elapsed());
    response
}

/// The HTTP routes over `reader`, with `/metrics` rendered by `metrics`.
pub fn router(reader: Reader, metrics: Option<PrometheusHandle>) -> Router {
    let mut router = Router::new()
        .route("/v1/posts/{id}/likes", get(one))
        .route("/v1/likes", get(many))
        .route(
            "/healthz",
            get(|| async { Json(json!({ "status": "ok" })) }),
        );
    if let Some(metrics) = metrics {
        router = router.route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        body,
                    )
                }
            }),
        );
    }
    router
        .fallback(|| async { Failure(StatusCode::NOT_FOUND, "no such path".into()) })
        .method_not_allowed_fallback(|| async {
            Failure(StatusCode::METHOD_NOT_ALLOWED, "only GET is served".into())
        })
        .layer(middleware::from_fn(measured))
        .with_state(reader)
}

/// Runs `tally serve` until SIGINT or SIGTERM.
pub async fn serve(args: ServeArgs) -> Result<()> {
    let store = args.store.settings().map_err(crate::errors::Problems)?;
    let (opened, record) = tally::domain::layout::open_for_reading(&store).await?;
    let buckets = record.buckets;
    let reader = Reader::new(
        opened.store,
        opened.keys,
        buckets,
        Duration::from_millis(args.cache_ttl_ms),
    );
    let listener = tally::infra::http::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("{e} (fix --listen)"))?;
    let metrics = tally::infra::metrics::install()?;
    tally::infra::metrics::describe_reads();
    info!(listen = %args.listen, "Serving counts.");
    let shutdown = crate::run::shutdown_on_signal();
    tally::infra::http::spawn_upkeep(metrics.clone(), shutdown.clone());
    tally::infra::http::serve(listener, router(reader, Some(metrics)), shutdown).await??;
    Ok(())
}
