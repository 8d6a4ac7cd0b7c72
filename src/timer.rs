//! The root contexts' timers, one owner for each one's period. Envoy keeps one timer per
//! root context; a stream's `set_tick_period` sets its root's. The plugin sets its own from
//! what the configuration and the work in flight need ([`Timers::set`]); work queued from
//! any context that the timer must do soon (an etcd settle, a claim refused at dispatch)
//! quickens the timer of the root it belongs to ([`Timers::hurry`]), which the root's next
//! [`Timers::set`] slows again once the work is done.

use std::time::Duration;

use crate::host::Host;

/// Each root context's timer period, as last set (none set: no timer).
#[derive(Debug, Default)]
pub struct Timers {
    periods: Vec<(u32, Duration)>,
}

impl Timers {
    /// Root `root`'s timer period (`Duration::ZERO`: none).
    pub fn period(&self, root: u32) -> Duration {
        self.periods
            .iter()
            .find(|(id, _)| *id == root)
            .map_or(Duration::ZERO, |(_, period)| *period)
    }

    /// Sets root `root`'s timer to `period` (from the root's callback, or one of its
    /// streams'), if it is not that already.
    pub fn set<H: Host>(&mut self, host: &H, root: u32, period: Duration) {
        match self.periods.iter_mut().find(|(id, _)| *id == root) {
            Some((_, current)) if *current == period => return,
            Some((_, current)) => *current = period,
            None => self.periods.push((root, period)),
        }
        host.set_tick_period(period);
    }

    /// Root `root`'s timer runs at least every `period`: quickened if it is slower or off,
    /// never slowed.
    pub fn hurry<H: Host>(&mut self, host: &H, root: u32, period: Duration) {
        let current = self.period(root);
        if current.is_zero() || current > period {
            self.set(host, root, period);
        }
    }

    /// Root `root` is gone: its timer with it.
    pub fn forget(&mut self, root: u32) {
        self.periods.retain(|(id, _)| *id != root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeHost;

    #[test]
    fn a_period_is_set_once_and_only_quickened_by_hurry() {
        let host = FakeHost::default();
        let mut timers = Timers::default();
        let (slow, fast) = (Duration::from_millis(250), Duration::from_millis(10));
        timers.set(&host, 1, slow);
        timers.set(&host, 1, slow);
        assert_eq!(host.0.borrow().tick_period, Some(slow));
        assert_eq!(host.0.borrow().calls.get("set_tick_period"), Some(&1));
        timers.hurry(&host, 1, fast);
        timers.hurry(&host, 1, slow);
        assert_eq!(timers.period(1), fast, "hurry never slows a timer");
        assert_eq!(timers.period(2), Duration::ZERO);
        timers.hurry(&host, 2, slow);
        assert_eq!(timers.period(2), slow, "a timer that is off is started");
        timers.set(&host, 1, slow);
        assert_eq!(
            timers.period(1),
            slow,
            "the root's own setting slows it again"
        );
        assert_eq!(host.0.borrow().calls.get("set_tick_period"), Some(&4));
        timers.forget(1);
        assert_eq!(timers.period(1), Duration::ZERO);
    }
}
