//! The host's clock as the deliveries read it: once per callback at most.

use std::cell::Cell;

use crate::host::Host;

/// The host's clock, read at most once per callback and only if something needs the time:
/// a plain success with metrics off costs no clock read (each read is a host call). One
/// reading serves the milliseconds of retries and metrics and, with `tracing`, the
/// nanoseconds of spans. Without spans to time it reads milliseconds: in wasm32 a 64-bit
/// division by a constant is a 128-bit multiplication in a libcall, per call answered.
pub(super) struct Clock<'h, H> {
    pub(super) host: &'h H,
    /// Whether spans may need nanoseconds (`tracing` is configured).
    spans: bool,
    /// The reading: nanoseconds if `spans`, else milliseconds.
    reading: Cell<Option<u64>>,
}

impl<'h, H: Host> Clock<'h, H> {
    pub(super) fn new(host: &'h H, spans: bool) -> Self {
        Clock {
            host,
            spans,
            reading: Cell::new(None),
        }
    }

    /// Milliseconds.
    #[inline]
    pub(super) fn now(&self) -> u64 {
        if self.spans {
            self.now_ns() / 1_000_000
        } else {
            self.read(|host| host.now_ms())
        }
    }

    /// Nanoseconds (of the millisecond, without `tracing`).
    pub(super) fn now_ns(&self) -> u64 {
        if self.spans {
            self.read(|host| host.now_nanos())
        } else {
            self.now().saturating_mul(1_000_000)
        }
    }

    #[inline]
    fn read(&self, read: impl FnOnce(&H) -> u64) -> u64 {
        let now = self.reading.get().unwrap_or_else(|| read(self.host));
        self.reading.set(Some(now));
        now
    }
}
