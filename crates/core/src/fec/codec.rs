//! Reed-Solomon codecs by group shape. Building one inverts a matrix, so each (k, m) is built
//! once and kept; the shapes in use are few (a fixed k/m, or `auto`'s k with a handful of m, plus
//! partial groups), and the cache is cleared if a peer's odd shapes ever fill it.

use std::collections::HashMap;

use reed_solomon_erasure::galois_8::ReedSolomon;

const MAX_SHAPES: usize = 64;

#[derive(Default)]
pub(super) struct Codecs(HashMap<(u8, u8), ReedSolomon>);

impl std::fmt::Debug for Codecs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Codecs({} shapes)", self.0.len())
    }
}

impl Clone for Codecs {
    /// A copy starts with an empty cache (the codecs are rebuilt on use).
    fn clone(&self) -> Self {
        Codecs::default()
    }
}

impl Codecs {
    /// The codec for `k` data and `m` repair shards (both >= 1, k + m <= 256: the wire bounds).
    pub(super) fn get(&mut self, k: u8, m: u8) -> Option<&ReedSolomon> {
        if self.0.len() >= MAX_SHAPES && !self.0.contains_key(&(k, m)) {
            self.0.clear();
        }
        match self.0.entry((k, m)) {
            std::collections::hash_map::Entry::Occupied(e) => Some(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let rs = ReedSolomon::new(usize::from(k), usize::from(m)).ok()?;
                Some(e.insert(rs))
            }
        }
    }
}
