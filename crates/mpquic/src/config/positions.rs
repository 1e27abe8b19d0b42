//! Where each key of a YAML file is, from the YAML parser's own marks: `multipath_paths[1].weight`
//! -> line 14, column 3. Validation reports problems at these positions, so a nested key is found
//! by its place in the structure, not by searching the text for its name.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// Line and column (both 1-based) of every mapping key and sequence item, by path.
#[derive(Debug, Default)]
pub struct Positions(HashMap<String, (usize, usize)>);

enum Frame {
    Map {
        path: String,
        /// The key whose value comes next; `None` while a key is expected.
        key: Option<String>,
        /// A mapping that is a sequence item is placed at its first key (the parser's mark for
        /// the mapping itself is past it).
        item_unplaced: bool,
    },
    Seq {
        path: String,
        next: usize,
    },
}

#[derive(Default)]
struct Recorder {
    stack: Vec<Frame>,
    found: HashMap<String, (usize, usize)>,
}

impl Recorder {
    /// The path of the value that starts now, and the container moves past it.
    fn next_value(&mut self) -> String {
        match self.stack.last_mut() {
            None => String::new(),
            Some(Frame::Map { path, key, .. }) => {
                let k = key.take().unwrap_or_default();
                if path.is_empty() {
                    k
                } else {
                    format!("{path}.{k}")
                }
            }
            Some(Frame::Seq { path, next }) => {
                *next += 1;
                format!("{path}[{}]", *next - 1)
            }
        }
    }

    fn record(&mut self, path: String, mark: Marker) {
        self.found
            .entry(path)
            .or_insert((mark.line(), mark.col() + 1));
    }
}

impl MarkedEventReceiver for Recorder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        match ev {
            Event::Scalar(text, ..) => {
                if let Some(Frame::Map {
                    path,
                    key: key @ None,
                    item_unplaced,
                }) = self.stack.last_mut()
                {
                    let full = if path.is_empty() {
                        text.clone()
                    } else {
                        format!("{path}.{text}")
                    };
                    let item = std::mem::take(item_unplaced).then(|| path.clone());
                    *key = Some(text);
                    self.record(full, mark);
                    if let Some(item) = item {
                        self.record(item, mark);
                    }
                } else {
                    let in_seq = matches!(self.stack.last(), Some(Frame::Seq { .. }));
                    let path = self.next_value();
                    if in_seq {
                        self.record(path, mark);
                    }
                }
            }
            Event::MappingStart(..) => {
                let item_unplaced = matches!(self.stack.last(), Some(Frame::Seq { .. }));
                let path = self.next_value();
                self.stack.push(Frame::Map {
                    path,
                    key: None,
                    item_unplaced,
                });
            }
            Event::SequenceStart(..) => {
                let in_seq = matches!(self.stack.last(), Some(Frame::Seq { .. }));
                let path = self.next_value();
                if in_seq {
                    self.record(path.clone(), mark);
                }
                self.stack.push(Frame::Seq { path, next: 0 });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::Alias(_) => {
                self.next_value();
            }
            _ => {}
        }
    }
}

impl Positions {
    /// Positions of `text`; empty if it is not YAML (serde's own error is reported then).
    pub fn of(text: &str) -> Positions {
        let mut r = Recorder::default();
        let _ = Parser::new_from_str(text).load(&mut r, false);
        Positions(r.found)
    }

    /// Where `path` is; else where its nearest enclosing key or item is; else line 1.
    pub fn find(&self, path: &str) -> (usize, usize) {
        let mut p = path;
        loop {
            if let Some(at) = self.0.get(p) {
                return *at;
            }
            match p.rfind(['.', '[']) {
                Some(i) => p = &p[..i],
                None => return (1, 1),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Positions;

    #[test]
    fn nested_keys_and_items_are_found_by_path() {
        let text = "role: client\nmultipath_paths:\n  - name: wan1\n    weight: 2\n  - name: wan2\n    bind_ip: if:eth2\n    weight: 0\nclients: []\nlist:\n- a\n- b\n";
        let p = Positions::of(text);
        assert_eq!(p.find("role"), (1, 1));
        assert_eq!(p.find("multipath_paths"), (2, 1));
        assert_eq!(p.find("multipath_paths[0]"), (3, 5));
        assert_eq!(p.find("multipath_paths[0].weight"), (4, 5));
        assert_eq!(p.find("multipath_paths[1].weight"), (7, 5));
        assert_eq!(p.find("multipath_paths[1].bind_ip"), (6, 5));
        assert_eq!(p.find("list[1]"), (11, 3));
        // Missing keys fall back to their enclosing item, then to line 1.
        assert_eq!(p.find("multipath_paths[1].remote_addr"), (5, 5));
        assert_eq!(p.find("nothing"), (1, 1));
        assert_eq!(Positions::of(": : bad").find("role"), (1, 1));
    }
}
