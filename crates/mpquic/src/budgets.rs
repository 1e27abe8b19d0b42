//! The client's data budgets on disk (`data_budget`): `STATE_DIR/TUN_NAME.budget`, one line per
//! metered path (`PATH mpquic-budget 1 SINCE USED`, core `budget::Usage`), read at start and
//! written every `SAVE_EVERY` while the count changes, and at shutdown. A count lost in a crash
//! is at most that much traffic; an unreadable line is reported and that path starts afresh.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use mpquic_core::path::budget::Usage;
use tracing::warn;

use crate::tunnel::Tunnel;

/// How often a changed count is written.
pub const SAVE_EVERY: Duration = Duration::from_secs(10);

/// One instance's budget file.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The file of the instance whose TUN device is `tun_name` (one per device on a host).
    pub fn new(dir: &Path, tun_name: &str) -> StateFile {
        StateFile {
            path: dir.join(format!("{tun_name}.budget")),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the file says each path has used (none without a file).
    pub fn load(&self) -> HashMap<String, Usage> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
            Err(e) => {
                warn!(file = %self.path.display(), error = %e, "data budget file unreadable: every metered path counts from zero");
                return HashMap::new();
            }
        };
        let mut out = HashMap::new();
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            match line
                .split_once(' ')
                .and_then(|(name, rest)| Some((name, Usage::parse(rest)?)))
            {
                Some((name, usage)) => {
                    out.insert(name.to_string(), usage);
                }
                None => {
                    warn!(file = %self.path.display(), line = n + 1, "data budget file: line not understood; that path counts from zero")
                }
            }
        }
        out
    }

    /// Write `usage` whole (a new file renamed over the old: a crash leaves one or the other).
    pub fn save(&self, usage: &[(String, Usage)]) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = self.path.with_extension("budget.new");
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        for (name, u) in usage {
            writeln!(f, "{name} {}", u.to_line())?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), self.path.display()))?;
        Ok(())
    }

    /// Keep the file up to date with `tunnel`'s counts for the instance's life (the caller
    /// saves once more at shutdown). A failed write is logged once until one succeeds.
    pub async fn keep(self, tunnel: Arc<Tunnel>) {
        let mut last = Vec::new();
        let mut failing = false;
        let mut every = tokio::time::interval(SAVE_EVERY);
        loop {
            every.tick().await;
            let now = tunnel.budget_usage();
            if now == last {
                continue;
            }
            match self.save(&now) {
                Ok(()) => {
                    failing = false;
                    last = now;
                }
                Err(e) if !failing => {
                    failing = true;
                    warn!(error = %format!("{e:#}"), "data budget file not written: the counts since the last write are lost on a restart");
                }
                Err(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_round_trips_and_a_bad_line_is_skipped() {
        let dir = std::env::temp_dir().join(format!("mpquic-budget-test-{}", std::process::id()));
        let f = StateFile::new(&dir, "mpq9");
        assert!(f.load().is_empty(), "no file: nothing used");
        let usage = vec![
            (
                "lte".to_string(),
                Usage {
                    since: 100,
                    used: 5,
                },
            ),
            (
                "sat".to_string(),
                Usage {
                    since: 200,
                    used: 7,
                },
            ),
        ];
        f.save(&usage).unwrap();
        let back = f.load();
        assert_eq!(back.get("lte"), Some(&usage[0].1));
        assert_eq!(back.get("sat"), Some(&usage[1].1));
        std::fs::write(f.path(), "lte mpquic-budget 1 100 5\ngarbage\n").unwrap();
        assert_eq!(f.load().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
