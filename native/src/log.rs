//! The `log` crate's records (the core's log lines) as Envoy's log lines, at the level of
//! Envoy's `dynamic_modules` logger (`--component-log-level dynamic_modules:debug`).

use crate::host::{level_filter, log_line};

struct EnvoyLog;

static ENVOY_LOG: EnvoyLog = EnvoyLog;

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) {
            let message = format!("fanout: {}", record.args());
            let file = record.file().unwrap_or_default();
            log_line(record.level(), &message, file, record.line().unwrap_or(0));
        }
    }

    fn flush(&self) {}
}

/// Sends the `log` crate's records to Envoy (once per process), at Envoy's level.
pub fn install() {
    let _ = log::set_logger(&ENVOY_LOG);
    follow_envoy();
}

/// Follows Envoy's level for the `dynamic_modules` logger (it may change at run time).
pub fn follow_envoy() {
    log::set_max_level(level_filter(crate::abi::log_level()));
}
