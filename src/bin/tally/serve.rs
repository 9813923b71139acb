//! Serve: the read path over HTTP (`tally serve`).
//!
//! * `GET /v1/posts/{id}/likes` → `{"post_id": 1, "likes": 10, "as_of_ms": ...}`
//! * `GET /v1/posts/{id}/likes?window=1h` → the post's likes in the window
//!   of that size holding now, with `window`, `start_ms` and `end_ms`
//! * `GET /v1/likes?post_id=1&post_id=2` (1 to `--max-ids` ids) →
//!   `{"likes": [{"post_id": 1, ...}, ...]}`, in the order asked
//! * `GET /v1/trending?window=1h[&limit=50][&at=<ms>]` → the posts with the
//!   most likes in that window, `{"posts": [{"post_id": 1, "likes": 9}, ...], ...}`
//! * `GET /healthz` → `{"status": "ok"}`
//! * `GET /metrics` → Prometheus text: requests by route and status, their
//!   latency, read-cache hits and misses, fetches sent to Redis
//!
//! Invariant: every answer is JSON, errors included (`{"error": "..."}` with
//! 400 for a bad or missing id or too many ids, a window the prefix does not
//! keep or a limit out of range, 404 for an unknown path, 405
//! for another method, 413 for a body over `--max-body-bytes`, 503 when Redis
//! fails, when `--max-concurrent-requests` are in progress or after
//! `--request-timeout-ms`); a handler never panics on input. Counts come
//! from [`tally::read::Reader`], with its cache. docs/openapi.yaml describes
//! every route and answer.

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
use serde::Serialize;
use serde_json::json;
use tally::domain::windows::{DEFAULT_TOP_K, MAX_TOP_K};
use tally::infra::config::{self, ServeLimits};
use tally::read::{Count, ReadError, Reader};
use tracing::info;

use crate::settings::StoreArgs;
use crate::settings::layers::ConfigArg;

/// Settings of `tally serve`.
#[derive(Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on; loopback by default, put a proxy in front to publish it.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// How long a count is served from the cache (milliseconds; 0 turns the cache off).
    #[arg(long, env = "TALLY_CACHE_TTL_MS", default_value_t = tally::read::DEFAULT_CACHE_TTL_MS)]
    pub cache_ttl_ms: u64,
    /// Post ids one /v1/likes request may ask for.
    #[arg(long, env = "TALLY_MAX_IDS", default_value_t = config::DEFAULT_SERVE_MAX_IDS)]
    pub max_ids: usize,
    /// Largest request body read (bytes); a longer one is answered 413.
    #[arg(long, env = "TALLY_MAX_BODY_BYTES", default_value_t = config::DEFAULT_SERVE_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Answer 503 to a request not answered within this long (milliseconds).
    #[arg(long, env = "TALLY_REQUEST_TIMEOUT_MS", default_value_t = config::DEFAULT_SERVE_REQUEST_TIMEOUT_MS)]
    pub request_timeout_ms: u64,
    /// Requests handled at once; one more is answered 503 at once.
    #[arg(long, env = "TALLY_MAX_CONCURRENT_REQUESTS", default_value_t = config::DEFAULT_SERVE_MAX_CONCURRENT)]
    pub max_concurrent_requests: usize,
    /// Where the counts are.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The settings file it shares with `tally run`.
    #[command(flatten)]
    pub config: ConfigArg,
}

impl ServeArgs {
    /// The request limits these flags name; every problem at once.
    pub fn limits(&self) -> Result<ServeLimits, Vec<config::ConfigError>> {
        ServeLimits::new(
            self.max_ids,
            self.max_body_bytes,
            Duration::from_millis(self.request_timeout_ms),
            self.max_concurrent_requests,
        )
    }
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

/// What the handlers share: the reader and the batch limit.
#[derive(Clone)]
struct Api {
    reader: Reader,
    max_ids: usize,
}

/// A failed read: 400 for a window the prefix does not keep, 503 otherwise.
fn read_failed(error: ReadError) -> Failure {
    match error {
        ReadError::UnknownWindow { .. } => bad_request(error.to_string()),
        other => Failure(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
    }
}

/// The window parameters of a query: `window` and, on the trending list
/// (`listed`), `limit` and `at`; any other name is refused.
#[derive(Default)]
struct WindowQuery {
    window: Option<String>,
    at: Option<i64>,
    limit: Option<usize>,
}

fn window_query(query: Option<&str>, listed: bool) -> Result<WindowQuery, Failure> {
    let mut parsed = WindowQuery::default();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        match name {
            "window" => parsed.window = Some(value.to_string()),
            "at" if listed => {
                let at = value
                    .parse()
                    .ok()
                    .filter(|at| (0..=tally::pipeline::decode::MAX_TIMESTAMP_MS).contains(at));
                parsed.at = Some(at.ok_or_else(|| {
                    bad_request(format!(
                        "at '{value}' must be milliseconds since the epoch, up to 2100-01-01"
                    ))
                })?);
            }
            "limit" if listed => {
                let limit = value.parse().ok().filter(|l| (1..=MAX_TOP_K).contains(l));
                parsed.limit = Some(limit.ok_or_else(|| {
                    bad_request(format!("limit '{value}' must be between 1 and {MAX_TOP_K}"))
                })?);
            }
            other => {
                let known = if listed {
                    "window, limit and at"
                } else {
                    "window"
                };
                return Err(bad_request(format!(
                    "unknown parameter '{other}'; this path takes {known}"
                )));
            }
        }
    }
    Ok(parsed)
}

async fn one(
    State(api): State<Api>,
    Path(raw): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Failure> {
    let post = parse_id(&raw)?;
    let asked = window_query(query.as_deref(), false)?;
    if let Some(window) = asked.window {
        let size = api.reader.window_size(&window).map_err(read_failed)?;
        let count = api
            .reader
            .window_likes(post, size, asked.at)
            .await
            .map_err(read_failed)?;
        return Ok(Json(count).into_response());
    }
    if asked.at.is_some() {
        return Err(bad_request(
            "at names an instant of a window: give window too",
        ));
    }
    let count = api.reader.count(post).await.map_err(read_failed)?;
    Ok(Json(count).into_response())
}

async fn trending(State(api): State<Api>, RawQuery(query): RawQuery) -> Result<Response, Failure> {
    let asked = window_query(query.as_deref(), true)?;
    let window = asked.window.ok_or_else(|| {
        bad_request(format!(
            "give window=<size>, one of the prefix's windows ({})",
            api.reader.windows().sizes_field()
        ))
    })?;
    let size = api.reader.window_size(&window).map_err(read_failed)?;
    let list = api
        .reader
        .trending(size, asked.at, asked.limit.unwrap_or(DEFAULT_TOP_K))
        .await
        .map_err(read_failed)?;
    Ok(Json(list).into_response())
}

/// The answer of `/v1/likes`, serialized straight from the counts.
#[derive(Serialize)]
struct Likes<'a> {
    likes: &'a [Count],
}

async fn many(State(api): State<Api>, RawQuery(query): RawQuery) -> Result<Response, Failure> {
    let query = query.unwrap_or_default();
    let mut posts = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if name != "post_id" {
            return Err(bad_request(format!(
                "unknown parameter '{name}'; use post_id=<id>, repeated"
            )));
        }
        if posts.len() == api.max_ids {
            return Err(bad_request(format!(
                "at most {} post ids per request",
                api.max_ids
            )));
        }
        posts.push(parse_id(value)?);
    }
    if posts.is_empty() {
        return Err(bad_request("give at least one post_id=<id>"));
    }
    let counts = api.reader.counts(&posts).await.map_err(read_failed)?;
    Ok(Json(Likes { likes: &counts }).into_response())
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
        Some("/v1/trending") => "/v1/trending",
        Some("/healthz") => "/healthz",
        Some("/metrics") => "/metrics",
        _ => "other",
    };
    let began = std::time::Instant::now();
    let response = next.run(request).await;
    tally::infra::metrics::read_request(route, response.status().as_u16(), began.elapsed());
    response
}

/// The HTTP routes over `reader` behind `limits`, with `/metrics` rendered by `metrics`.
pub fn router(reader: Reader, metrics: Option<PrometheusHandle>, limits: &ServeLimits) -> Router {
    let mut router = Router::new()
        .route("/v1/posts/{id}/likes", get(one))
        .route("/v1/likes", get(many))
        .route("/v1/trending", get(trending))
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
    let api = Api {
        reader,
        max_ids: limits.max_ids,
    };
    let router = router
        .fallback(|| async { Failure(StatusCode::NOT_FOUND, "no such path".into()) })
        .method_not_allowed_fallback(|| async {
            Failure(StatusCode::METHOD_NOT_ALLOWED, "only GET is served".into())
        })
        .with_state(api);
    tally::infra::http::limited(router, limits).layer(middleware::from_fn(measured))
}

/// Runs `tally serve` until SIGINT or SIGTERM.
pub async fn serve(args: ServeArgs, matches: &clap::ArgMatches) -> Result<()> {
    let limits = args.limits().map_err(crate::errors::Problems)?;
    let store = args.config.layer(&args.store, matches);
    let store = store
        .and_then(|store| store.settings())
        .map_err(crate::errors::Problems)?;
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
    let shutdown = crate::signal::shutdown_on_signal();
    tally::infra::http::spawn_upkeep(metrics.clone(), shutdown.clone());
    tally::infra::http::serve(listener, router(reader, Some(metrics), &limits), shutdown).await??;
    Ok(())
}
