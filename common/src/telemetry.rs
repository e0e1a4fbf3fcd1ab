//! Logs, traces and the trace context that crosses gRPC.
//!
//! Logs go to stderr, human-readable by default or JSON (`--log-format json`), filtered by
//! `RUST_LOG` (default `info`). Traces are exported over OTLP/gRPC when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or the config key) is set, under `OTEL_SERVICE_NAME`; off
//! otherwise. Finished spans go through a bounded queue: when the collector is slow or down,
//! spans are dropped and counted ([`spans_dropped`]), never waited for, so the sync does not
//! slow down. The W3C trace context travels in gRPC metadata ([`inject`], [`extract`]).

use std::io::IsTerminal;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Spans that could not be exported (queue full, or the collector failed or timed out).
static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);
static SPANS_EXPORTED: AtomicU64 = AtomicU64::new(0);
/// Finished spans waiting for export at most.
const QUEUE: usize = 2048;
const EXPORT_BATCH: usize = 512;

pub fn spans_dropped() -> u64 {
    SPANS_DROPPED.load(Ordering::Relaxed)
}

pub fn spans_exported() -> u64 {
    SPANS_EXPORTED.load(Ordering::Relaxed)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(text: &str) -> Result<LogFormat, String> {
        match text {
            "human" | "text" => Ok(LogFormat::Human),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("log format {other:?} is not \"human\" or \"json\"")),
        }
    }
}

/// Keeps the tracer provider alive; shut it down before exit to flush what is queued.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes queued spans (bounded by the export timeout) and stops exporting.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            // The SDK's shutdown blocks; keep it off the async worker threads.
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Sets up logging and, when an OTLP endpoint is given (else `OTEL_EXPORTER_OTLP_ENDPOINT`),
/// trace export. Call inside a tokio runtime.
pub fn init(default_service: &str, format: LogFormat, otlp_endpoint: Option<String>) -> Telemetry {
    init_with_filter(
        default_service,
        format,
        otlp_endpoint,
        "info,sqlx=warn,h2=warn,tower=warn,hyper=warn,opentelemetry=warn",
    )
}

/// [`init`] with another filter than `info` when `RUST_LOG` is unset (`tidemark sync` keeps
/// the terminal for its progress: `warn`).
pub fn init_with_filter(
    default_service: &str,
    format: LogFormat,
    otlp_endpoint: Option<String>,
    default_filter: &str,
) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let endpoint = otlp_endpoint
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
        .filter(|e| !e.is_empty());
    let provider = endpoint.and_then(|endpoint| match tracer_provider(default_service, &endpoint) {
        Ok(provider) => Some(provider),
        Err(error) => {
            eprintln!("tracing export disabled: OTLP endpoint {endpoint}: {error}");
            None
        }
    });
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("tidemark")));
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    let ansi = std::io::stderr().is_terminal();
    let _ = match format {
        LogFormat::Human => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_target(false)
                    .with_ansi(ansi),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr)
                    .with_current_span(true)
                    .with_span_list(false),
            )
            .try_init(),
    };
    Telemetry { provider }
}

/// Logging only (CLI commands).
pub fn init_logging() {
    let _ = init("tidemark", LogFormat::Human, Some(String::new()));
}

fn tracer_provider(default_service: &str, endpoint: &str) -> Result<SdkTracerProvider, String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(3))
        .build()
        .map_err(|e| e.to_string())?;
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| default_service.to_string());
    let resource = Resource::builder().with_service_name(service).build();
    // The queue owns the exporter, so the resource goes to the exporter here.
    exporter.set_resource(&resource);
    Ok(SdkTracerProvider::builder()
        .with_span_processor(QueueProcessor::start(exporter))
        .with_resource(resource)
        .build())
}

/// A span processor with a bounded queue drained by a tokio task: `on_end` never blocks, and
/// a span that finds the queue full, or whose export fails, is counted as dropped.
#[derive(Debug)]
struct QueueProcessor {
    queue: tokio::sync::mpsc::Sender<SpanData>,
}

impl QueueProcessor {
    fn start<E: SpanExporter + 'static>(exporter: E) -> QueueProcessor {
        let (queue, mut receiver) = tokio::sync::mpsc::channel::<SpanData>(QUEUE);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(EXPORT_BATCH);
            while receiver.recv_many(&mut batch, EXPORT_BATCH).await > 0 {
                let count = batch.len() as u64;
                let spans = std::mem::replace(&mut batch, Vec::with_capacity(EXPORT_BATCH));
                match tokio::time::timeout(Duration::from_secs(5), exporter.export(spans)).await {
                    Ok(Ok(())) => SPANS_EXPORTED.fetch_add(count, Ordering::Relaxed),
                    _ => SPANS_DROPPED.fetch_add(count, Ordering::Relaxed),
                };
            }
        });
        QueueProcessor { queue }
    }
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            SPANS_DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Wraps a request message, carrying the current span's trace context (`traceparent`).
pub fn traced_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut MetadataInjector(request.metadata_mut()));
    request
}

/// Makes `span` a child of the trace context a request carries, if any.
pub fn join_trace(metadata: &tonic::metadata::MetadataMap, span: &tracing::Span) {
    let context = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    let _ = span.set_parent(context);
}
