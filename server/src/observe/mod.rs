//! What the mesh tells operators: counters and histograms (`metrics`), the
//! Prometheus scrape endpoint ([`metrics_http`]), logs and traces
//! ([`telemetry`]).

pub(crate) mod metrics;
pub mod metrics_http;
pub mod otlp;
pub(crate) mod process;
pub mod scrub;
pub mod spans;
pub mod telemetry;
