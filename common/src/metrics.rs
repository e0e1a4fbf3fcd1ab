//! Prometheus metrics: labelled families shared by the binaries, and a minimal HTTP endpoint
//! (`GET /metrics`, OpenMetrics text) so that no web framework is needed.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Label sets are `(name, value)` pairs.
pub type Labels = Vec<(String, String)>;
pub type CounterFamily = Family<Labels, Counter>;
pub type GaugeFamily = Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>;
pub type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// Step durations from 1 ms to about 65 s.
pub fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

pub fn histogram_family() -> HistogramFamily {
    Family::new_with_constructor(duration_histogram as fn() -> Histogram)
}

/// Registers the trace exporter's dropped and exported span counts; returns the refresh that
/// brings them up to date before a scrape.
pub fn register_trace_counters(registry: &mut Registry) -> Arc<dyn Fn() + Send + Sync> {
    let dropped: Counter = Counter::default();
    let exported: Counter = Counter::default();
    registry.register(
        "tidemark_trace_spans_dropped",
        "Finished spans dropped because the trace queue was full or the collector failed",
        dropped.clone(),
    );
    registry.register(
        "tidemark_trace_spans_exported",
        "Spans exported to the collector",
        exported.clone(),
    );
    Arc::new(move || {
        let d = crate::telemetry::spans_dropped();
        let e = crate::telemetry::spans_exported();
        dropped.inc_by(d.saturating_sub(dropped.get()));
        exported.inc_by(e.saturating_sub(exported.get()));
    })
}

/// Serves `GET /metrics` on `listen`; `refresh` runs before each scrape.
pub async fn serve(
    listen: SocketAddr,
    registry: Arc<Registry>,
    refresh: Arc<dyn Fn() + Send + Sync>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, "metrics endpoint serving /metrics");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let registry = registry.clone();
            let refresh = refresh.clone();
            tokio::spawn(async move {
                let mut request = Vec::with_capacity(1024);
                let mut buffer = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let response = if request.starts_with(b"GET /metrics") {
                    // O(series): at 50,000 shards, tens of milliseconds not to spend on a
                    // worker thread of the runtime that answers the RPCs.
                    let encoded = tokio::task::spawn_blocking(move || {
                        refresh();
                        let mut body = String::new();
                        let _ = encode(&mut body, &registry);
                        body
                    })
                    .await;
                    let Ok(body) = encoded else { return };
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
                };
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok(())
}
