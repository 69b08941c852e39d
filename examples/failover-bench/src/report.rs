//! From samples to figures: the unavailability window of each kill, failed
//! requests, latency percentiles before / during / after, the JSON report,
//! the human table and the SVG timeline of all arms on one chart.

use std::path::Path;

use plotters::prelude::*;
use serde_json::{json, Value};

use crate::error::Error;
use crate::load::{Failure, Sample};
use shadow_engine::promotion::{Part, Promoted};

/// One arm's run: its samples and when its kills happened.
pub struct ArmRun {
    pub arm: String,
    pub samples: Vec<Sample>,
    /// ms from the start of the load.
    pub kills_ms: Vec<f64>,
    /// Engine READY after each kill, as the shim saw it (pairs only).
    pub promotion_ready_ms: Vec<f64>,
    /// Each kill's promotion as the promoted engine logged it (pairs
    /// only; None: no line found for that kill).
    pub promotions: Vec<Option<Promotion>>,
}

/// One promotion's parts, each in ms after its SIGKILL: `lock` (the
/// promoted engine holds the lock), then the engine's own steps
/// (`shadow_engine::promotion::Part`).
#[derive(Debug, Clone, PartialEq)]
pub struct Promotion(pub Vec<(&'static str, f64)>);

impl Promotion {
    /// `p`'s parts counted from a SIGKILL at `kill_mono_us`.
    pub fn since(kill_mono_us: u64, p: &Promoted) -> Promotion {
        let lock = p.lock_us.saturating_sub(kill_mono_us) as f64 / 1e3;
        let mut parts = vec![("lock", lock)];
        parts.extend(p.parts.iter().map(|(part, ms)| (part.key(), lock + ms)));
        Promotion(parts)
    }

    fn json(&self) -> Value {
        Value::Object(
            self.0
                .iter()
                .map(|(k, ms)| ((*k).to_owned(), round(Some(*ms))))
                .collect(),
        )
    }
}

/// The median of each part over the promotions that have it, in the
/// order of a promotion's line.
fn promotion_p50(promotions: &[Option<Promotion>]) -> Value {
    let keys = std::iter::once("lock").chain(Part::ALL.iter().map(|p| p.key()));
    let mut out = serde_json::Map::new();
    for key in keys {
        let v: Vec<f64> = promotions
            .iter()
            .flatten()
            .filter_map(|p| p.0.iter().find(|(k, _)| *k == key).map(|(_, ms)| *ms))
            .collect();
        if let Some(m) = pct(&v, 0.5) {
            out.insert(key.to_owned(), round(Some(m)));
        }
    }
    Value::Object(out)
}

fn pct(v: &[f64], p: f64) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    (!v.is_empty()).then(|| v[((v.len() as f64 - 1.0) * p).round() as usize])
}

fn round(x: Option<f64>) -> Value {
    x.map(|x| json!((x * 1000.0).round() / 1000.0))
        .unwrap_or(Value::Null)
}

fn phase(samples: &[&Sample]) -> Value {
    let ok: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.latency_ms)
        .collect();
    json!({
        "requests": samples.len(),
        "failed": samples.iter().filter(|s| !s.ok).count(),
        "p50_ms": round(pct(&ok, 0.5)),
        "p99_ms": round(pct(&ok, 0.99)),
    })
}

impl ArmRun {
    /// Kill → first successful answer to a request sent after that kill.
    pub fn unavailable_ms(&self) -> Vec<Option<f64>> {
        self.kills_ms
            .iter()
            .map(|&k| {
                self.samples
                    .iter()
                    .filter(|s| s.ok && s.sent_ms >= k)
                    .map(|s| s.sent_ms + s.latency_ms - k)
                    .min_by(|a, b| a.total_cmp(b))
            })
            .collect()
    }

    pub fn summary(&self, weights_mib: u64, rate: f64) -> Value {
        let unavailable = self.unavailable_ms();
        let known: Vec<f64> = unavailable.iter().flatten().copied().collect();
        let first_kill = self.kills_ms.first().copied().unwrap_or(f64::MAX);
        let last_kill = self.kills_ms.last().copied().unwrap_or(f64::MAX);
        let recovered = unavailable
            .last()
            .copied()
            .flatten()
            .map(|u| last_kill + u)
            .unwrap_or(f64::MAX);
        let before: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.sent_ms < first_kill)
            .collect();
        let during: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.sent_ms >= first_kill && s.sent_ms < recovered)
            .collect();
        let after: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.sent_ms >= recovered)
            .collect();
        let ok: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.ok)
            .map(|s| s.latency_ms)
            .collect();
        let mut errors: std::collections::BTreeMap<String, usize> = Default::default();
        for s in self.samples.iter().filter(|s| !s.ok) {
            let e = s.error.clone().unwrap_or_default();
            // Group by kind, not by the exact message.
            let kind = e.split(':').next().unwrap_or_default().to_owned();
            *errors.entry(kind).or_default() += 1;
        }
        let count = |f: Failure| self.samples.iter().filter(|s| s.failure == Some(f)).count();
        json!({
            "arm": self.arm,
            "weights_mib": weights_mib,
            "rate_per_s": rate,
            "kills": self.kills_ms.len(),
            "unavailable_ms": round(pct(&known, 0.5)),
            "unavailable_ms_max": round(known.iter().copied().reduce(f64::max)),
            "unavailable_per_kill_ms": unavailable.iter().map(|u| round(*u)).collect::<Vec<_>>(),
            "recovered": known.len() == unavailable.len(),
            "promotion_ready_ms": self.promotion_ready_ms.iter().map(|u| round(Some(*u))).collect::<Vec<_>>(),
            "promotion_ms": self.promotions.iter().map(|p| p.as_ref().map_or(Value::Null, Promotion::json)).collect::<Vec<_>>(),
            "promotion_ms_p50": promotion_p50(&self.promotions),
            "requests": self.samples.len(),
            "failed_requests": self.samples.iter().filter(|s| !s.ok).count(),
            "failed_after_recovery": after.iter().filter(|s| !s.ok).count(),
            "refused": count(Failure::Refused),
            "reset_in_flight": count(Failure::ResetInFlight),
            "timeouts": count(Failure::Timeout),
            "wrong": count(Failure::Wrong),
            "errors": errors,
            "p50_ms": round(pct(&ok, 0.5)),
            "p99_ms": round(pct(&ok, 0.99)),
            "before": phase(&before),
            "during": phase(&during),
            "after": phase(&after),
        })
    }
}

fn cell(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) => format!("{x:.1}"),
        None => "-".into(),
    }
}

/// The side-by-side table.
pub fn table(rows: &[Value]) -> String {
    let mut out = format!(
        "{:<8} {:>7} {:>6} {:>14} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}\n",
        "arm",
        "weights",
        "kills",
        "unavail ms",
        "failed",
        "refused",
        "reset",
        "timeout",
        "requests",
        "p50 ms",
        "p99 ms",
        "p99 before",
        "p99 after"
    );
    for r in rows {
        out += &format!(
            "{:<8} {:>5}Mi {:>6} {:>14} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}\n",
            r["arm"].as_str().unwrap_or("?"),
            r["weights_mib"].to_string(),
            r["kills"].to_string(),
            if r["kills"].as_u64() > Some(1) {
                format!(
                    "{} (max {})",
                    cell(&r["unavailable_ms"]),
                    cell(&r["unavailable_ms_max"])
                )
            } else {
                cell(&r["unavailable_ms"])
            },
            r["failed_requests"].to_string(),
            r["refused"].to_string(),
            r["reset_in_flight"].to_string(),
            r["timeouts"].to_string(),
            r["requests"].to_string(),
            cell(&r["p50_ms"]),
            cell(&r["p99_ms"]),
            cell(&r["before"]["p99_ms"]),
            cell(&r["after"]["p99_ms"]),
        );
    }
    out
}

/// Latency of every request around the kill(s), all arms on one chart:
/// x = send time relative to the first kill, y = latency (log scale);
/// failed requests are drawn along the top, one band per arm, the marker
/// naming the kind: × refused, ▲ reset in flight, ■ timeout, ○ wrong.
pub fn chart(runs: &[ArmRun], path: &Path, title: &str) -> Result<(), Error> {
    let draw = |e: &dyn std::fmt::Display| Error::Chart {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let first = |r: &ArmRun| r.kills_ms.first().copied().unwrap_or(0.0);
    let x_min = runs
        .iter()
        .filter_map(|r| r.samples.first().map(|s| s.sent_ms - first(r)))
        .fold(0.0f64, f64::min);
    let x_max = runs
        .iter()
        .filter_map(|r| r.samples.last().map(|s| s.sent_ms - first(r)))
        .fold(1.0f64, f64::max);
    let y_max = runs
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.latency_ms))
        .fold(10.0f64, f64::max)
        * 2.0;
    let root = SVGBackend::new(path, (1100, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_min..x_max, (0.05f64..y_max).log_scale())
        .map_err(|e| draw(&e))?;
    c.configure_mesh()
        .x_desc("request sent (ms after the first SIGKILL)")
        .y_desc("latency (ms, log)")
        .draw()
        .map_err(|e| draw(&e))?;
    let colours = [
        RGBColor(200, 60, 40),
        RGBColor(30, 110, 200),
        RGBColor(40, 150, 70),
    ];
    for (i, r) in runs.iter().enumerate() {
        let col = colours[i % colours.len()];
        let k0 = first(r);
        c.draw_series(
            r.samples
                .iter()
                .filter(|s| s.ok)
                .map(|s| Circle::new((s.sent_ms - k0, s.latency_ms.max(0.06)), 2, col.filled())),
        )
        .map_err(|e| draw(&e))?
        .label(format!("{} (ok)", r.arm))
        .legend(move |(x, y)| Circle::new((x, y), 3, col.filled()));
        let top = y_max / 1.5 / (1.0 + i as f64 * 0.4);
        let at = |kind: Failure| {
            r.samples
                .iter()
                .filter(move |s| s.failure == Some(kind))
                .map(move |s| (s.sent_ms - k0, top))
        };
        // The legend names each kind once, in black: the colour is the arm's.
        let first = i == 0;
        let name = |kind: Failure| format!("failed: {}", kind.key().replace('_', " "));
        let a = c
            .draw_series(at(Failure::Refused).map(|p| Cross::new(p, 4, col.stroke_width(2))))
            .map_err(|e| draw(&e))?;
        if first {
            a.label(name(Failure::Refused))
                .legend(|p| Cross::new(p, 4, BLACK.stroke_width(2)));
        }
        let a = c
            .draw_series(
                at(Failure::ResetInFlight).map(|p| TriangleMarker::new(p, 4, col.filled())),
            )
            .map_err(|e| draw(&e))?;
        if first {
            a.label(name(Failure::ResetInFlight))
                .legend(|p| TriangleMarker::new(p, 4, BLACK.filled()));
        }
        let square =
            |p, style: ShapeStyle| EmptyElement::at(p) + Rectangle::new([(-3, -3), (3, 3)], style);
        let a = c
            .draw_series(at(Failure::Timeout).map(|p| square(p, col.filled())))
            .map_err(|e| draw(&e))?;
        if first {
            a.label(name(Failure::Timeout)).legend(move |p| {
                EmptyElement::at(p) + Rectangle::new([(-3, -3), (3, 3)], BLACK.filled())
            });
        }
        let a = c
            .draw_series(at(Failure::Wrong).map(|p| Circle::new(p, 4, col.stroke_width(1))))
            .map_err(|e| draw(&e))?;
        if first {
            a.label(name(Failure::Wrong))
                .legend(|p| Circle::new(p, 4, BLACK.stroke_width(1)));
        }
        for &k in &r.kills_ms {
            c.draw_series(LineSeries::new(
                [(k - k0, 0.05), (k - k0, y_max)],
                col.mix(0.4).stroke_width(1),
            ))
            .map_err(|e| draw(&e))?;
        }
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(sent_ms: f64, latency_ms: f64, ok: bool) -> Sample {
        Sample {
            sent_ms,
            latency_ms,
            ok,
            error: (!ok).then(|| "connect: refused".to_owned()),
            failure: (!ok).then_some(Failure::Refused),
        }
    }

    #[test]
    fn unavailability_counts_from_requests_sent_after_the_kill() {
        let run = ArmRun {
            arm: "x".into(),
            samples: vec![
                s(90.0, 2.0, true),
                // Sent before the kill, answered after it: not a recovery.
                s(99.0, 30.0, true),
                s(105.0, 1.0, false),
                s(110.0, 1.0, false),
                s(120.0, 5.0, true),
                s(130.0, 2.0, true),
            ],
            kills_ms: vec![100.0],
            promotion_ready_ms: vec![],
            promotions: vec![],
        };
        assert_eq!(run.unavailable_ms(), vec![Some(25.0)]);
        let v = run.summary(1, 100.0);
        assert_eq!(v["failed_requests"], 2);
        assert_eq!(v["failed_after_recovery"], 0);
        assert_eq!(v["before"]["requests"], 2);
        assert_eq!(v["during"]["requests"], 3);
        assert_eq!(v["after"]["requests"], 1);
        assert_eq!(v["errors"]["connect"], 2);
        assert_eq!(v["refused"], 2);
        assert_eq!(v["reset_in_flight"], 0);
        assert_eq!(v["timeouts"], 0);
    }

    #[test]
    fn the_table_and_the_chart_show_each_kind_of_failure() {
        let mut reset = s(112.0, 1.0, false);
        reset.failure = Some(Failure::ResetInFlight);
        let mut timeout = s(114.0, 2000.0, false);
        timeout.failure = Some(Failure::Timeout);
        let run = ArmRun {
            arm: "x".into(),
            samples: vec![
                s(90.0, 2.0, true),
                s(105.0, 1.0, false),
                reset,
                timeout,
                s(120.0, 5.0, true),
            ],
            kills_ms: vec![100.0],
            promotion_ready_ms: vec![],
            promotions: vec![],
        };
        let v = run.summary(1, 100.0);
        assert_eq!(
            (&v["refused"], &v["reset_in_flight"], &v["timeouts"]),
            (&json!(1), &json!(1), &json!(1))
        );
        let t = table(&[v]);
        assert!(
            t.contains("refused") && t.contains("reset") && t.contains("timeout"),
            "{t}"
        );
        let dir = tempfile::tempdir().unwrap();
        let svg = dir.path().join("t.svg");
        chart(&[run], &svg, "t").unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        for label in [
            "failed: refused",
            "failed: reset in flight",
            "failed: timeouts",
            "failed: wrong",
        ] {
            assert!(text.contains(label), "{label} missing from the chart");
        }
    }

    #[test]
    fn promotions_count_from_their_kill_and_take_medians_per_part() {
        let line = |lock: u64, answered: f64| Promoted {
            slot: "1".into(),
            lock_us: lock,
            parts: vec![(Part::Kv, 0.5), (Part::Answered, answered)],
        };
        let a = Promotion::since(1_000, &line(9_000, 3.0));
        assert_eq!(a.0, vec![("lock", 8.0), ("kv", 8.5), ("answered", 11.0)]);
        let b = Promotion::since(1_000, &line(5_000, 1.0));
        let c = Promotion::since(1_000, &line(3_000, 2.0));
        let run = ArmRun {
            arm: "shadow".into(),
            samples: vec![s(10.0, 1.0, true)],
            kills_ms: vec![5.0, 6.0, 7.0, 8.0],
            promotion_ready_ms: vec![],
            promotions: vec![Some(a), None, Some(b), Some(c)],
        };
        let v = run.summary(1, 100.0);
        assert_eq!(v["promotion_ms"][1], Value::Null);
        assert_eq!(v["promotion_ms"][0]["answered"], json!(11.0));
        let p50 = &v["promotion_ms_p50"];
        assert_eq!(
            (&p50["lock"], &p50["kv"], &p50["answered"]),
            (&json!(4.0), &json!(4.5), &json!(5.0))
        );
        assert!(
            p50.get("fetched").is_none(),
            "a part no line has is left out"
        );
    }

    #[test]
    fn a_kill_never_recovered_from_is_reported_as_such() {
        let run = ArmRun {
            arm: "x".into(),
            samples: vec![s(10.0, 1.0, true), s(60.0, 1.0, false)],
            kills_ms: vec![50.0],
            promotion_ready_ms: vec![],
            promotions: vec![],
        };
        let v = run.summary(1, 100.0);
        assert_eq!(v["recovered"], false);
        assert!(v["unavailable_ms"].is_null());
        assert!(table(&[v]).contains(" - "));
    }
}
