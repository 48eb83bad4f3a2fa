//! Masked values kept out of the mesh's log lines and exported spans
//! (R29): both are scrubbed against the masked values of the batches being
//! judged ([`crate::decision_log::scrub_live`]), which are empty, and cost
//! one atomic load, when no `[decision_log] mask` is configured.
//!
//! Telemetry imports nothing above it: the decision log installs its
//! scrubber here ([`install`]) when it first holds masked values.

use std::borrow::Cow;
use std::io;

use opentelemetry::trace::Status;
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use tracing_subscriber::fmt::MakeWriter;

/// What a text is scrubbed with: the masked values being held, or `None`
/// when none of them is in it.
pub type Scrubber = fn(&str) -> Option<String>;

static SCRUBBER: std::sync::OnceLock<Scrubber> = std::sync::OnceLock::new();

/// Installs the scrubber of log lines and spans; the first one stays.
pub fn install(scrubber: Scrubber) {
    let _ = SCRUBBER.set(scrubber);
}

fn scrub_live(text: &str) -> Option<String> {
    SCRUBBER.get().and_then(|scrub| scrub(text))
}

/// A span processor that scrubs every string attribute, event and status
/// description of a span as it ends, then hands it to `P`.
#[derive(Debug)]
pub struct ScrubSpans<P>(pub P);

fn scrub_string(value: &mut StringValue) {
    if let Some(scrubbed) = scrub_live(value.as_str()) {
        *value = scrubbed.into();
    }
}

fn scrub_attributes(attributes: &mut [KeyValue]) {
    for attribute in attributes {
        match &mut attribute.value {
            Value::String(value) => scrub_string(value),
            Value::Array(Array::String(values)) => values.iter_mut().for_each(scrub_string),
            _ => {}
        }
    }
}

fn scrub_cow(text: &mut Cow<'static, str>) {
    if let Some(scrubbed) = scrub_live(text) {
        *text = Cow::Owned(scrubbed);
    }
}

impl<P: SpanProcessor> SpanProcessor for ScrubSpans<P> {
    fn on_start(&self, span: &mut Span, cx: &opentelemetry::Context) {
        self.0.on_start(span, cx);
    }

    fn on_end(&self, mut span: SpanData) {
        scrub_attributes(&mut span.attributes);
        for event in span.events.events.iter_mut() {
            scrub_cow(&mut event.name);
            scrub_attributes(&mut event.attributes);
        }
        if let Status::Error { description } = &mut span.status {
            scrub_cow(description);
        }
        self.0.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// A log writer that scrubs each line before it is written. The log
/// layer formats a whole event and writes it with one `write_all`, so a
/// value is never split across writes.
#[derive(Debug, Clone)]
pub struct ScrubWriter<M>(pub M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for ScrubWriter<M> {
    type Writer = Scrubbed<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        Scrubbed(self.0.make_writer())
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        Scrubbed(self.0.make_writer_for(meta))
    }
}

/// One scrubbed write.
#[derive(Debug)]
pub struct Scrubbed<W>(W);

impl<W: io::Write> io::Write for Scrubbed<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match std::str::from_utf8(buf).ok().and_then(scrub_live) {
            Some(scrubbed) => self.0.write_all(scrubbed.as_bytes())?,
            None => self.0.write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision_log::{Secrets, mask};
    use std::io::Write;

    #[test]
    fn r29_log_lines_are_scrubbed_of_held_masked_values() {
        let mut secrets = Secrets::default();
        secrets.add("scrub-writer-secret");
        install(crate::decision_log::scrub_live);
        let _held = mask::hold(&secrets);
        let mut out = Vec::new();
        Scrubbed(&mut out)
            .write_all(b"guard failed error=Int(scrub-writer-secret)\n")
            .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "guard failed error=Int([masked])\n"
        );
    }
}
