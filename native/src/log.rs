//! The `log` crate's records (the core's log lines) as Envoy's log lines, at the level of
//! Envoy's `dynamic_modules` logger (`--component-log-level dynamic_modules:debug`).

use crate::abi;

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
    log::set_max_level(level_filter(abi::log_level()));
}

/// Envoy's log level number of a `log` record's level.
fn envoy_level(level: log::Level) -> u32 {
    match level {
        log::Level::Trace => 0,
        log::Level::Debug => 1,
        log::Level::Info => 2,
        log::Level::Warn => 3,
        log::Level::Error => 4,
    }
}

/// The `log` crate's filter for Envoy's level number.
fn level_filter(envoy: u32) -> log::LevelFilter {
    match envoy {
        0 => log::LevelFilter::Trace,
        1 => log::LevelFilter::Debug,
        2 => log::LevelFilter::Info,
        3 => log::LevelFilter::Warn,
        4 | 5 => log::LevelFilter::Error,
        _ => log::LevelFilter::Off,
    }
}

/// The line of a log record, through Envoy.
fn log_line(level: log::Level, message: &str, file: &str, line: u32) {
    abi::log(envoy_level(level), message, file, line);
}
