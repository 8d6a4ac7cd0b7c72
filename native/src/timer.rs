//! The timer Envoy's dynamic-module HTTP filter does not have: one thread for the process
//! that, when a plugin's tick is due, commits to a wake-up handle of its thread (a worker's
//! live stream's scheduler, whose `on_http_filter_scheduled` runs the worker's tick on the
//! worker; or a configuration's scheduler, whose `on_http_filter_config_scheduled` runs its
//! hub's tick on the main thread). It holds each handle (an `Arc`) until it has committed to
//! it, so a handle is deleted only once nobody can commit to it any more; the thread is
//! started by the first wake-up asked for and stopped (joined) by [`Timer::stop`].

use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// The process's timer thread: wakes a worker whose plugin has a retry waiting, and a hub
/// whose plugin has a period.
pub static TIMER: LazyLock<Timer<dyn Wake>> = LazyLock::new(Timer::default);

/// What the timer commits to: an event posted to the handle's worker, from any thread.
pub trait Wake: Send + Sync + 'static {
    fn commit(&self, event: u64);
}

/// One wake-up asked for.
struct Due<W: ?Sized> {
    at: Instant,
    event: u64,
    handle: Arc<W>,
}

struct Schedule<W: ?Sized> {
    due: Vec<Due<W>>,
    stop: bool,
}

/// The wake-ups asked for, and the thread that makes them.
pub struct Timer<W: ?Sized> {
    shared: Arc<(Mutex<Schedule<W>>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<W: Wake + ?Sized> Default for Timer<W> {
    fn default() -> Self {
        Timer {
            shared: Arc::new((
                Mutex::new(Schedule {
                    due: Vec::new(),
                    stop: false,
                }),
                Condvar::new(),
            )),
            thread: Mutex::new(None),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<W: Wake + ?Sized> Timer<W> {
    /// Commits `event` to `handle` at `at`, or earlier if it is asked for earlier already (one
    /// wake-up per event: a later ask for the same event moves it only forward in time, and
    /// to the newer handle).
    pub fn wake_at(&self, at: Instant, event: u64, handle: Arc<W>) {
        self.start();
        let (schedule, changed) = &*self.shared;
        let mut schedule = lock(schedule);
        match schedule.due.iter_mut().find(|d| d.event == event) {
            Some(due) if due.at <= at => due.handle = handle,
            Some(due) => {
                due.at = at;
                due.handle = handle;
            }
            None => schedule.due.push(Due { at, event, handle }),
        }
        changed.notify_one();
    }

    /// Whether a wake-up of `event` is pending.
    pub fn pending(&self, event: u64) -> bool {
        lock(&self.shared.0).due.iter().any(|d| d.event == event)
    }

    /// Stops the thread (joined), dropping the wake-ups not made: nothing commits after
    /// this returns, until the next [`Timer::wake_at`] starts it again.
    pub fn stop(&self) {
        let thread = lock(&self.thread).take();
        {
            let (schedule, changed) = &*self.shared;
            lock(schedule).stop = true;
            changed.notify_all();
        }
        if let Some(thread) = thread {
            if thread.join().is_err() {
                log::warn!("the timer thread ended abnormally");
            }
        }
        let dropped = std::mem::take(&mut lock(&self.shared.0).due);
        drop(dropped);
    }

    fn start(&self) {
        let mut thread = lock(&self.thread);
        if thread.is_some() {
            return;
        }
        lock(&self.shared.0).stop = false;
        let shared = self.shared.clone();
        match std::thread::Builder::new()
            .name("fanout-timer".to_string())
            .spawn(move || run(&shared))
        {
            Ok(handle) => *thread = Some(handle),
            Err(error) => log::error!("cannot start the timer thread: {error}"),
        }
    }
}

/// The thread: waits for the earliest wake-up, commits it (outside the lock), and drops
/// its handle.
fn run<W: Wake + ?Sized>(shared: &(Mutex<Schedule<W>>, Condvar)) {
    let (schedule, changed) = shared;
    let mut guard = lock(schedule);
    loop {
        if guard.stop {
            return;
        }
        let now = Instant::now();
        let due = guard.due.iter().position(|d| d.at <= now);
        if let Some(index) = due {
            let fire = guard.due.swap_remove(index);
            drop(guard);
            fire.handle.commit(fire.event);
            drop(fire);
            guard = lock(schedule);
            continue;
        }
        guard = match guard.due.iter().map(|d| d.at).min() {
            Some(next) => {
                let wait = next.saturating_duration_since(now);
                changed
                    .wait_timeout(guard, wait)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0)
            }
            None => changed.wait(guard).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    #[derive(Default)]
    struct Probe {
        commits: Mutex<Vec<(u64, Instant)>>,
        dropped: Arc<AtomicU64>,
    }

    impl Wake for Probe {
        fn commit(&self, event: u64) {
            lock(&self.commits).push((event, Instant::now()));
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wait_for(what: impl Fn() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !what() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_wake_up_is_committed_once_not_before_its_time_and_its_handle_dropped() {
        let timer = Timer::default();
        let probe = Arc::new(Probe::default());
        let dropped = probe.dropped.clone();
        let start = Instant::now();
        timer.wake_at(start + Duration::from_millis(200), 7, probe.clone());
        timer.wake_at(start + Duration::from_millis(400), 7, probe.clone());
        assert!(timer.pending(7));
        wait_for(|| !timer.pending(7));
        let commits = lock(&probe.commits).clone();
        assert_eq!(commits.len(), 1);
        assert_eq!(commits[0].0, 7);
        assert!(commits[0].1 >= start + Duration::from_millis(200));
        drop(probe);
        // The timer held a clone until it committed: it is gone now.
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        timer.stop();
    }

    #[test]
    fn stop_drops_what_was_not_made_and_a_later_ask_starts_it_again() {
        let timer = Timer::default();
        let probe = Arc::new(Probe::default());
        timer.wake_at(Instant::now() + Duration::from_secs(3600), 1, probe.clone());
        timer.stop();
        assert!(!timer.pending(1));
        assert_eq!(Arc::strong_count(&probe), 1);
        timer.wake_at(Instant::now(), 2, probe.clone());
        wait_for(|| !lock(&probe.commits).is_empty());
        assert_eq!(lock(&probe.commits).len(), 1);
        timer.stop();
    }
}
