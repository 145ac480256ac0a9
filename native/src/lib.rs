//! kvflow's compiled hot paths (`kvflow_native`): the materializer's planner (here), the
//! adaptive eviction policy's tables (`adaptive.rs`: its ghosts and shadows; `lifetables.rs`: its
//! life tables; `floor.rs`: its floor's exact LRU shadow) and the node's CPU kernels (`gemm.rs`, `attention.rs`, `decode.rs`, `elem.rs`:
//! `inference_node/model/native.py`).
//!
//! `BlockStore` holds the `node_blocks` rows of the nodes one materializer worker owns, and plans
//! the common take of event batches: events of known nodes, in sequence, that store, remove or
//! update blocks and agree with the stored state. It writes the take's `block_events` rows and
//! the net change of `node_blocks` straight into PostgreSQL's binary `COPY` format, so no Python
//! object is made per block event.
//!
//! Anything else (a created or snapshot event, a block stored twice, a removed or updated block
//! that is not there, a window size beyond `integer`, a node it has not loaded) makes `add`
//! answer `False`: the caller aborts and plans the take with the reference planner in Python
//! (`state_store/apply.py`), which decides every rule. The per-node checks (instance, event ids,
//! status) are made by the caller before `add`. `tests/state_store/test_native.py` checks that
//! both planners write the same rows.

use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyType};
use std::collections::HashMap;

mod adaptive;
mod attention;
mod decode;
mod elem;
mod floor;
mod gemm;
mod lifetables;

/// A `node_blocks` row without its key; times in PostgreSQL's microseconds since 2000-01-01.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Block {
    parent: Option<i64>,
    level: i16,
    prio: i16,
    ntok: i32,
    lora: Option<i64>,
    window: Option<i64>,
    stored_at: i64,
    updated_at: i64,
}

type Row = (Option<i64>, i16, i16, i32, Option<i64>, Option<i64>, i64, i64);
/// A row of `BlockStore::load`: the block hash, then a `Row`'s fields.
type LoadRow = (i64, Option<i64>, i16, i16, i32, Option<i64>, Option<i64>, i64, i64);

impl Block {
    fn from_row(r: Row) -> Self {
        Block { parent: r.0, level: r.1, prio: r.2, ntok: r.3, lora: r.4, window: r.5, stored_at: r.6, updated_at: r.7 }
    }
    fn row(&self) -> Row {
        (self.parent, self.level, self.prio, self.ntok, self.lora, self.window, self.stored_at, self.updated_at)
    }
}

/// Binary COPY: signature, flags, header extension length.
const COPY_HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";
const COPY_TRAILER: &[u8] = &(-1i16).to_be_bytes();

struct Copy {
    buf: Vec<u8>,
    rows: usize,
}

impl Copy {
    fn new() -> Self {
        let mut buf = Vec::with_capacity(1 << 16);
        buf.extend_from_slice(COPY_HEADER);
        Copy { buf, rows: 0 }
    }
    #[inline]
    fn row(&mut self, fields: i16) {
        self.rows += 1;
        self.buf.extend_from_slice(&fields.to_be_bytes());
    }
    #[inline]
    fn null(&mut self) {
        self.buf.extend_from_slice(&(-1i32).to_be_bytes());
    }
    #[inline]
    fn text(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(&(v.len() as i32).to_be_bytes());
        self.buf.extend_from_slice(v);
    }
    #[inline]
    fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&8i32.to_be_bytes());
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    #[inline]
    fn i32(&mut self, v: i32) {
        self.buf.extend_from_slice(&4i32.to_be_bytes());
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    #[inline]
    fn i16(&mut self, v: i16) {
        self.buf.extend_from_slice(&2i32.to_be_bytes());
        self.buf.extend_from_slice(&v.to_be_bytes());
    }
    #[inline]
    fn opt_i64(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.i64(v),
            None => self.null(),
        }
    }
    #[inline]
    fn opt_i32(&mut self, v: Option<i32>) {
        match v {
            Some(v) => self.i32(v),
            None => self.null(),
        }
    }
    #[inline]
    fn opt_i16(&mut self, v: Option<i16>) {
        match v {
            Some(v) => self.i16(v),
            None => self.null(),
        }
    }
    fn finish(mut self) -> (Vec<u8>, usize) {
        self.buf.extend_from_slice(COPY_TRAILER);
        (self.buf, self.rows)
    }
}

/// One `block_events` row, in `state_store.apply.HISTORY_COLUMNS` order.
#[allow(clippy::too_many_arguments)]
#[inline]
fn history_row(
    c: &mut Copy, node: &[u8], instance: &[u8], eid: i64, seq: i32, kind: &[u8], h: i64, parent: Option<i64>,
    level_old: Option<i16>, level_new: Option<i16>, prio_old: Option<i16>, prio_new: Option<i16>, ntok: i32,
    lora: Option<i64>, stored_at: Option<i64>, event_ts: i64,
) {
    c.row(15);
    c.text(node);
    c.text(instance);
    c.i64(eid);
    c.i32(seq);
    c.text(kind);
    c.i64(h);
    c.opt_i64(parent);
    c.opt_i16(level_old);
    c.opt_i16(level_new);
    c.opt_i16(prio_old);
    c.opt_i16(prio_new);
    c.i32(ntok);
    c.opt_i64(lora);
    c.opt_i64(stored_at);
    c.i64(event_ts);
}

/// A wire hash (unsigned 64-bit) as SQL `bigint`: the same bits, signed.
#[inline]
fn sql_hash(v: &Bound<'_, PyAny>) -> PyResult<i64> {
    Ok(v.extract::<u64>()? as i64)
}

#[inline]
fn opt_u64(v: Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if v.is_none() { Ok(None) } else { Ok(Some(v.extract::<u64>()?)) }
}

#[inline]
fn opt_i64(v: Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if v.is_none() { Ok(None) } else { Ok(Some(v.extract::<i64>()?)) }
}

struct Planning {
    /// Per node: what this take changed (None: removed), over the store.
    overlay: HashMap<String, HashMap<i64, Option<Block>>>,
    history: Copy,
}

/// The blocks of the nodes a worker owns, and the compiled planner of plain takes.
#[pyclass(module = "kvflow_native")]
struct BlockStore {
    stored: Py<PyType>,
    removed: Py<PyType>,
    updated: Py<PyType>,
    nodes: HashMap<String, HashMap<i64, Block>>,
    planning: Option<Planning>,
}

#[pymethods]
impl BlockStore {
    /// `stored`, `removed`, `updated`: the event data classes of `eventbus.protocol`.
    #[new]
    fn new(stored: Py<PyType>, removed: Py<PyType>, updated: Py<PyType>) -> Self {
        BlockStore { stored, removed, updated, nodes: HashMap::new(), planning: None }
    }

    /// Replace a node's blocks: rows of (block_hash, parent_hash, cache_level, priority,
    /// num_tokens, lora_id, window_size, stored_at, updated_at), hashes signed, times in
    /// PostgreSQL microseconds.
    fn load(&mut self, node: &str, rows: Vec<LoadRow>) {
        let m = rows
            .into_iter()
            .map(|r| (r.0, Block::from_row((r.1, r.2, r.3, r.4, r.5, r.6, r.7, r.8))))
            .collect();
        self.nodes.insert(node.to_owned(), m);
    }

    fn loaded(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    fn count(&self, node: &str) -> usize {
        self.nodes.get(node).map_or(0, |m| m.len())
    }

    /// A block as (parent_hash, cache_level, priority, num_tokens, lora_id, window_size,
    /// stored_at, updated_at), or None.
    fn get(&self, node: &str, h: i64) -> Option<Row> {
        self.nodes.get(node)?.get(&h).map(Block::row)
    }

    /// Every block of a node as (block_hash, *get()) rows, in hash order.
    fn blocks(&self, node: &str) -> Vec<(i64, Row)> {
        let mut out: Vec<(i64, Row)> =
            self.nodes.get(node).map(|m| m.iter().map(|(h, b)| (*h, b.row())).collect()).unwrap_or_default();
        out.sort_by_key(|r| r.0);
        out
    }

    /// A node's blocks are now none (it stays loaded).
    fn reset(&mut self, node: &str) {
        self.nodes.insert(node.to_owned(), HashMap::new());
    }

    fn put(&mut self, node: &str, h: i64, row: Row) {
        self.nodes.entry(node.to_owned()).or_default().insert(h, Block::from_row(row));
    }

    fn delete(&mut self, node: &str, h: i64) {
        if let Some(m) = self.nodes.get_mut(node) {
            m.remove(&h);
        }
    }

    fn clear(&mut self) {
        self.nodes.clear();
        self.planning = None;
    }

    /// Start planning a take.
    fn begin(&mut self) {
        self.planning = Some(Planning { overlay: HashMap::new(), history: Copy::new() });
    }

    /// Forget the take being planned; the store is as it was before `begin`.
    fn abort(&mut self) {
        self.planning = None;
    }

    /// Plan one batch (its node loaded, its events following the node's last applied one, of
    /// the node's current instance). `ts`: the batch time in PostgreSQL microseconds.
    /// False: the take needs the reference planner (call `abort`).
    fn add(&mut self, py: Python<'_>, batch: &Bound<'_, PyAny>, node: &str, instance: &str, ts: i64) -> PyResult<bool> {
        let planning = self.planning.as_mut().ok_or_else(|| PyRuntimeError::new_err("add() before begin()"))?;
        let Some(base) = self.nodes.get(node) else { return Ok(false) };
        if !planning.overlay.contains_key(node) {
            planning.overlay.insert(node.to_owned(), HashMap::new());
        }
        let overlay = planning.overlay.get_mut(node).expect("inserted above");
        let hist = &mut planning.history;
        let (nb, ib) = (node.as_bytes(), instance.as_bytes());
        let stored_t = self.stored.bind(py);
        let removed_t = self.removed.bind(py);
        let updated_t = self.updated.bind(py);
        let current = |overlay: &HashMap<i64, Option<Block>>, h: i64| -> Option<Block> {
            match overlay.get(&h) {
                Some(v) => *v,
                None => base.get(&h).copied(),
            }
        };

        let events = batch.getattr(intern!(py, "events"))?;
        let events = events.cast::<PyList>()?;
        for ev in events.iter() {
            let eid: i64 = ev.getattr(intern!(py, "event_id"))?.extract()?;
            let window: i64 = ev.getattr(intern!(py, "window_size"))?.extract()?;
            if window > i32::MAX as i64 {
                return Ok(false); // beyond SQL's integer: the reference planner's case
            }
            let d = ev.getattr(intern!(py, "data"))?;
            let t = d.get_type();
            if t.is(stored_t) {
                let mut parent: Option<i64> = opt_u64(d.getattr(intern!(py, "parent_hash"))?)?.map(|p| p as i64);
                let blocks = d.getattr(intern!(py, "blocks"))?;
                for (seq, b) in blocks.cast::<PyList>()?.iter().enumerate() {
                    let h = sql_hash(&b.getattr(intern!(py, "block_hash"))?)?;
                    if current(overlay, h).is_some() {
                        return Ok(false); // stored twice: an anomaly, the reference planner's case
                    }
                    let level: i16 = b.getattr(intern!(py, "cache_level"))?.extract()?;
                    let prio: i16 = b.getattr(intern!(py, "priority"))?.extract()?;
                    let ntok: i32 = b.getattr(intern!(py, "num_tokens"))?.extract()?;
                    let lora: Option<i64> = opt_i64(b.getattr(intern!(py, "lora_id"))?)?;
                    overlay.insert(h, Some(Block {
                        parent, level, prio, ntok, lora, window: Some(window), stored_at: ts, updated_at: ts,
                    }));
                    history_row(hist, nb, ib, eid, seq as i32, b"stored", h, parent, None, Some(level), None,
                                Some(prio), ntok, lora, None, ts);
                    parent = Some(h);
                }
            } else if t.is(removed_t) {
                let hashes = d.getattr(intern!(py, "block_hashes"))?;
                for (seq, v) in hashes.cast::<PyList>()?.iter().enumerate() {
                    let h = sql_hash(&v)?;
                    let Some(cur) = current(overlay, h) else { return Ok(false) };
                    overlay.insert(h, None);
                    history_row(hist, nb, ib, eid, seq as i32, b"removed", h, cur.parent, Some(cur.level), None,
                                Some(cur.prio), None, cur.ntok, cur.lora, Some(cur.stored_at), ts);
                }
            } else if t.is(updated_t) {
                let h = sql_hash(&d.getattr(intern!(py, "block_hash"))?)?;
                let Some(cur) = current(overlay, h) else { return Ok(false) };
                if cur.window.is_some_and(|w| w > i32::MAX as i64) {
                    return Ok(false);
                }
                let diff = |name: &Bound<'_, pyo3::types::PyString>| -> PyResult<Option<(i16, i16)>> {
                    let v = d.getattr(name)?;
                    if v.is_none() {
                        return Ok(None);
                    }
                    Ok(Some((v.getattr(intern!(py, "old"))?.extract()?, v.getattr(intern!(py, "new"))?.extract()?)))
                };
                let lv = diff(intern!(py, "cache_level"))?;
                let pr = diff(intern!(py, "priority"))?;
                let next = Block {
                    level: lv.map_or(cur.level, |x| x.1),
                    prio: pr.map_or(cur.prio, |x| x.1),
                    updated_at: ts,
                    ..cur
                };
                overlay.insert(h, Some(next));
                // The block's level and priority before and after: the diff where the event has
                // one, else its unchanged value (an offload carries its priority), as apply.py.
                let (lv_old, lv_new) = lv.unwrap_or((cur.level, cur.level));
                let (pr_old, pr_new) = pr.unwrap_or((cur.prio, cur.prio));
                history_row(hist, nb, ib, eid, 0, b"updated", h, cur.parent, Some(lv_old), Some(lv_new),
                            Some(pr_old), Some(pr_new), cur.ntok, cur.lora, Some(cur.stored_at), ts);
            } else {
                return Ok(false); // created, snapshot: the reference planner's case
            }
        }
        Ok(true)
    }

    /// Finish the take: returns the COPY data of its `block_events` rows, of the `node_blocks`
    /// rows it inserts (blocks the store did not hold before the take) and updates (blocks it
    /// held and changed; both with all ten columns), of the keys it deletes (node_id, block_hash:
    /// blocks it held and removed; a block stored and removed within the take is in none), and
    /// the four row counts; the store now holds the take's result.
    #[allow(clippy::type_complexity)]
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<(
        Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>,
        usize, usize, usize, usize,
    )> {
        let planning = self.planning.take().ok_or_else(|| PyRuntimeError::new_err("finish() before begin()"))?;
        let mut inserts = Copy::new();
        let mut updates = Copy::new();
        let mut deletes = Copy::new();
        for (node, changed) in planning.overlay {
            let nb = node.as_bytes();
            let blocks = self.nodes.entry(node.clone()).or_default();
            for (h, v) in changed {
                match v {
                    Some(b) => {
                        let out = if blocks.insert(h, b).is_some() { &mut updates } else { &mut inserts };
                        out.row(10);
                        out.text(nb);
                        out.i64(h);
                        out.opt_i64(b.parent);
                        out.i16(b.level);
                        out.i16(b.prio);
                        out.i32(b.ntok);
                        out.opt_i64(b.lora);
                        out.opt_i32(b.window.map(|w| w as i32)); // add() keeps them in range
                        out.i64(b.stored_at);
                        out.i64(b.updated_at);
                    }
                    None => {
                        if blocks.remove(&h).is_some() {
                            deletes.row(2);
                            deletes.text(nb);
                            deletes.i64(h);
                        }
                    }
                }
            }
        }
        let (history, n_history) = planning.history.finish();
        let (inserts, n_inserts) = inserts.finish();
        let (updates, n_updates) = updates.finish();
        let (deletes, n_deletes) = deletes.finish();
        Ok((PyBytes::new(py, &history), PyBytes::new(py, &inserts), PyBytes::new(py, &updates),
            PyBytes::new(py, &deletes), n_history, n_inserts, n_updates, n_deletes))
    }
}

/// The block-hash bound of the wire schema (0 .. 2**64-1), checked in compiled code: msgspec
/// decodes JSON integers of any size and cannot bound them beyond int64
/// (`eventbus.protocol.decode_batch` uses this when the extension is installed).
#[pyclass(module = "kvflow_native", frozen)]
struct HashCheck {
    stored: Py<PyType>,
    removed: Py<PyType>,
    updated: Py<PyType>,
    snapshot: Py<PyType>,
}

#[inline]
fn beyond_u64(v: &Bound<'_, PyAny>) -> bool {
    !v.is_none() && v.extract::<u64>().is_err()
}

#[pymethods]
impl HashCheck {
    /// `stored`, `removed`, `updated`, `snapshot`: the event data classes of `eventbus.protocol`.
    #[new]
    fn new(stored: Py<PyType>, removed: Py<PyType>, updated: Py<PyType>, snapshot: Py<PyType>) -> Self {
        HashCheck { stored, removed, updated, snapshot }
    }

    /// The index of the first event (of a decoded batch's `events`) with a block or parent hash
    /// that is not a u64, or -1.
    fn first_beyond_u64(&self, py: Python<'_>, events: &Bound<'_, PyList>) -> PyResult<isize> {
        let (stored_t, removed_t, updated_t, snapshot_t) =
            (self.stored.bind(py), self.removed.bind(py), self.updated.bind(py), self.snapshot.bind(py));
        for (i, ev) in events.iter().enumerate() {
            let d = ev.getattr(intern!(py, "data"))?;
            let t = d.get_type();
            let bad = if t.is(stored_t) {
                beyond_u64(&d.getattr(intern!(py, "parent_hash"))?)
                    || d.getattr(intern!(py, "blocks"))?.cast::<PyList>()?.iter().any(|b| {
                        b.getattr(intern!(py, "block_hash")).map_or(true, |h| beyond_u64(&h))
                    })
            } else if t.is(removed_t) {
                d.getattr(intern!(py, "block_hashes"))?.cast::<PyList>()?.iter().any(|h| beyond_u64(&h))
            } else if t.is(updated_t) {
                beyond_u64(&d.getattr(intern!(py, "block_hash"))?)
            } else if t.is(snapshot_t) {
                d.getattr(intern!(py, "blocks"))?.cast::<PyList>()?.iter().any(|b| {
                    b.getattr(intern!(py, "block_hash")).map_or(true, |h| beyond_u64(&h))
                        || b.getattr(intern!(py, "parent_hash")).map_or(true, |h| beyond_u64(&h))
                })
            } else {
                false
            };
            if bad {
                return Ok(i as isize);
            }
        }
        Ok(-1)
    }
}

#[pymodule]
fn kvflow_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BlockStore>()?;
    m.add_class::<HashCheck>()?;
    m.add_class::<adaptive::GhostFifo>()?;
    m.add_class::<adaptive::LruShadow>()?;
    m.add_class::<adaptive::BandsShadow>()?;
    m.add_class::<lifetables::LifeTables>()?;
    m.add_class::<floor::ExactLru>()?;
    m.add_function(wrap_pyfunction!(attention::paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(gemm::small_batch_linear, m)?)?;
    m.add_function(wrap_pyfunction!(decode::decode_layers, m)?)?;
    Ok(())
}
