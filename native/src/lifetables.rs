//! The adaptive policy's life tables, compiled: the exact counterpart of
//! `inference_node.kv.lifetables.LifeTables` (the reference, used when this extension is not
//! installed, and whose docstrings say what the tables are and why).
//!
//! Every method does what the Python one does, in the same order of floating-point operations,
//! so both give the same estimates bit for bit and the core the same decisions;
//! `tests/inference_node/kv/test_native_tables.py` runs both on the same random calls and on whole
//! cache replays and compares every count, every estimate and every event. What this saves is the
//! interpreter's work per block (a hit's or a victim's age bucket, its cohort) and the estimates'
//! loops over 2 x 64 buckets and the cohorts.
//!
//! Ages are never negative in the core (a block's `last_used` is a release tick already handed
//! out); an age below 0 is taken as 0 here.

use pyo3::exceptions::PyIndexError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

const NUM_BUCKETS: usize = 64;
const LAST: usize = NUM_BUCKETS - 1;
const MERGE: f64 = 0.25;
const TIE: f64 = 0.05;
const CENSORED: f64 = 0.5;
const RECENCY: usize = 0;
const FREQUENCY: usize = 1;

/// The half-octave bucket of an age in ticks (`lifetables.age_bucket`).
#[inline]
fn bucket(age: i64) -> usize {
    if age <= 1 {
        return if age > 0 { 1 } else { 0 };
    }
    let m = 64 - age.leading_zeros() as i64; // bit_length
    let k = (2 * m - 1 + ((age >> (m - 2)) & 1)) as usize;
    k.min(LAST)
}

/// The youngest age of each bucket, and a bound past the last (`lifetables._AGE_LO`).
fn age_lo() -> [i64; NUM_BUCKETS + 1] {
    let mut lo = [0i64; NUM_BUCKETS + 1];
    lo[1] = 1;
    lo[2] = 2;
    lo[3] = 2;
    for (k, x) in lo.iter_mut().enumerate().take(NUM_BUCKETS).skip(4) {
        let base: i64 = if (k + 1) % 2 == 0 { 2 } else { 3 };
        *x = base << (k.div_ceil(2) - 2); // (k + 1) // 2 - 2
    }
    lo[NUM_BUCKETS] = 1i64 << 62;
    lo
}

/// `bisect.bisect_right(a, x)`.
#[inline]
fn bisect_right(a: &[i64], x: i64) -> usize {
    a.partition_point(|&v| v <= x)
}

/// The Python tables' `(prior_blocks, half_events, cohort_ticks, band_of)` and state.
#[pyclass(module = "kvflow_native")]
pub struct LifeTables {
    #[pyo3(get)]
    prior_blocks: f64,
    #[pyo3(get)]
    half_events: i64,
    #[pyo3(get)]
    cohort_ticks: i64,
    band_of: Vec<i64>,
    hits: [[f64; NUM_BUCKETS]; 2],
    ends: [[f64; NUM_BUCKETS]; 2],
    events: i64,
    p: [[f64; NUM_BUCKETS]; 2],
    /// `p` as Python lists, made again by `compute` (the core reads them before every eviction).
    p_lists: Py<PyList>,
    starts: Vec<i64>,
    counts: Vec<[i64; 2]>,
    age_lo: [i64; NUM_BUCKETS + 1],
}

fn lists(py: Python<'_>, p: &[[f64; NUM_BUCKETS]; 2]) -> PyResult<Py<PyList>> {
    let rows = [PyList::new(py, p[0])?, PyList::new(py, p[1])?];
    Ok(PyList::new(py, rows)?.unbind())
}

impl LifeTables {
    fn counted(&mut self, n: i64) {
        self.events += n;
        if self.events >= self.half_events {
            self.events = 0;
            for t in [&mut self.hits, &mut self.ends] {
                for row in t.iter_mut() {
                    for x in row.iter_mut() {
                        *x *= 0.5;
                    }
                }
            }
        }
    }

    #[inline]
    fn band(&self, priority: i64) -> PyResult<i64> {
        usize::try_from(priority)
            .ok()
            .and_then(|p| self.band_of.get(p).copied())
            .ok_or_else(|| PyIndexError::new_err(format!("priority {priority} out of range")))
    }

    /// `LifeTables._count`: `ends` chooses the table (else `hits`).
    fn count(&mut self, blocks: &Bound<'_, PyAny>, tick: i64, ends: bool, taken: bool) -> PyResult<()> {
        let py = blocks.py();
        let (ref_name, prio_name, last_name) = (intern!(py, "ref"), intern!(py, "priority"), intern!(py, "last_used"));
        let (mut total, mut run) = (0i64, 0i64);
        let (mut band, mut k, mut i, mut lo, mut hi) = (-1i64, 0usize, -1i64, -1i64, -1i64);
        for b in blocks.try_iter()? {
            let b = b?;
            if taken && b.getattr(ref_name)?.extract::<i64>()? != 1 {
                continue;
            }
            let bb = self.band(b.getattr(prio_name)?.extract()?)?;
            if bb < 0 {
                continue;
            }
            let lu: i64 = b.getattr(last_name)?.extract()?;
            if bb == band && lo <= lu && lu < hi {
                run += 1;
                continue;
            }
            if run != 0 {
                self.add_run(ends, band as usize, k, i, run);
                total += run;
            }
            band = bb;
            run = 1;
            k = bucket(tick - lu);
            i = bisect_right(&self.starts, lu) as i64 - 1;
            lo = tick - self.age_lo[k + 1] + 1;
            hi = tick - self.age_lo[k] + 1;
            if i >= 0 && self.starts[i as usize] > lo {
                lo = self.starts[i as usize];
            }
            if ((i + 1) as usize) < self.starts.len() && self.starts[(i + 1) as usize] < hi {
                hi = self.starts[(i + 1) as usize];
            }
        }
        if run != 0 {
            self.add_run(ends, band as usize, k, i, run);
            total += run;
        }
        if total != 0 {
            self.counted(total);
        }
        Ok(())
    }

    #[inline]
    fn add_run(&mut self, ends: bool, band: usize, k: usize, i: i64, run: i64) {
        let table = if ends { &mut self.ends } else { &mut self.hits };
        table[band][k] += run as f64;
        if i >= 0 {
            self.counts[i as usize][band] -= run;
        }
    }

    fn merge_cohorts(&mut self, tick: i64) {
        let mut drop = 0;
        while drop + 1 < self.starts.len() && self.counts[drop][0] <= 0 && self.counts[drop][1] <= 0 {
            drop += 1;
        }
        if drop > 0 {
            self.starts.drain(..drop);
            self.counts.drain(..drop);
        }
        let n = self.starts.len();
        if n < 2 {
            return;
        }
        let mut new_starts = vec![self.starts[0]];
        let mut new_counts = vec![self.counts[0]];
        for i in 1..n {
            let end = if i + 1 < n { self.starts[i + 1] } else { tick + 1 };
            let last = new_starts.len() - 1;
            if ((end - new_starts[last]) as f64) <= MERGE * ((tick + 1 - end) as f64) {
                new_counts[last][0] += self.counts[i][0];
                new_counts[last][1] += self.counts[i][1];
            } else {
                new_starts.push(self.starts[i]);
                new_counts.push(self.counts[i]);
            }
        }
        self.starts = new_starts;
        self.counts = new_counts;
    }

    fn alive_counts(&self, tick: i64) -> [[i64; NUM_BUCKETS]; 2] {
        let mut alive = [[0i64; NUM_BUCKETS]; 2];
        let n = self.starts.len();
        for i in 0..n {
            let start = self.starts[i];
            let end = if i + 1 < n { self.starts[i + 1] } else { tick + 1 };
            let k = bucket(tick - (start + end - 1).div_euclid(2));
            let [r, f] = self.counts[i];
            if r > 0 {
                alive[0][k] += r;
            }
            if f > 0 {
                alive[1][k] += f;
            }
        }
        alive
    }
}

#[pymethods]
impl LifeTables {
    #[new]
    fn new(py: Python<'_>, prior_blocks: f64, half_events: i64, cohort_ticks: i64, band_of: Vec<i64>) -> PyResult<Self> {
        let p = [[1.0; NUM_BUCKETS]; 2];
        Ok(LifeTables {
            prior_blocks,
            half_events: half_events.max(1),
            cohort_ticks: cohort_ticks.max(1),
            band_of,
            hits: [[0.0; NUM_BUCKETS]; 2],
            ends: [[0.0; NUM_BUCKETS]; 2],
            events: 0,
            p_lists: lists(py, &p)?,
            p,
            starts: Vec::new(),
            counts: Vec::new(),
            age_lo: age_lo(),
        })
    }

    /// Hits per band and age bucket (a copy).
    #[getter]
    fn hits(&self) -> Vec<Vec<f64>> {
        self.hits.iter().map(|r| r.to_vec()).collect()
    }

    /// Ends per band and age bucket (a copy).
    #[getter]
    fn ends(&self) -> Vec<Vec<f64>> {
        self.ends.iter().map(|r| r.to_vec()).collect()
    }

    /// The alive cohorts' first ticks, oldest first (a copy).
    #[getter]
    fn starts(&self) -> Vec<i64> {
        self.starts.clone()
    }

    /// The alive cohorts' [recency, frequency] counts (a copy).
    #[getter]
    fn counts(&self) -> Vec<Vec<i64>> {
        self.counts.iter().map(|c| c.to_vec()).collect()
    }

    /// P per band and age bucket, as the lists the core reads (not to be changed in place).
    #[getter]
    fn p(&self, py: Python<'_>) -> Py<PyList> {
        self.p_lists.clone_ref(py)
    }

    /// Set P (two rows of `NUM_BUCKETS` floats; tests use it).
    #[setter]
    fn set_p(&mut self, py: Python<'_>, p: Vec<Vec<f64>>) -> PyResult<()> {
        if p.len() != 2 || p.iter().any(|r| r.len() != NUM_BUCKETS) {
            return Err(PyIndexError::new_err(format!("P is 2 rows of {NUM_BUCKETS}")));
        }
        for (band, row) in p.iter().enumerate() {
            self.p[band].copy_from_slice(row);
        }
        self.p_lists = lists(py, &self.p)?;
        Ok(())
    }

    fn used(&mut self, band: usize, age: i64, last_used: i64) {
        self.hits[band][bucket(age)] += 1.0;
        self.counted(1);
        self.leave(band, last_used);
    }

    fn evicted(&mut self, band: usize, age: i64, last_used: i64) {
        self.ends[band][bucket(age)] += 1.0;
        self.counted(1);
        self.leave(band, last_used);
    }

    fn blocks_used(&mut self, blocks: &Bound<'_, PyAny>, tick: i64) -> PyResult<()> {
        self.count(blocks, tick, false, true)
    }

    fn blocks_evicted(&mut self, blocks: &Bound<'_, PyAny>, tick: i64) -> PyResult<()> {
        self.count(blocks, tick, true, false)
    }

    /// `LifeTables.runs_evicted`: the runs the eviction index handed out: a run of one priority
    /// sorted by `last_used`, or (from a heap) victims of possibly several priorities.
    fn runs_evicted(&mut self, runs: &Bound<'_, PyAny>, tick: i64) -> PyResult<()> {
        let py = runs.py();
        let (prio_name, last_name) = (intern!(py, "priority"), intern!(py, "last_used"));
        let mut total = 0i64;
        let mut lus: Vec<i64> = Vec::new();
        for run in runs.try_iter()? {
            let run = run?;
            let n = run.len()?;
            if n == 0 {
                continue;
            }
            let p: i64 = run.get_item(0)?.getattr(prio_name)?.extract()?;
            // a run from a heap may hold several priorities in any order (its first and last
            // blocks can agree while one between does not): every block's is checked
            lus.clear();
            let mut mixed = false;
            for b in run.try_iter()? {
                let b = b?;
                if b.getattr(prio_name)?.extract::<i64>()? != p {
                    mixed = true;
                    break;
                }
                lus.push(b.getattr(last_name)?.extract()?);
            }
            if mixed {
                self.count(&run, tick, true, false)?;
                continue;
            }
            let band = self.band(p)?;
            if band < 0 {
                continue;
            }
            let band = band as usize;
            total += n as i64;
            // cohorts: those of the oldest and the newest block, and every one between
            let n_starts = self.starts.len() as i64;
            let mut pos = 0usize;
            let mut i = bisect_right(&self.starts, lus[0]) as i64 - 1;
            let last_i = bisect_right(&self.starts, lus[n - 1]) as i64 - 1;
            while pos < n {
                let q = if i + 1 < n_starts && i < last_i {
                    let bound = self.starts[(i + 1) as usize];
                    pos + lus[pos..].partition_point(|&v| v < bound)
                } else {
                    n
                };
                if i >= 0 {
                    self.counts[i as usize][band] -= (q - pos) as i64;
                }
                pos = q;
                i += 1;
            }
            // age buckets, from the oldest block's down: bucket k holds last_used up to tick - AGE_LO[k]
            let mut k = bucket(tick - lus[0]) as i64;
            pos = 0;
            while pos < n && k >= 0 {
                let bound = tick - self.age_lo[k as usize];
                let q = pos + lus[pos..].partition_point(|&v| v <= bound);
                self.ends[band][k as usize] += (q - pos) as f64;
                pos = q;
                k -= 1;
            }
        }
        if total != 0 {
            self.counted(total);
        }
        Ok(())
    }

    fn arrive(&mut self, recency: i64, frequency: i64, first_tick: i64) {
        if recency == 0 && frequency == 0 {
            return;
        }
        match self.starts.last() {
            Some(&last) if first_tick - last < self.cohort_ticks => {
                let c = self.counts.last_mut().expect("a count per start");
                c[0] += recency;
                c[1] += frequency;
            }
            _ => {
                self.starts.push(first_tick);
                self.counts.push([recency, frequency]);
            }
        }
    }

    fn leave(&mut self, band: usize, last_used: i64) {
        let i = bisect_right(&self.starts, last_used);
        if i > 0 {
            self.counts[i - 1][band] -= 1;
        }
    }

    #[pyo3(name = "move")]
    fn move_(&mut self, old_band: i64, new_band: i64, last_used: i64) {
        let mut i = bisect_right(&self.starts, last_used) as i64 - 1;
        if i < 0 {
            if new_band < 0 || self.starts.is_empty() {
                return;
            }
            i = 0;
        }
        let c = &mut self.counts[i as usize];
        if old_band >= 0 {
            c[old_band as usize] -= 1;
        }
        if new_band >= 0 {
            c[new_band as usize] += 1;
        }
    }

    /// Evictable blocks per band by age bucket (`LifeTables.alive`; it merges nothing).
    fn alive(&self, tick: i64) -> (Vec<i64>, Vec<i64>) {
        let a = self.alive_counts(tick);
        (a[0].to_vec(), a[1].to_vec())
    }

    fn compute(&mut self, py: Python<'_>, tick: i64) -> PyResult<()> {
        self.merge_cohorts(tick);
        let alive = self.alive_counts(tick);
        let w = self.prior_blocks;
        for band in [RECENCY, FREQUENCY] {
            let hits = &self.hits[band];
            let mut weighed = [0.0f64; NUM_BUCKETS];
            for k in 0..NUM_BUCKETS {
                weighed[k] = hits[k] + CENSORED * (self.ends[band][k] + alive[band][k] as f64);
            }
            // at this age or older (itertools.accumulate over the reversed rows)
            let mut hs = [0.0f64; NUM_BUCKETS];
            let mut reached = [0.0f64; NUM_BUCKETS];
            hs[LAST] = hits[LAST];
            reached[LAST] = weighed[LAST];
            for k in (0..LAST).rev() {
                hs[k] = hs[k + 1] + hits[k];
                reached[k] = reached[k + 1] + weighed[k];
            }
            let mut out = [0.0f64; NUM_BUCKETS];
            let mut prev = 1.0f64;
            let mut filled = 0;
            for k in 0..NUM_BUCKETS {
                if reached[k] == 0.0 {
                    break;
                }
                prev = (hs[k] + w * prev) / (reached[k] + w);
                out[k] = prev;
                filled += 1;
            }
            for x in out.iter_mut().skip(filled) {
                *x = prev;
            }
            self.p[band] = out;
        }
        self.p_lists = lists(py, &self.p)?;
        Ok(())
    }

    fn frequency_first(&self, frequency_age: i64, recency_age: i64) -> bool {
        let pf = self.p[FREQUENCY][bucket(frequency_age)];
        let pr = self.p[RECENCY][bucket(recency_age)];
        pf < pr * (1.0 - TIE) || (pf <= pr * (1.0 + TIE) && frequency_age > recency_age)
    }

    /// `LifeTables.describe`: P per band at some ages, and the evictable blocks per band.
    #[allow(unused_variables)]
    fn describe<'py>(&self, py: Python<'py>, tick: i64, ages: Vec<i64>) -> PyResult<Bound<'py, PyDict>> {
        let round = py.import("builtins")?.getattr("round")?;
        let (mut r, mut f) = (0i64, 0i64);
        for c in &self.counts {
            r += c[0];
            f += c[1];
        }
        let alive = PyDict::new(py);
        alive.set_item("recency", r)?;
        alive.set_item("frequency", f)?;
        let p = PyDict::new(py);
        for a in ages {
            let k = bucket(a);
            let at = PyDict::new(py);
            at.set_item("recency", round.call1((self.p[RECENCY][k], 4))?)?;
            at.set_item("frequency", round.call1((self.p[FREQUENCY][k], 4))?)?;
            p.set_item(a.to_string(), at)?;
        }
        let out = PyDict::new(py);
        out.set_item("alive", alive)?;
        out.set_item("p", p)?;
        Ok(out)
    }
}
