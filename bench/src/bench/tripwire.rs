//! The tripwire (`guardmesh bench --quick --placement split --tripwire
//! bench/last-full-run.json`): fails a run whose mesh costs much more than
//! the last full run said, relative to the relay floor measured in the same
//! run. Ratios in one run only, so a busy machine slows both sides alike;
//! the margin ([`MARGIN`]) is for what it does not.
//!
//! The committed file holds the two figures of the last full run and how to
//! make them again:
//!
//! ```json
//! {
//!   "command": "guardmesh bench --placement split --json target/bench.json",
//!   "commit": "…",
//!   "cpu_per_batch_mesh4_vs_relay_floor4": 1.25,
//!   "throughput_mesh4_vs_relay_floor4": 0.93
//! }
//! ```

use super::Error;
use serde_json::Value;
use std::path::Path;

/// How much worse than the committed figure a run may be before the
/// tripwire fails.
pub(super) const MARGIN: f64 = 1.5;

/// The figures watched, and which way is worse.
const WATCHED: [(&str, Worse); 2] = [
    ("cpu_per_batch_mesh4_vs_relay_floor4", Worse::Higher),
    ("throughput_mesh4_vs_relay_floor4", Worse::Lower),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Worse {
    Higher,
    Lower,
}

/// One watched figure that tripped: its name, this run's value and the
/// committed one.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Trip {
    pub(super) figure: &'static str,
    pub(super) run: f64,
    pub(super) committed: f64,
}

/// The watched figures of `run` (a run's JSON) that are more than
/// [`MARGIN`] times worse than in `committed`. A figure missing or not a
/// positive number on either side is an error, never a pass.
pub(super) fn judge(run: &Value, committed: &Value) -> Result<Vec<Trip>, Error> {
    let mut trips = Vec::new();
    for (figure, worse) in WATCHED {
        let value = |side: &Value, which: &str| -> Result<f64, Error> {
            side.get(figure)
                .and_then(Value::as_f64)
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("tripwire: {which} has no figure {figure}").into())
        };
        let (now, then) = (
            value(run, "this run")?,
            value(committed, "the committed file")?,
        );
        let tripped = match worse {
            Worse::Higher => now > then * MARGIN,
            Worse::Lower => now * MARGIN < then,
        };
        if tripped {
            trips.push(Trip {
                figure,
                run: now,
                committed: then,
            });
        }
    }
    Ok(trips)
}

/// Checks `run` against the committed figures at `path`: `Err` naming
/// every figure that tripped and how to rerun it.
pub(super) fn check(run: &Value, path: &Path) -> Result<(), Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("tripwire: cannot read {}: {e}", path.display()))?;
    let committed: Value = serde_json::from_str(&text)
        .map_err(|e| format!("tripwire: {} is not JSON: {e}", path.display()))?;
    let trips = judge(run, &committed)?;
    if trips.is_empty() {
        for (figure, _) in WATCHED {
            println!(
                "tripwire: {figure} {:.2} (committed {:.2}): within {MARGIN}x",
                run.get(figure).and_then(Value::as_f64).unwrap_or(f64::NAN),
                committed
                    .get(figure)
                    .and_then(Value::as_f64)
                    .unwrap_or(f64::NAN),
            );
        }
        return Ok(());
    }
    let mut message = String::from("tripwire: the mesh costs more than the last full run said");
    for trip in &trips {
        message.push_str(&format!(
            "\n  {} is {:.2} in this run against {:.2} committed in {} (more than {MARGIN} times worse)",
            trip.figure,
            trip.run,
            trip.committed,
            path.display()
        ));
    }
    message.push_str(&format!(
        "\nrerun it: guardmesh bench --quick --placement split --tripwire {}\n\
         a change that means it records a new full run (docs/performance.md, \"The tripwire\")",
        path.display()
    ));
    Err(message.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn committed() -> Value {
        json!({
            "cpu_per_batch_mesh4_vs_relay_floor4": 1.3,
            "throughput_mesh4_vs_relay_floor4": 0.9,
        })
    }

    #[test]
    fn a_run_within_the_margin_passes() {
        let run = json!({
            "cpu_per_batch_mesh4_vs_relay_floor4": 1.9,
            "throughput_mesh4_vs_relay_floor4": 0.61,
        });
        assert_eq!(judge(&run, &committed()).unwrap(), []);
    }

    #[test]
    fn cpu_beyond_the_margin_trips_and_is_named() {
        let run = json!({
            "cpu_per_batch_mesh4_vs_relay_floor4": 3.44,
            "throughput_mesh4_vs_relay_floor4": 0.9,
        });
        let trips = judge(&run, &committed()).unwrap();
        assert_eq!(trips.len(), 1);
        assert_eq!(trips[0].figure, "cpu_per_batch_mesh4_vs_relay_floor4");
    }

    #[test]
    fn throughput_beyond_the_margin_trips() {
        let run = json!({
            "cpu_per_batch_mesh4_vs_relay_floor4": 1.3,
            "throughput_mesh4_vs_relay_floor4": 0.28,
        });
        let trips = judge(&run, &committed()).unwrap();
        assert_eq!(
            trips.iter().map(|t| t.figure).collect::<Vec<_>>(),
            ["throughput_mesh4_vs_relay_floor4"]
        );
    }

    #[test]
    fn a_missing_or_nan_figure_is_an_error_never_a_pass() {
        let run = json!({ "cpu_per_batch_mesh4_vs_relay_floor4": 1.0 });
        assert!(judge(&run, &committed()).is_err());
        let nan = json!({
            "cpu_per_batch_mesh4_vs_relay_floor4": null,
            "throughput_mesh4_vs_relay_floor4": 0.9,
        });
        assert!(judge(&nan, &committed()).is_err());
    }

    #[test]
    fn the_committed_file_has_both_figures() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("last-full-run.json");
        let text = std::fs::read_to_string(&path).unwrap();
        let committed: Value = serde_json::from_str(&text).unwrap();
        // The committed figures judge themselves as passing.
        assert_eq!(judge(&committed, &committed).unwrap(), []);
    }
}
