//! Decode attention straight over the node's paged KV pool (`inference_node.model.llama`).
//!
//! One new token per sequence attends to its sequence's keys, read where they lie in the pool
//! (block table, then the slot in the block): no gathered copy of the keys and values, each key
//! and value row read once for all the query heads of its KV head (grouped-query attention).
//! Scores, softmax and the weighted sum in f32, as torch's scaled_dot_product_attention on the
//! CPU computes them (up to the order of the sums); `tests/inference_node/test_native_attention.py`
//! compares them.
//!
//! The Python side (`inference_node.model.native_attention`) checks every tensor (f32, CPU,
//! contiguous, shapes) before it hands their addresses over; here the block ids and lengths are
//! checked against the pool again, and the work (sequence x KV head) is split over threads with
//! the GIL released.

use crate::elem::{Bf16, Elem};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::thread;

pub(crate) struct Shape {
    pub(crate) n_seqs: usize,
    pub(crate) n_heads: usize,
    pub(crate) n_kv: usize,
    pub(crate) d: usize,
    pub(crate) bs: usize,
    pub(crate) width: usize,
    pub(crate) scale: f32,
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes: the compiler keeps them in one vector register (no reassociation).
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `exp` of eight lanes (Cephes' single-precision scheme, as SLEEF's and torch's vectorized exp:
/// range reduction by ln 2, a degree-6 polynomial, the exponent set in the bits; ~1 ulp). Inputs
/// are softmax scores minus their maximum (<= 0); below -87.3 the result is 0.
#[inline(always)]
fn exp8(x: &mut [f32; 8]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let mut n = [0f32; 8];
    for l in 0..8 {
        let v = x[l].max(-87.336_55);
        n[l] = (v * LOG2E + 0.5).floor();
        let r = v - n[l] * LN2_HI - n[l] * LN2_LO;
        let z = r * r;
        let y = (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
            + 1.666_666_5e-1) * r + 0.5) * z + r + 1.0;
        let bits = ((n[l] as i32 + 127) << 23) as u32;
        x[l] = if x[l] < -87.336_55 { 0.0 } else { y * f32::from_bits(bits) };
    }
}

/// `d` elements from `p` as f32, in `row`.
#[inline(always)]
unsafe fn widen<'a, E: Elem>(p: *const E, d: usize, row: &'a mut [f32]) -> &'a [f32] {
    for (j, r) in row[..d].iter_mut().enumerate() {
        *r = (*p.add(j)).to_f32();
    }
    &row[..d]
}

/// One sequence's KV heads `g0..g1`: their query heads over the sequence's `len` keys. A block's
/// rows are read in order, each row once for all its KV heads' query heads.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn one<E: Elem>(sh: &Shape, q: *const f32, k: *const E, v: *const E, out: *mut f32, table: &[i64], len: usize,
                        i: usize, g0: usize, g1: usize, scores: &mut Vec<f32>, acc: &mut Vec<f32>) {
    let (d, bs, group, stride) = (sh.d, sh.bs, sh.n_heads / sh.n_kv, sh.n_kv * sh.d);
    let heads = (g1 - g0) * group; // query heads of this item, from query head g0 * group
    scores.clear();
    scores.resize(heads * len, 0.0);
    acc.clear();
    acc.resize(heads * d, 0.0);
    let qs = std::slice::from_raw_parts(q.add((i * sh.n_heads + g0 * group) * d), heads * d);
    let mut row = vec![0f32; d];
    let n_blocks = len.div_ceil(bs);
    for (b, &blk) in table[..n_blocks].iter().enumerate() {
        let first = b * bs;
        let base = k.add(blk as usize * bs * stride);
        for off in 0..bs.min(len - first) {
            for g in g0..g1 {
                let krow = widen(base.add(off * stride + g * d), d, &mut row);
                for h in (g - g0) * group..(g - g0 + 1) * group {
                    *scores.get_unchecked_mut(h * len + first + off) = dot(&qs[h * d..h * d + d], krow) * sh.scale;
                }
            }
        }
    }
    for h in 0..heads {
        softmax(&mut scores[h * len..h * len + len]);
    }
    for (b, &blk) in table[..n_blocks].iter().enumerate() {
        let first = b * bs;
        let base = v.add(blk as usize * bs * stride);
        for off in 0..bs.min(len - first) {
            for g in g0..g1 {
                let vrow = widen(base.add(off * stride + g * d), d, &mut row);
                for h in (g - g0) * group..(g - g0 + 1) * group {
                    let w = *scores.get_unchecked(h * len + first + off);
                    axpy(w, vrow, &mut acc[h * d..h * d + d]);
                }
            }
        }
    }
    let obase = out.add((i * sh.n_heads + g0 * group) * d);
    std::ptr::copy_nonoverlapping(acc.as_ptr(), obase, heads * d);
}

/// `one` with AVX2 for head sizes that are a multiple of eight. The pool is walked in address
/// order, four key rows (all KV heads) at a time, the same rows of the next block prefetched
/// meanwhile (blocks lie anywhere in the pool): scores as four independent sums per query head,
/// reduced together; then the values, four rows at a time into each head's sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn one_avx2<E: Elem>(sh: &Shape, q: *const f32, k: *const E, v: *const E, out: *mut f32, table: &[i64],
                            len: usize, i: usize, g0: usize, g1: usize, scores: &mut Vec<f32>, acc: &mut Vec<f32>) {
    use std::arch::x86_64::*;
    let (d, bs, group, stride) = (sh.d, sh.bs, sh.n_heads / sh.n_kv, sh.n_kv * sh.d);
    let chunks = d / 8;
    let heads = (g1 - g0) * group;
    scores.clear();
    scores.resize(heads * len, 0.0);
    acc.clear();
    acc.resize(heads * d, 0.0);
    let qs = q.add((i * sh.n_heads + g0 * group) * d);
    let scale = _mm_set1_ps(sh.scale);
    let n_blocks = len.div_ceil(bs);
    // The part of a row this item reads: KV heads g0..g1, in cache lines of 16 floats.
    let (col0, cols) = (g0 * d, (g1 - g0) * d);
    let prefetch = |next: *const E, r: usize, n: usize| {
        for row in r..r + n {
            let mut c = 0;
            while c < cols {
                _mm_prefetch::<_MM_HINT_T0>(next.add(row * stride + col0 + c) as *const i8);
                c += 16;
            }
        }
    };
    for (b, &blk) in table[..n_blocks].iter().enumerate() {
        let (first, rows) = (b * bs, bs.min(len - b * bs));
        let base = k.add(blk as usize * bs * stride);
        let next = table.get(b + 1).filter(|_| b + 1 < n_blocks).map(|&n| k.add(n as usize * bs * stride));
        let mut r = 0;
        while r + 4 <= rows {
            if let Some(next) = next {
                prefetch(next, r, 4);
            }
            for g in g0..g1 {
                let k0 = base.add(r * stride + g * d);
                let (k1, k2, k3) = (k0.add(stride), k0.add(2 * stride), k0.add(3 * stride));
                for h in (g - g0) * group..(g - g0 + 1) * group {
                    let qh = qs.add(h * d);
                    let z = _mm256_setzero_ps();
                    let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
                    for c in 0..chunks {
                        let qv = _mm256_loadu_ps(qh.add(c * 8));
                        a0 = _mm256_fmadd_ps(qv, E::load8(k0.add(c * 8)), a0);
                        a1 = _mm256_fmadd_ps(qv, E::load8(k1.add(c * 8)), a1);
                        a2 = _mm256_fmadd_ps(qv, E::load8(k2.add(c * 8)), a2);
                        a3 = _mm256_fmadd_ps(qv, E::load8(k3.add(c * 8)), a3);
                    }
                    let s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
                    _mm_storeu_ps(scores.as_mut_ptr().add(h * len + first + r), _mm_mul_ps(s, scale));
                }
            }
            r += 4;
        }
        for r in r..rows {
            for g in g0..g1 {
                let kr = base.add(r * stride + g * d);
                for h in (g - g0) * group..(g - g0 + 1) * group {
                    let qh = qs.add(h * d);
                    let mut a = _mm256_setzero_ps();
                    for c in 0..chunks {
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(c * 8)), E::load8(kr.add(c * 8)), a);
                    }
                    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                    *scores.as_mut_ptr().add(h * len + first + r) = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) * sh.scale;
                }
            }
        }
    }
    for h in 0..heads {
        softmax_avx2(&mut scores[h * len..h * len + len]);
    }
    let sc = scores.as_ptr();
    for (b, &blk) in table[..n_blocks].iter().enumerate() {
        let (first, rows) = (b * bs, bs.min(len - b * bs));
        let base = v.add(blk as usize * bs * stride);
        let next = table.get(b + 1).filter(|_| b + 1 < n_blocks).map(|&n| v.add(n as usize * bs * stride));
        let mut r = 0;
        while r < rows {
            let n = (rows - r).min(4);
            if let Some(next) = next {
                prefetch(next, r, n);
            }
            for g in g0..g1 {
                let v0 = base.add(r * stride + g * d);
                for h in (g - g0) * group..(g - g0 + 1) * group {
                    let ah = acc.as_mut_ptr().add(h * d);
                    let w = sc.add(h * len + first + r);
                    if n == 4 {
                        let (w0, w1, w2, w3) = (_mm256_set1_ps(*w), _mm256_set1_ps(*w.add(1)), _mm256_set1_ps(*w.add(2)),
                                                _mm256_set1_ps(*w.add(3)));
                        for c in 0..chunks {
                            let o = c * 8;
                            let x = _mm256_fmadd_ps(w0, E::load8(v0.add(o)), _mm256_loadu_ps(ah.add(o)));
                            let y = _mm256_mul_ps(w1, E::load8(v0.add(stride + o)));
                            let x = _mm256_fmadd_ps(w2, E::load8(v0.add(2 * stride + o)), x);
                            let y = _mm256_fmadd_ps(w3, E::load8(v0.add(3 * stride + o)), y);
                            _mm256_storeu_ps(ah.add(o), _mm256_add_ps(x, y));
                        }
                    } else {
                        for j in 0..n {
                            let wj = _mm256_set1_ps(*w.add(j));
                            for c in 0..chunks {
                                let o = c * 8;
                                let x = _mm256_fmadd_ps(wj, E::load8(v0.add(j * stride + o)), _mm256_loadu_ps(ah.add(o)));
                                _mm256_storeu_ps(ah.add(o), x);
                            }
                        }
                    }
                }
            }
            r += n;
        }
    }
    let obase = out.add((i * sh.n_heads + g0 * group) * d);
    std::ptr::copy_nonoverlapping(acc.as_ptr(), obase, heads * d);
}

/// `y += w * x`, eight lanes at a time.
#[inline(always)]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    let (cx, cy) = (x.chunks_exact(8), y.chunks_exact_mut(8));
    for (a, b) in cx.zip(cy) {
        for l in 0..8 {
            b[l] += w * a[l];
        }
    }
    let n = x.len() / 8 * 8;
    for j in n..x.len() {
        y[j] += w * x[j];
    }
}

/// `softmax` with AVX2: `exp8`'s scheme on eight lanes at once (fused multiply-adds in the
/// range reduction and the polynomial, so the last bit may differ from `exp8`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(sc: &mut [f32]) {
    use std::arch::x86_64::*;
    let len = sc.len();
    let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let p = sc.as_mut_ptr();
    let (mv, lo) = (_mm256_set1_ps(m), _mm256_set1_ps(-87.336_55));
    let exp = |x: __m256| -> __m256 {
        let v = _mm256_max_ps(x, lo);
        let n = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), v);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let z = _mm256_mul_ps(r, r);
        let mut y = _mm256_fmadd_ps(_mm256_set1_ps(1.987_569_1e-4), r, _mm256_set1_ps(1.398_199_9e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.333_452e-3));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.166_579_6e-2));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.666_666_5e-1));
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5));
        y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0));
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
        _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_GE_OQ>(x, lo))
    };
    let mut total = _mm256_setzero_ps();
    let mut j = 0;
    while j + 8 <= len {
        let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), mv));
        _mm256_storeu_ps(p.add(j), e);
        total = _mm256_add_ps(total, e);
        j += 8;
    }
    let mut buf = [f32::NEG_INFINITY; 8];
    for (l, t) in (j..len).enumerate() {
        buf[l] = *p.add(t) - m;
    }
    let e = exp(_mm256_loadu_ps(buf.as_ptr()));
    _mm256_storeu_ps(buf.as_mut_ptr(), e);
    total = _mm256_add_ps(total, e);
    for (l, t) in (j..len).enumerate() {
        *p.add(t) = buf[l];
    }
    let s = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let inv = _mm256_set1_ps(1.0 / _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))));
    let mut j = 0;
    while j + 8 <= len {
        _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), inv));
        j += 8;
    }
    for t in j..len {
        *p.add(t) *= _mm_cvtss_f32(_mm256_castps256_ps128(inv));
    }
}

/// Softmax in place: exp of each score less their maximum, over their sum.
#[inline(always)]
fn softmax(sc: &mut [f32]) {
    let len = sc.len();
    let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0f32; 8];
    let chunks = len / 8;
    for c in 0..chunks {
        let mut x = [0f32; 8];
        for l in 0..8 {
            x[l] = sc[c * 8 + l] - m;
        }
        exp8(&mut x);
        for l in 0..8 {
            sc[c * 8 + l] = x[l];
            lanes[l] += x[l];
        }
    }
    let mut rest = [f32::NEG_INFINITY; 8];
    for (l, j) in (chunks * 8..len).enumerate() {
        rest[l] = sc[j] - m;
    }
    exp8(&mut rest);
    for (l, j) in (chunks * 8..len).enumerate() {
        sc[j] = rest[l];
        lanes[l] += rest[l];
    }
    let total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    let inv = 1.0 / total;
    for x in sc.iter_mut() {
        *x *= inv;
    }
}

/// Work item `item`: a sequence (all its KV heads), or, with fewer sequences than threads, one KV
/// head of one (`per_head`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn range<E: Elem>(sh: &Shape, q: usize, k: usize, v: usize, out: usize, tables: &[i64], lengths: &[i64],
                         lo: usize, hi: usize, per_head: bool, simd: bool) {
    let (mut scores, mut acc) = (Vec::new(), Vec::new());
    for item in lo..hi {
        let (i, g0, g1) = if per_head { (item / sh.n_kv, item % sh.n_kv, item % sh.n_kv + 1) } else { (item, 0, sh.n_kv) };
        let table = &tables[i * sh.width..(i + 1) * sh.width];
        let (qp, kp, vp, op, len) = (q as *const f32, k as *const E, v as *const E, out as *mut f32, lengths[i] as usize);
        #[cfg(target_arch = "x86_64")]
        if simd {
            one_avx2(sh, qp, kp, vp, op, table, len, i, g0, g1, &mut scores, &mut acc);
            continue;
        }
        let _ = simd;
        one(sh, qp, kp, vp, op, table, len, i, g0, g1, &mut scores, &mut acc);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn range_avx2<E: Elem>(sh: &Shape, q: usize, k: usize, v: usize, out: usize, tables: &[i64], lengths: &[i64],
                              lo: usize, hi: usize, per_head: bool) {
    range::<E>(sh, q, k, v, out, tables, lengths, lo, hi, per_head, sh.d.is_multiple_of(8))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn run<E: Elem>(sh: &Shape, q: usize, k: usize, v: usize, out: usize, tables: &[i64], lengths: &[i64], lo: usize, hi: usize,
       per_head: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            unsafe { range_avx2::<E>(sh, q, k, v, out, tables, lengths, lo, hi, per_head) };
            return;
        }
    }
    unsafe { range::<E>(sh, q, k, v, out, tables, lengths, lo, hi, per_head, false) }
}

/// Every sequence's `lengths[i]` keys fit its `width` blocks of `block_size`, and the blocks it
/// uses are in the pool's `n_blocks`: nothing is read or written outside the pool.
pub(crate) fn check_tables(tables: &[i64], lengths: &[i64], width: usize, block_size: usize,
                           n_blocks: usize) -> PyResult<()> {
    for (i, &len) in lengths.iter().enumerate() {
        if len < 1 || len as usize > width * block_size {
            return Err(PyValueError::new_err(format!("sequence {i}: {len} keys do not fit its {width} blocks")));
        }
        let used = (len as usize).div_ceil(block_size);
        if tables[i * width..i * width + used].iter().any(|&b| b < 0 || b as usize >= n_blocks) {
            return Err(PyValueError::new_err(format!("sequence {i}: a block id outside the pool's {n_blocks}")));
        }
    }
    Ok(())
}

/// `out[i, h] = softmax(q[i, h] . K_i / sqrt(d)) V_i` for each decode sequence `i` and query head
/// `h`, with sequence `i`'s first `lengths[i]` keys in the blocks `tables[i, :]` of the pool.
///
/// Addresses of contiguous tensors: `q`, `out` f32 [n_seqs, n_heads, d]; `k_pool`, `v_pool`
/// [n_blocks, block_size, n_kv_heads, d] (one layer; f32, or bf16 with `bf16`); `tables` i64 [n_seqs, width]; `lengths`
/// i64 [n_seqs].
#[pyfunction]
#[pyo3(signature = (q, k_pool, v_pool, out, tables, lengths, n_seqs, n_heads, n_kv_heads, head_dim, block_size,
                    width, n_blocks, scale, threads, bf16=false))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(py: Python<'_>, q: usize, k_pool: usize, v_pool: usize, out: usize, tables: usize,
                              lengths: usize, n_seqs: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize,
                              block_size: usize, width: usize, n_blocks: usize, scale: f32,
                              threads: usize, bf16: bool) -> PyResult<()> {
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || head_dim == 0 || block_size == 0 {
        return Err(PyValueError::new_err("bad attention shape"));
    }
    let tables = unsafe { std::slice::from_raw_parts(tables as *const i64, n_seqs * width) };
    let lengths = unsafe { std::slice::from_raw_parts(lengths as *const i64, n_seqs) };
    check_tables(tables, lengths, width, block_size, n_blocks)?;
    let sh = Shape { n_seqs, n_heads, n_kv: n_kv_heads, d: head_dim, bs: block_size, width, scale };
    let per_head = n_seqs < threads.max(1) * 2;
    let items = if per_head { sh.n_seqs * sh.n_kv } else { sh.n_seqs };
    // A thread costs ~0.1-0.2 ms to start: worth it past ~1M key elements (4 MB of keys).
    let work: usize = lengths.iter().map(|&l| l as usize).sum::<usize>() * n_kv_heads * head_dim;
    let threads = if work < (1 << 20) { 1 } else { threads.clamp(1, items.max(1)) };
    let run = if bf16 { run::<Bf16> } else { run::<f32> };
    py.detach(|| {
        if threads == 1 {
            run(&sh, q, k_pool, v_pool, out, tables, lengths, 0, items, per_head);
            return;
        }
        thread::scope(|scope| {
            let per = items.div_ceil(threads);
            for t in 0..threads {
                let (lo, hi) = (t * per, ((t + 1) * per).min(items));
                if lo >= hi {
                    continue;
                }
                let sh = &sh;
                scope.spawn(move || run(sh, q, k_pool, v_pool, out, tables, lengths, lo, hi, per_head));
            }
        });
    });
    Ok(())
}
