//! The adaptive eviction policy's per-block bookkeeping, compiled (`inference_node.kv.adaptive`).
//!
//! Three tables keyed by block digests, each the exact counterpart of a Python class in
//! `inference_node/kv/shadows.py` (the reference, used when this extension is not installed):
//!
//! * `GhostFifo`: the evicted blocks the policy remembers (digest -> value), oldest first;
//! * `LruShadow`: the guard's LRU shadow on sampled digests;
//! * `BandsShadow`: the guard's shadow of the bands (a probationary and a protected LRU list, and
//!   a FIFO of evicted keys).
//!
//! They decide exactly what the Python classes decide, call for call (an `OrderedDict` keeps an
//! existing key's place when it is assigned again, and so do these);
//! `tests/inference_node/kv/test_native_tables.py` runs both on the same random calls and whole
//! trace replays and compares every answer. What they save is the Python work per evicted block
//! and per sampled digest: an `OrderedDict` node allocated and freed per key, a dictionary of
//! bytes objects, a loop in the interpreter.
//!
//! A key is a digest of at most 32 bytes (the core's are 32: BLAKE2b), held by value with its
//! length; its hash is taken from its first 8 bytes (a digest's bytes are uniform already).

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};

const KEY_BYTES: usize = 32;
const NIL: u32 = u32::MAX;
/// A ghost's class in the low 7 bits of its value (`inference_node.kv.shadows.CLASS_MASK`).
const CLASS_MASK: i64 = 127;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Key {
    bytes: [u8; KEY_BYTES],
    len: u8,
}

impl Key {
    /// The digest's bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        let mut w = [0u8; 8];
        w.copy_from_slice(&self.bytes[..8]);
        h.write_u64(u64::from_le_bytes(w) ^ ((self.len as u64) << 56));
    }
}

/// The hash of a `Key`: its first 8 bytes, mixed (so that keys made by hand, not digests, spread
/// too).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Map<V> = HashMap<Key, V, BuildHasherDefault<KeyHasher>>;

#[inline]
fn key_of(bytes: &[u8]) -> PyResult<Key> {
    if bytes.len() > KEY_BYTES {
        return Err(PyValueError::new_err(format!("a digest of {} bytes (at most {KEY_BYTES})", bytes.len())));
    }
    let mut k = Key { bytes: [0; KEY_BYTES], len: bytes.len() as u8 };
    k.bytes[..bytes.len()].copy_from_slice(bytes);
    Ok(k)
}

#[inline]
pub(crate) fn key(obj: &Bound<'_, PyAny>) -> PyResult<Key> {
    key_of(obj.cast::<PyBytes>()?.as_bytes())
}

/// Calls `f(i, item)` for each item of a tuple, a list or another iterable.
fn each<'py>(seq: &Bound<'py, PyAny>, mut f: impl FnMut(usize, &Bound<'py, PyAny>) -> PyResult<()>) -> PyResult<()> {
    if let Ok(t) = seq.cast::<PyTuple>() {
        for (i, x) in t.iter().enumerate() {
            f(i, &x)?;
        }
    } else if let Ok(l) = seq.cast::<PyList>() {
        for (i, x) in l.iter().enumerate() {
            f(i, &x)?;
        }
    } else {
        for (i, x) in seq.try_iter()?.enumerate() {
            f(i, &x?)?;
        }
    }
    Ok(())
}

/// The keys of a sequence of digests.
pub(crate) fn keys_of(seq: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    let mut ks = Vec::new();
    each(seq, |_, d| {
        ks.push(key(d)?);
        Ok(())
    })?;
    Ok(ks)
}

/// The sampled keys of a lookup's digests (first byte below `below`), and how many of them are
/// among the first `matched` digests (the cache's own prefix hits on them).
fn sample(digests: &Bound<'_, PyAny>, matched: usize, below: u32) -> PyResult<(Vec<Key>, usize)> {
    let mut keys = Vec::new();
    let mut own = 0;
    each(digests, |i, d| {
        let b = d.cast::<PyBytes>()?.as_bytes();
        if !b.is_empty() && (b[0] as u32) < below {
            keys.push(key_of(b)?);
            if i < matched {
                own += 1;
            }
        }
        Ok(())
    })?;
    Ok((keys, own))
}

// ------------------------------------------------------------------------------ an ordered map

struct Node {
    key: Key,
    value: f64,
    prev: u32,
    next: u32,
}

/// Keys in order (oldest first) with a value each: an `OrderedDict` with what the shadows use of
/// it. Nodes live in one vector, linked by index, reused when freed.
pub(crate) struct Ordered {
    map: Map<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Ordered {
    pub(crate) fn new() -> Self {
        Ordered { map: Map::default(), nodes: Vec::new(), free: Vec::new(), head: NIL, tail: NIL }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub(crate) fn get(&self, k: &Key) -> Option<u32> {
        self.map.get(k).copied()
    }

    #[inline]
    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let n = &self.nodes[i as usize];
            (n.prev, n.next)
        };
        if prev == NIL { self.head = next } else { self.nodes[prev as usize].next = next }
        if next == NIL { self.tail = prev } else { self.nodes[next as usize].prev = prev }
    }

    #[inline]
    fn link_back(&mut self, i: u32) {
        let tail = self.tail;
        {
            let n = &mut self.nodes[i as usize];
            n.prev = tail;
            n.next = NIL;
        }
        if tail == NIL { self.head = i } else { self.nodes[tail as usize].next = i }
        self.tail = i;
    }

    /// `d[k] = value` for a key not in the map: it goes to the end.
    #[inline]
    pub(crate) fn push_new(&mut self, k: Key, value: f64) {
        let node = Node { key: k, value, prev: NIL, next: NIL };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.link_back(i);
        self.map.insert(k, i);
    }

    /// `d[k] = value`: an existing key keeps its place.
    #[inline]
    fn set(&mut self, k: Key, value: f64) {
        match self.get(&k) {
            Some(i) => self.nodes[i as usize].value = value,
            None => self.push_new(k, value),
        }
    }

    #[inline]
    pub(crate) fn move_to_end(&mut self, i: u32) {
        if self.tail != i {
            self.unlink(i);
            self.link_back(i);
        }
    }

    #[inline]
    fn remove_at(&mut self, i: u32) -> Key {
        self.unlink(i);
        self.free.push(i);
        let k = self.nodes[i as usize].key;
        self.map.remove(&k);
        k
    }

    /// `d.popitem(last=False)`.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<(Key, f64)> {
        if self.head == NIL {
            return None;
        }
        let i = self.head;
        let v = self.nodes[i as usize].value;
        Some((self.remove_at(i), v))
    }

    fn front_value(&self) -> Option<f64> {
        if self.head == NIL { None } else { Some(self.nodes[self.head as usize].value) }
    }

    /// The keys, oldest first.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &Key> + '_ {
        let mut i = self.head;
        std::iter::from_fn(move || {
            if i == NIL {
                return None;
            }
            let n = &self.nodes[i as usize];
            i = n.next;
            Some(&n.key)
        })
    }
}

// ------------------------------------------------------------------------------ a FIFO

/// Keys oldest first with an integer value each, for FIFOs that only append new keys at the end,
/// pop the oldest and delete a key anywhere: the order is a queue of (key, stamp) whose entries
/// for deleted keys are skipped (and dropped when they outnumber the live ones).
struct Fifo {
    map: Map<(i64, u64)>,
    order: VecDeque<(Key, u64)>,
    stamp: u64,
}

impl Fifo {
    fn new() -> Self {
        Fifo { map: Map::default(), order: VecDeque::new(), stamp: 0 }
    }

    #[inline]
    fn len(&self) -> usize {
        self.map.len()
    }

    /// `d[k] = value`: an existing key keeps its place.
    #[inline]
    fn set(&mut self, k: Key, value: i64) {
        if let Some(e) = self.map.get_mut(&k) {
            e.0 = value;
            return;
        }
        self.stamp += 1;
        self.map.insert(k, (value, self.stamp));
        self.order.push_back((k, self.stamp));
    }

    /// `d.pop(k, None)`.
    #[inline]
    fn take(&mut self, k: &Key) -> Option<i64> {
        let v = self.map.remove(k).map(|e| e.0);
        if v.is_some() && self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(k, s)| map.get(k).is_some_and(|e| e.1 == *s));
        }
        v
    }

    /// `d.popitem(last=False)`.
    #[inline]
    fn pop_front(&mut self) -> Option<(Key, i64)> {
        while let Some((k, s)) = self.order.pop_front() {
            if let Some(&(v, stamp)) = self.map.get(&k) {
                if stamp == s {
                    self.map.remove(&k);
                    return Some((k, v));
                }
            }
        }
        None
    }
}

// ------------------------------------------------------------------------------ the tables

/// The adaptive policy's ghosts: evicted blocks' digests -> value (their class, with `soon` also
/// their last use: `last_used << 7 | class`), oldest first, at most `capacity`.
#[pyclass(module = "kvflow_native")]
pub struct GhostFifo {
    #[pyo3(get)]
    capacity: usize,
    fifo: Fifo,
}

#[pymethods]
impl GhostFifo {
    #[new]
    fn new(capacity: usize) -> Self {
        GhostFifo { capacity, fifo: Fifo::new() }
    }

    fn __len__(&self) -> usize {
        self.fifo.len()
    }

    /// Remember the evicted `blocks` (core `Block`s, digests still set) with an adaptive class
    /// (>= 0), then forget the oldest beyond the capacity: their classes, as (class, count)
    /// pairs by class (empty if none was forgotten).
    fn add(&mut self, blocks: &Bound<'_, PyAny>, soon: bool) -> PyResult<Vec<(i64, u64)>> {
        let py = blocks.py();
        let (cls_name, digest_name, last_name) =
            (intern!(py, "adaptive_class"), intern!(py, "digest"), intern!(py, "last_used"));
        each(blocks, |_, b| {
            let cls: i64 = b.getattr(cls_name)?.extract()?;
            if cls >= 0 {
                let value = if soon { b.getattr(last_name)?.extract::<i64>()? << 7 | cls } else { cls };
                self.fifo.set(key(&b.getattr(digest_name)?)?, value);
            }
            Ok(())
        })?;
        let mut left: Vec<(i64, u64)> = Vec::new();
        if self.fifo.len() > self.capacity {
            let mut counts = [0u64; (CLASS_MASK + 1) as usize];
            while self.fifo.len() > self.capacity {
                match self.fifo.pop_front() {
                    Some((_, v)) => counts[(v & CLASS_MASK) as usize] += 1,
                    None => break,
                }
            }
            left.extend(counts.iter().enumerate().filter(|(_, &n)| n > 0).map(|(c, &n)| (c as i64, n)));
        }
        Ok(left)
    }

    /// Forget the ghosts among `digests[start:]`: (index, value) of each one that was there.
    fn take(&mut self, digests: &Bound<'_, PyAny>, start: usize) -> PyResult<Vec<(usize, i64)>> {
        let mut out = Vec::new();
        if self.fifo.len() == 0 {
            return Ok(out);
        }
        each(digests, |i, d| {
            if i >= start {
                if let Some(v) = self.fifo.take(&key(d)?) {
                    out.push((i, v));
                }
            }
            Ok(())
        })?;
        Ok(out)
    }
}

/// Plain LRU on sampled keys, for the guard. `timed`: it keeps each key's last use, for
/// `horizon` (how long ago its oldest key was used, after the last trim).
#[pyclass(module = "kvflow_native")]
pub struct LruShadow {
    #[pyo3(get)]
    capacity: usize,
    #[pyo3(get)]
    timed: bool,
    #[pyo3(get, set)]
    now: f64,
    #[pyo3(get)]
    horizon: f64,
    keys: Ordered,
}

impl LruShadow {
    fn replay_keys(&mut self, keys: &[Key]) -> usize {
        let now = if self.timed { self.now } else { 0.0 };
        let cached = &mut self.keys;
        let mut hits = 0;
        let mut hit = true;
        for k in keys {
            if hit {
                if let Some(i) = cached.get(k) {
                    hits += 1;
                    cached.move_to_end(i);
                    if now != 0.0 {
                        cached.nodes[i as usize].value = now;
                    }
                    continue;
                }
            }
            hit = false;
            cached.set(*k, now);
        }
        if cached.len() > self.capacity {
            while cached.len() > self.capacity {
                cached.pop_front();
            }
            if self.timed {
                self.horizon = self.now - cached.front_value().unwrap_or(self.now);
            }
        }
        hits
    }
}

#[pymethods]
impl LruShadow {
    #[new]
    #[pyo3(signature = (capacity, timed = true))]
    fn new(capacity: usize, timed: bool) -> Self {
        LruShadow { capacity, timed, now: 0.0, horizon: 0.0, keys: Ordered::new() }
    }

    fn __len__(&self) -> usize {
        self.keys.len()
    }

    /// One lookup of `keys` (a prompt's sampled digests, in order): its prefix hits.
    fn replay(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.replay_keys(&keys_of(keys)?))
    }

    /// One lookup of a prompt's `digests`, of which the cache had the first `matched`: the
    /// sampled ones (first byte below `below`) are replayed. Returns (sampled, the cache's own
    /// prefix hits among them, the shadow's).
    fn lookup(&mut self, digests: &Bound<'_, PyAny>, matched: usize, below: u32) -> PyResult<(usize, usize, usize)> {
        let (keys, own) = sample(digests, matched, below)?;
        Ok((keys.len(), own, self.replay_keys(&keys)))
    }
}

/// The bands on sampled keys, for the guard: a probationary LRU list (seen once) evicted before
/// a protected one (seen twice, or returning while a ghost), and a FIFO of evicted keys.
#[pyclass(module = "kvflow_native")]
pub struct BandsShadow {
    #[pyo3(get)]
    capacity: usize,
    #[pyo3(get)]
    ghost_capacity: usize,
    new: Ordered,
    old: Ordered,
    ghosts: Fifo,
}

impl BandsShadow {
    fn replay_keys(&mut self, keys: &[Key]) -> usize {
        let mut hits = 0;
        let mut hit = true;
        for k in keys {
            if let Some(i) = self.old.get(k) {
                hits += hit as usize;
                self.old.move_to_end(i);
            } else if let Some(i) = self.new.get(k) {
                hits += hit as usize;
                self.new.remove_at(i);
                self.old.push_new(*k, 0.0);
            } else {
                hit = false;
                if self.ghosts.take(k).is_some() {
                    self.old.push_new(*k, 0.0);
                } else {
                    self.new.push_new(*k, 0.0);
                }
            }
        }
        let mut excess = (self.new.len() + self.old.len()) as isize - self.capacity as isize;
        while excess > 0 {
            let victim = if self.new.len() > 0 { self.new.pop_front() } else { self.old.pop_front() };
            if let Some((k, _)) = victim {
                self.ghosts.set(k, 0);
            }
            excess -= 1;
        }
        while self.ghosts.len() > self.ghost_capacity {
            self.ghosts.pop_front();
        }
        hits
    }
}

#[pymethods]
impl BandsShadow {
    #[new]
    fn new(capacity: usize, ghost_capacity: usize) -> Self {
        BandsShadow { capacity, ghost_capacity, new: Ordered::new(), old: Ordered::new(), ghosts: Fifo::new() }
    }

    /// Keys held in both lists.
    fn __len__(&self) -> usize {
        self.new.len() + self.old.len()
    }

    #[getter]
    fn num_ghosts(&self) -> usize {
        self.ghosts.len()
    }

    /// One lookup of `keys` (a prompt's sampled digests, in order): its prefix hits.
    fn replay(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.replay_keys(&keys_of(keys)?))
    }

    /// As `LruShadow.lookup`.
    fn lookup(&mut self, digests: &Bound<'_, PyAny>, matched: usize, below: u32) -> PyResult<(usize, usize, usize)> {
        let (keys, own) = sample(digests, matched, below)?;
        Ok((keys.len(), own, self.replay_keys(&keys)))
    }
}
