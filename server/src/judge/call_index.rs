//! A call of the batch found by its id (R8: a verdict names its call by
//! id; R20: ids are unique within a batch and never change, not even by a
//! rewrite). The batch's positions sorted by id, looked up by binary search
//! against the calls themselves: no id copied, nothing hashed.

/// The positions of a batch's calls, sorted by call id.
#[derive(Debug)]
pub(crate) struct CallIndex {
    sorted: Vec<usize>,
}

impl CallIndex {
    /// Indexes calls `0..n`, whose ids `id` gives.
    pub(crate) fn new<'c>(n: usize, id: impl Fn(usize) -> &'c str) -> Self {
        let mut sorted: Vec<usize> = (0..n).collect();
        sorted.sort_unstable_by(|&a, &b| id(a).cmp(id(b)));
        Self { sorted }
    }

    /// The position of the call with id `call_id`; `id` must give the
    /// same ids as when the index was built.
    pub(crate) fn get<'c>(&self, call_id: &str, id: impl Fn(usize) -> &'c str) -> Option<usize> {
        self.sorted
            .binary_search_by(|&i| id(i).cmp(call_id))
            .ok()
            .map(|at| self.sorted[at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// R8: every id of the batch is found at its own position, in any
    /// order; an id not in the batch (or a prefix of one) is not found.
    #[test]
    fn r8_calls_are_found_by_id_and_only_by_their_id() {
        let ids = ["c10", "b", "c1", "a", "", "c2", "z"];
        let index = CallIndex::new(ids.len(), |i| ids[i]);
        for (position, id) in ids.iter().enumerate() {
            assert_eq!(index.get(id, |i| ids[i]), Some(position), "{id:?}");
        }
        for absent in ["c", "c3", "c100", "A", " a", "zz"] {
            assert_eq!(index.get(absent, |i| ids[i]), None, "{absent:?}");
        }
        let none = CallIndex::new(0, |_| "");
        assert_eq!(none.get("a", |_| ""), None);
    }
}
