//! The log directory's budget (`[decision_log] max_dir_bytes`, R29).
//!
//! The budget is the most bytes the log's files (`decisions-*.jsonl`) may
//! hold together. Before a record is appended, its size as a line is
//! estimated (its entry serialized, plus a margin for the envelope, masking
//! and scrubbing), and the record is appended only if the files stay within
//! the budget:
//!
//! * a refusal record (a peer refused before it was judged) only while the
//!   files stay within nine tenths of the budget: past that, refusals are
//!   left out and counted in summary records, so that refused peers can
//!   never be the ones that use up the budget;
//! * any other record (a decision, a chain change, a summary) up to the
//!   budget. Past it the append fails with [`BudgetReached`], and the
//!   log's failure policy applies: `refuse` answers the batch
//!   `UNAVAILABLE` naming the budget, `answer` answers it and counts the
//!   loss.
//!
//! Nothing is deleted: the operator frees room by archiving old files (or
//! raises the budget). The files are measured again on disk every few
//! seconds, so archived files free their room while the mesh runs.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::segment;

/// What a record may add to its entry's serialized size once written: the
/// envelope (`v`, `seq`, `id`, `time`, `mesh`, `prev`, `masked`, `hash`),
/// and masking and scrubbing, which may lengthen a short value.
pub const RECORD_MARGIN: u64 = 512;

/// How often the files are measured again on disk.
const MEASURE_EVERY: Duration = Duration::from_secs(2);

/// A record refused by the budget.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "the decision log directory {dir} holds {used} bytes and this record (about {record} bytes) \
     would take it past its budget of {max} bytes (max_dir_bytes); archive old log files or raise the budget"
)]
pub struct BudgetReached {
    pub dir: PathBuf,
    pub used: u64,
    pub record: u64,
    pub max: u64,
}

/// The budget of one log directory.
#[derive(Debug)]
pub struct DirBudget {
    dir: PathBuf,
    max: u64,
    /// Bytes the files hold: measured, plus the estimates of the records
    /// appended since.
    used: AtomicU64,
    measured: Mutex<Instant>,
}

impl DirBudget {
    pub fn new(dir: &Path, max: u64) -> Self {
        DirBudget {
            dir: dir.to_path_buf(),
            max,
            used: AtomicU64::new(measure(dir)),
            measured: Mutex::new(Instant::now()),
        }
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Whether a record of about `record` bytes may be appended; a refusal
    /// record only within nine tenths of the budget.
    pub fn admit(&self, record: u64, refusal: bool) -> Result<(), BudgetReached> {
        self.measure_if_due();
        let used = self.used.load(Ordering::Relaxed);
        let limit = if refusal { self.max / 10 * 9 } else { self.max };
        if used.saturating_add(record) > limit {
            return Err(BudgetReached {
                dir: self.dir.clone(),
                used,
                record,
                max: self.max,
            });
        }
        Ok(())
    }

    /// A record of about `record` bytes was appended.
    pub fn wrote(&self, record: u64) {
        self.used.fetch_add(record, Ordering::Relaxed);
    }

    /// Measures the files again if the last measure is old.
    pub fn measure_if_due(&self) {
        let Ok(mut measured) = self.measured.try_lock() else {
            return;
        };
        if measured.elapsed() < MEASURE_EVERY {
            return;
        }
        *measured = Instant::now();
        self.used.store(measure(&self.dir), Ordering::Relaxed);
    }
}

/// The bytes the log's files hold (0 when they cannot be listed: the
/// writer reports that).
fn measure(dir: &Path) -> u64 {
    segment::list(dir)
        .map(|files| {
            files
                .iter()
                .filter_map(|(_, file)| std::fs::metadata(file).ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r29_refusals_stop_at_nine_tenths_and_other_records_at_the_budget() {
        let dir = std::env::temp_dir().join(format!("guardmesh-budget-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let budget = DirBudget::new(&dir, 1000);
        budget.admit(800, true).unwrap();
        budget.wrote(800);
        assert!(budget.admit(200, true).is_err());
        budget.admit(200, false).unwrap();
        budget.wrote(200);
        let err = budget.admit(1, false).unwrap_err();
        assert!(err.to_string().contains("max_dir_bytes"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
