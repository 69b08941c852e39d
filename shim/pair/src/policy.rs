//! When a dead slot comes back: exponential backoff for engines that die
//! before they become useful, and a restart budget that turns a crash loop
//! into an exit containerd can report.
//!
//! An engine that reached `parked` or `active` and was then killed is the
//! pattern working as intended: its slot is respawned at once, and it does not
//! count towards the crash-loop streak. An engine that dies while starting
//! lengthens the streak; past the budget the pair gives up.

use std::{collections::VecDeque, time::Duration};

use serde::{Deserialize, Serialize};

/// Restart rules, from the shim's config file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    /// Engines in a row that may die before becoming parked or active.
    pub max_consecutive_failures: u32,
    /// Respawns of any kind allowed within `window`.
    pub max_restarts_in_window: u32,
    #[serde(with = "millis")]
    pub window: Duration,
    /// Delay before the second early-death respawn; doubles after that.
    #[serde(with = "millis")]
    pub backoff_initial: Duration,
    #[serde(with = "millis")]
    pub backoff_max: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_consecutive_failures: 5,
            max_restarts_in_window: 120,
            window: Duration::from_secs(600),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
        }
    }
}

/// Durations in the config file are plain milliseconds.
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// What a death leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Respawn the slot after this delay (zero: at once).
    Respawn(Duration),
    /// `max_restarts_in_window` respawns already happened within `window`:
    /// the slot may come back only after this delay, when the window has
    /// room again. A surviving engine keeps serving meanwhile, unprotected.
    WindowFull(Duration),
    /// More engines in a row died before they became useful than
    /// `max_consecutive_failures` allows: the pair gives up.
    CrashLoop,
}

/// The policy's memory: the current streak and the recent respawns.
#[derive(Clone, Debug)]
pub struct RestartBudget {
    policy: RestartPolicy,
    streak: u32,
    recent: VecDeque<Duration>,
}

impl RestartBudget {
    pub fn new(policy: RestartPolicy) -> Self {
        RestartBudget {
            policy,
            streak: 0,
            recent: VecDeque::new(),
        }
    }

    /// Consecutive early deaths so far.
    pub fn streak(&self) -> u32 {
        self.streak
    }

    /// Records a death at `now` and answers what follows. `useful` says
    /// whether the engine had become parked or active.
    pub fn on_death(&mut self, useful: bool, now: Duration) -> Verdict {
        self.streak = if useful { 0 } else { self.streak + 1 };
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_sub(*t) > self.policy.window)
        {
            self.recent.pop_front();
        }
        if self.streak > self.policy.max_consecutive_failures {
            return Verdict::CrashLoop;
        }
        if self.recent.len() as u32 >= self.policy.max_restarts_in_window {
            // The oldest respawn of the window leaves it at `oldest +
            // window`; the respawn is booked for then, so that the window
            // still holds no more than its cap.
            let oldest = self.recent.front().copied().unwrap_or(now);
            let at = oldest + self.policy.window + Duration::from_millis(1);
            self.recent.pop_front();
            self.recent.push_back(at);
            return Verdict::WindowFull(at.saturating_sub(now));
        }
        self.recent.push_back(now);
        Verdict::Respawn(self.delay())
    }

    fn delay(&self) -> Duration {
        if self.streak <= 1 {
            return Duration::ZERO;
        }
        let doublings = (self.streak - 2).min(30);
        self.policy
            .backoff_initial
            .saturating_mul(1u32 << doublings)
            .min(self.policy.backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn useful_engines_respawn_at_once_forever_within_the_window_cap() {
        let mut b = RestartBudget::new(RestartPolicy::default());
        for i in 0..100 {
            assert_eq!(
                b.on_death(true, ms(i * 1000)),
                Verdict::Respawn(Duration::ZERO),
                "death {i}"
            );
        }
        assert_eq!(b.streak(), 0);
    }

    #[test]
    fn early_deaths_back_off_then_exhaust() {
        let policy = RestartPolicy {
            max_consecutive_failures: 4,
            backoff_initial: ms(100),
            backoff_max: ms(250),
            ..RestartPolicy::default()
        };
        let mut b = RestartBudget::new(policy);
        assert_eq!(b.on_death(false, ms(0)), Verdict::Respawn(ms(0)));
        assert_eq!(b.on_death(false, ms(10)), Verdict::Respawn(ms(100)));
        assert_eq!(b.on_death(false, ms(200)), Verdict::Respawn(ms(200)));
        assert_eq!(
            b.on_death(false, ms(500)),
            Verdict::Respawn(ms(250)),
            "capped"
        );
        assert_eq!(
            b.on_death(false, ms(900)),
            Verdict::CrashLoop,
            "fifth early death spends the budget"
        );
    }

    #[test]
    fn a_useful_engine_resets_the_streak() {
        let mut b = RestartBudget::new(RestartPolicy::default());
        b.on_death(false, ms(0));
        b.on_death(false, ms(1));
        assert_eq!(b.streak(), 2);
        assert_eq!(b.on_death(true, ms(2)), Verdict::Respawn(Duration::ZERO));
        assert_eq!(b.streak(), 0);
    }

    #[test]
    fn window_cap_counts_only_recent_respawns() {
        let policy = RestartPolicy {
            max_restarts_in_window: 3,
            window: ms(1000),
            ..RestartPolicy::default()
        };
        let mut b = RestartBudget::new(policy);
        assert_eq!(b.on_death(true, ms(0)), Verdict::Respawn(ms(0)));
        assert_eq!(b.on_death(true, ms(100)), Verdict::Respawn(ms(0)));
        assert_eq!(b.on_death(true, ms(200)), Verdict::Respawn(ms(0)));
        assert_eq!(
            b.on_death(true, ms(300)),
            Verdict::WindowFull(ms(701)),
            "4th within 1 s: booked for when the first has aged out"
        );
        assert_eq!(
            b.on_death(true, ms(400)),
            Verdict::WindowFull(ms(701)),
            "5th: after the second ages out"
        );
        let mut b = RestartBudget::new(RestartPolicy {
            max_restarts_in_window: 3,
            window: ms(1000),
            ..RestartPolicy::default()
        });
        for t in [0, 100, 200] {
            b.on_death(true, ms(t));
        }
        assert_eq!(
            b.on_death(true, ms(1150)),
            Verdict::Respawn(ms(0)),
            "the first two have aged out"
        );
    }
}
