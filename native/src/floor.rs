//! The adaptive policy's floor: its exact LRU shadow, compiled (`inference_node.kv.floor.ExactLru`,
//! the reference). It replays every block of every lookup, so it is the floor's whole cost;
//! `tests/inference_node/kv/test_floor.py` runs both on the same lookups and compares every answer.

use crate::adaptive::{key, keys_of, Ordered};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes};

/// Plain LRU of `capacity` blocks on every key, in the core's order: a prompt's prefix hits
/// counted front to back, its blocks then touched last to first (the pool releases a request's
/// blocks in reverse, so that its first block is the newest).
#[pyclass(module = "kvflow_native")]
pub struct ExactLru {
    #[pyo3(get)]
    capacity: usize,
    keys: Ordered,
}

#[pymethods]
impl ExactLru {
    #[new]
    fn new(capacity: usize) -> Self {
        ExactLru { capacity: capacity.max(1), keys: Ordered::new() }
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    fn __contains__(&self, digest: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.keys.get(&key(digest)?).is_some())
    }

    /// One lookup: its prefix hits; then the prompt's blocks are the newest. `room`: hold at
    /// most so many blocks after it (the cache less the slots other requests hold with no cached
    /// block in them; at most the capacity).
    #[pyo3(signature = (digests, room = None))]
    fn replay(&mut self, digests: &Bound<'_, PyAny>, room: Option<i64>) -> PyResult<usize> {
        let ks = keys_of(digests)?;
        let cached = &mut self.keys;
        let hits = ks.iter().take_while(|k| cached.get(k).is_some()).count();
        for k in ks.iter().rev() {
            match cached.get(k) {
                Some(i) => cached.move_to_end(i),
                None => cached.push_new(*k, 0.0),
            }
        }
        let keep = match room {
            Some(r) => (r.max(1) as usize).min(self.capacity),
            None => self.capacity,
        };
        while cached.len() > keep {
            cached.pop_front();
        }
        Ok(hits)
    }

    /// A block stored without a lookup (a generated one): the newest, as LRU would hold it.
    fn touch(&mut self, digest: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = key(digest)?;
        match self.keys.get(&k) {
            Some(i) => self.keys.move_to_end(i),
            None => self.keys.push_new(k, 0.0),
        }
        while self.keys.len() > self.capacity {
            self.keys.pop_front();
        }
        Ok(())
    }

    /// How many of the shadow's keys `cached` (anything `in` works on: the pool's blocks by
    /// digest) does not hold.
    fn missing_from(&self, py: Python<'_>, cached: &Bound<'_, PyAny>) -> PyResult<usize> {
        let mut n = 0;
        for k in self.keys.keys() {
            if !cached.contains(PyBytes::new(py, k.as_bytes()))? {
                n += 1;
            }
        }
        Ok(n)
    }
}
