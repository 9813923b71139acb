//! What the service runs on: its settings, its Redis connections, retries,
//! metrics, health, the HTTP listener, security and the supervision of
//! background tasks.
//!
//! Nothing here imports the pipeline, the domain or the operations: these
//! modules know about Redis, Kafka clients and HTTP, not about likes.

pub mod config;
pub mod health;
pub mod http;
pub mod metrics;
pub mod retry;
pub mod security;
pub mod store;
pub mod tasks;
