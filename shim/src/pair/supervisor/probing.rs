//! The probe of the pair's serving engine (`shadow.dev/probe`): kept on
//! the engine the pair would probe now, launched when due, one at a time,
//! its outcome coming back as `Input::Probed`.

use tokio::time::Instant;

use super::super::input::Input;
use super::Supervisor;

impl Supervisor {
    /// Keeps the probe's schedule on the engine the pair would have
    /// probed now: a new serving engine is first probed one period after
    /// it began to serve.
    pub(super) fn schedule_probe(&mut self) {
        let target = self.pair.probe_target();
        let Some(p) = self.probing.as_mut() else {
            return;
        };
        if p.target != target {
            p.target = target;
            p.failing = 0;
            p.next = target.map(|_| Instant::now() + p.settings.period);
        }
    }

    /// Starts the probe if it is due and none is in flight; its outcome
    /// comes back as `Input::Probed`.
    pub(super) fn launch_probe(&mut self) {
        let Some(p) = self.probing.as_mut() else {
            return;
        };
        let now = Instant::now();
        let (Some((slot, generation)), Some(next)) = (p.target, p.next) else {
            return;
        };
        if p.in_flight || next > now {
            return;
        }
        p.in_flight = true;
        // From the start of one probe to the start of the next (from now,
        // if the one due is a period late already).
        let after = next + p.settings.period;
        p.next = Some(if after <= now {
            now + p.settings.period
        } else {
            after
        });
        let prober = p.prober.clone();
        let timeout = p.settings.timeout;
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let outcome = prober.check(timeout).await;
            let _ = tx
                .send(Input::Probed {
                    slot,
                    generation,
                    outcome,
                })
                .await;
        });
    }
}
