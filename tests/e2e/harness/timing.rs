//! Wall-clock checks on waits that Envoy times, and polling with a deadline.
//!
//! Envoy's timers are libevent's. Envoy makes its event base with plain `event_base_new()`
//! (read in source/common/event/libevent_scheduler.cc: no precise-timer flag), so on Linux
//! libevent reads CLOCK_MONOTONIC_COARSE (one kernel tick: 4 ms at HZ=250, as on the machine
//! this was measured on, 10 ms at HZ=100) and counts a new timer from the event loop's cached
//! time, so by a client's precise clock a timer may fire a little early: a 700 ms call
//! timeout was seen to end 699.45 ms after the client sent the request.
//! Late, a loaded machine can make it anything: lower bounds are tight, upper bounds are only
//! there to tell "the timer fired" from "the timer never fired", and stay well apart from it.

use std::time::{Duration, Instant};

/// How much earlier than its nominal value a wait that Envoy times may look to the test: one
/// coarse-clock tick on a HZ=100 kernel (the coarsest common one). Small enough that a timeout
/// firing at half its value, or a retry with no backoff, still fails for every nominal wait
/// the suites check (the shortest is 300 ms).
pub const TIMER_EARLY_SLACK: Duration = Duration::from_millis(10);

/// How much later than its nominal value a wait may end on a loaded machine and still count
/// as "on time" (load average 6 on 2 cores, other builds running). Only for upper bounds that
/// tell a wait that ended from one that did not, where the wrong behaviour is further away
/// than this; where it is closer, the test names its own bound below the wrong value.
pub const LOADED_LATE_SLACK: Duration = Duration::from_secs(3);

/// Assert that `elapsed`, measured around something Envoy times (`what`), is at least
/// `nominal` less [`TIMER_EARLY_SLACK`].
#[track_caller]
pub fn assert_waited_at_least(elapsed: Duration, nominal: Duration, what: &str) {
    assert!(
        elapsed + TIMER_EARLY_SLACK >= nominal,
        "{what}: waited {elapsed:?}, less than its {nominal:?} (allowing {TIMER_EARLY_SLACK:?} \
         early for Envoy's coarse timer clock)"
    );
}

/// Assert that a wait Envoy timed (`what`) ended about at `nominal`: not before it (less
/// [`TIMER_EARLY_SLACK`]) and not [`LOADED_LATE_SLACK`] after it.
#[track_caller]
pub fn assert_waited_about(elapsed: Duration, nominal: Duration, what: &str) {
    assert_waited_at_least(elapsed, nominal, what);
    assert!(
        elapsed < nominal + LOADED_LATE_SLACK,
        "{what}: waited {elapsed:?}, more than {LOADED_LATE_SLACK:?} after its {nominal:?}"
    );
}

/// How much earlier than its nominal value a wait Envoy timed may look on fanout's own clock
/// (a report's `elapsed_ms`). fanout reads the host's real clock when it sends a call; Envoy
/// arms the call's timeout from its event loop's cached time, which lags the real clock by as
/// long as the loop has been busy in that iteration: tens of milliseconds on a loaded machine
/// (a 300 ms timeout reported at 284 ms, CI and a fuzzer sharing 2 cores). Still small enough
/// that a timeout firing at half its value fails (the shortest nominal wait checked is 300 ms).
pub const HOST_CLOCK_EARLY_SLACK: Duration = Duration::from_millis(100);

/// Assert that a wait Envoy timed, as fanout measured it on the host clock (`what`), is at
/// least `nominal` less [`HOST_CLOCK_EARLY_SLACK`].
#[track_caller]
pub fn assert_host_measured_at_least(elapsed: Duration, nominal: Duration, what: &str) {
    assert!(
        elapsed + HOST_CLOCK_EARLY_SLACK >= nominal,
        "{what}: {elapsed:?}, less than its {nominal:?} (allowing {HOST_CLOCK_EARLY_SLACK:?} \
         early: Envoy arms timers from its event loop's cached time)"
    );
}

/// Assert that a wait Envoy timed, as fanout measured it (`what`), ended about at `nominal`:
/// not before it (less [`HOST_CLOCK_EARLY_SLACK`]) and not [`LOADED_LATE_SLACK`] after it.
#[track_caller]
pub fn assert_host_measured_about(elapsed: Duration, nominal: Duration, what: &str) {
    assert_host_measured_at_least(elapsed, nominal, what);
    assert!(
        elapsed < nominal + LOADED_LATE_SLACK,
        "{what}: {elapsed:?}, more than {LOADED_LATE_SLACK:?} after its {nominal:?}"
    );
}

/// Call `probe` every `every` until it returns `Some`; that value, or `None` once `timeout`
/// passed (with one last try at the deadline, so a slow machine gets its full timeout).
pub fn poll_until<T>(
    timeout: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe() {
            return Some(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(every.min(deadline - now));
    }
}
