//! Bounded polls on real state: the one place the workspace's tests wait
//! for something by looking again and again.
//!
//! A crate of its own, with no dependencies, so that every crate's tests
//! can take it (gmsd's, the OCI hook's) and not only those that can afford
//! the containerd harness, which re-exports it as `shadow_tests::wait`.
//!
//! Each poll looks at once, then every `step` until `limit` has passed, and
//! looks once more at the limit before it gives up; a limit is how long an
//! event may take at most, never how long a test waits for sure.
//! - [`until`]: the condition's value, or a panic naming what was awaited;
//! - [`within`]: the value, or None after the limit (for a wait that gives
//!   up quietly, or whose failure says more than [`until`] would);
//! - [`poll`]: the value, or the last thing seen instead of it (for a
//!   failure message or a report about it).
//!
//! With the `tokio` feature, [`on_tokio`] has the same polls for async
//! tests, on tokio's clock: under a paused clock (`start_paused`) a limit
//! is virtual time, and a test that waits takes no real time.

use std::time::{Duration, Instant};

/// Call `f` every `step` until it returns `Ok`; once `limit` has passed,
/// the `Err` of its last call.
pub fn poll<T, E>(
    limit: Duration,
    step: Duration,
    mut f: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + limit;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(last) if Instant::now() >= deadline => return Err(last),
            Err(_) => std::thread::sleep(step),
        }
    }
}

/// Call `f` every `step` until it returns Some; None once `limit` has passed.
pub fn within<T>(limit: Duration, step: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    poll(limit, step, || f().ok_or(())).ok()
}

/// Call `f` every `step` until it returns Some; panic, naming `what`, once
/// `limit` has passed.
#[track_caller]
pub fn until<T>(what: &str, limit: Duration, step: Duration, f: impl FnMut() -> Option<T>) -> T {
    match within(limit, step, f) {
        Some(v) => v,
        None => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// The same polls for async code, sleeping on tokio's clock.
#[cfg(feature = "tokio")]
pub mod on_tokio {
    use std::time::Duration;

    use tokio::time::Instant;

    /// Call `f` every `step` until it returns `Ok`; once `limit` has
    /// passed, the `Err` of its last call.
    pub async fn poll<T, E>(
        limit: Duration,
        step: Duration,
        mut f: impl FnMut() -> Result<T, E>,
    ) -> Result<T, E> {
        let deadline = Instant::now() + limit;
        loop {
            match f() {
                Ok(v) => return Ok(v),
                Err(last) if Instant::now() >= deadline => return Err(last),
                Err(_) => tokio::time::sleep(step).await,
            }
        }
    }

    /// Call `f` every `step` until it returns Some; None once `limit` has
    /// passed.
    pub async fn within<T>(
        limit: Duration,
        step: Duration,
        mut f: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        poll(limit, step, || f().ok_or(())).await.ok()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[tokio::test(start_paused = true)]
        async fn a_limit_is_the_clocks_time() {
            let start = Instant::now();
            let none = within(Duration::from_secs(3600), Duration::from_secs(1), || {
                None::<()>
            })
            .await;
            assert_eq!(none, None);
            assert!(start.elapsed() >= Duration::from_secs(3600));
            let mut n = 0;
            let v = within(Duration::from_secs(60), Duration::from_millis(5), || {
                n += 1;
                (n == 3).then_some(n)
            })
            .await;
            assert_eq!(v, Some(3));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEP: Duration = Duration::from_millis(1);

    #[test]
    fn until_returns_the_first_value() {
        let mut n = 0;
        let v = until("n to reach 3", Duration::from_secs(60), STEP, || {
            n += 1;
            (n >= 3).then_some(n)
        });
        assert_eq!(v, 3);
    }

    #[test]
    #[should_panic(expected = "waiting for the impossible")]
    fn until_names_what_never_came() {
        until("the impossible", Duration::ZERO, STEP, || None::<()>);
    }

    #[test]
    fn a_poll_looks_at_least_once_and_gives_up_with_the_last_thing_seen() {
        let mut n = 0;
        let last = poll(Duration::ZERO, STEP, || {
            n += 1;
            Err::<(), _>(n)
        });
        assert_eq!(last, Err(1));
        assert_eq!(within(Duration::ZERO, STEP, || Some(7)), Some(7));
        assert_eq!(within(Duration::ZERO, STEP, || None::<u8>), None);
    }
}
