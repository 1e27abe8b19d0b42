//! Where the configuration's problems are collected: each located by its key's path in the
//! YAML structure (`positions.rs`), so all of them are reported at once, each at its own line;
//! and its warnings. Shared by every section's validation (`validate.rs`, `classes.rs`,
//! `lane.rs`, `masque.rs`, `metering.rs`).

use super::positions::Positions;
use super::{closest, Problem};

/// Collects located problems (errors) and warnings.
pub(super) struct Checker {
    positions: Positions,
    pub(super) problems: Vec<Problem>,
    pub(super) warnings: Vec<String>,
}

impl Checker {
    pub(super) fn new(text: &str) -> Checker {
        Checker {
            positions: Positions::of(text),
            problems: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// A warning: said at start and by `mpquic check`, the file is taken.
    pub(super) fn warn(&mut self, message: String) {
        self.warnings.push(message);
    }

    /// A problem at the key `path` (e.g. `multipath_paths[1].weight`), or at the nearest
    /// enclosing key when the key itself is missing.
    pub(super) fn at(&mut self, path: &str, message: String, hint: Option<String>) {
        let (line, column) = self.positions.find(path);
        self.problems.push(Problem {
            line,
            column,
            message,
            hint,
        });
    }

    /// A value from a fixed list, with "did you mean" when it is close to one.
    pub(super) fn unknown_value(&mut self, path: &str, what: &str, bad: &str, valid: &[&str]) {
        let hint = closest(bad, valid)
            .map(|b| format!("did you mean `{b}`?"))
            .unwrap_or_else(|| format!("valid values: {}", valid.join(", ")));
        let key = path.rsplit('.').next().unwrap_or(path);
        self.at(path, format!("`{key}`: unknown {what} `{bad}`"), Some(hint));
    }
}
