//! Every decoder layer of a decode step in one call (`inference_node.model.native.decode_layers`).
//!
//! A decode step runs each layer's ~20 small operations (two RMSNorms, the rotary embedding of q
//! and k, the KV write, attention, SwiGLU, two residual adds) on a handful of rows: in torch each
//! is a dispatch of its own, and each of the four matrix products started its threads anew (~0.1
//! ms a start on this project's 2-core VM, more than the product of a 576 × 576 matrix by one
//! row). Here the threads start once per step and meet at a spinning barrier between the phases
//! of a layer; the products are `gemm.rs`'s and the attention is `attention.rs`'s, over the same
//! paged pool. Per layer and thread:
//!
//! 1. RMSNorm of the residual stream (every thread its own copy: `m × hidden`, a few µs), then its
//!    share of the q/k/v product's output columns; barrier;
//! 2. its share of the (sequence, KV head) items: the rotary embedding of the item's key and its
//!    query heads, the key and value written to the token's pool slot, the item's attention;
//!    barrier;
//! 3. its columns of the output projection, added into the residual stream; barrier;
//! 4. RMSNorm again, its columns of the gate and of the up projection (the same columns of both),
//!    `silu(gate) · up` for them; barrier;
//! 5. its columns of the down projection, added into the residual stream; barrier.
//!
//! The weights and the pool are f32, or bf16 (`elem.rs`: read as f32, keys and values rounded to
//! bf16 when written). The arithmetic is torch's, in f32 (RMSNorm's mean of squares summed in f64; the rotary
//! embedding as `x·cos + rotate_half(x)·sin`, unfused; `silu(g) = g / (1 + e^-g)`), so only the
//! order of sums differs; `tests/inference_node/test_native_kernels.py` compares a whole step
//! with the torch paths, and the reference-parity tests run through it.

use crate::attention::{self, Shape};
use crate::elem::{Bf16, Elem};
use crate::gemm::{self, Dims};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;

/// Weights per layer, in this order: input norm, fused q/k/v, output projection, post-attention
/// norm, fused gate/up, down projection.
const PER_LAYER: usize = 6;

/// A sense-reversing barrier that spins (then yields): the phases between two meetings last tens
/// of microseconds, less than a sleeping thread takes to wake.
struct SpinBarrier {
    n: usize,
    count: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> Self {
        SpinBarrier { n, count: AtomicUsize::new(0), generation: AtomicUsize::new(0) }
    }

    fn wait(&self) {
        if self.n == 1 {
            return;
        }
        let generation = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.store(generation.wrapping_add(1), Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            if spins < 4096 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
}

/// One step: shapes, the addresses of the weights, pool, tables and the shared buffers.
struct Step<'a> {
    m: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    inter: usize,
    eps: f32,
    weights: &'a [usize],
    k_pool: usize,
    v_pool: usize,
    /// f32 elements of one layer's pool (`n_blocks × block_size × kv_heads × d`)
    layer_stride: usize,
    cos: usize,
    sin: usize,
    slots: &'a [i64],
    tables: &'a [i64],
    lengths: &'a [i64],
    shape: Shape,
    // shared buffers
    x: usize,
    qkv: usize,
    q: usize,
    attn: usize,
    tmp: usize,
    act: usize,
}

/// `[lo, hi)` of `n` columns for thread `t` of `nt`, in whole groups of four (the product's unit).
fn columns(n: usize, t: usize, nt: usize) -> (usize, usize) {
    let per = n.div_ceil(nt).div_ceil(4) * 4;
    ((t * per).min(n), ((t + 1) * per).min(n))
}

/// `[lo, hi)` of `n` items for thread `t` of `nt`, as even as they come.
fn items(n: usize, t: usize, nt: usize) -> (usize, usize) {
    (n * t / nt, n * (t + 1) / nt)
}

/// `out = w · x / sqrt(mean(x²) + eps)` for each of `m` rows of `hidden` values.
unsafe fn rms_norm<E: Elem>(x: usize, w: usize, out: &mut [f32], m: usize, hidden: usize, eps: f32) {
    let w = std::slice::from_raw_parts(w as *const E, hidden);
    for i in 0..m {
        let row = std::slice::from_raw_parts((x as *const f32).add(i * hidden), hidden);
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let r = 1.0 / ((ss / hidden as f64) as f32 + eps).sqrt();
        for (o, (&v, &g)) in out[i * hidden..(i + 1) * hidden].iter_mut().zip(row.iter().zip(w)) {
            *o = g.to_f32() * (v * r);
        }
    }
}

/// Hugging Face's rotary embedding of one head: `x·cos + rotate_half(x)·sin`, stored as `D`.
unsafe fn rope<D: Elem>(src: *const f32, cos: *const f32, sin: *const f32, dst: *mut D, d: usize) {
    let half = d / 2;
    for j in 0..d {
        let rotated = if j < half { -*src.add(j + half) } else { *src.add(j - half) };
        *dst.add(j) = D::from_f32(*src.add(j) * *cos.add(j) + rotated * *sin.add(j));
    }
}

/// `x[:, lo..hi] += y[:, lo..hi]`, both `[m, n]`.
unsafe fn add_columns(x: usize, y: usize, m: usize, n: usize, lo: usize, hi: usize) {
    let (x, y) = (x as *mut f32, y as *const f32);
    for i in 0..m {
        for j in lo..hi {
            *x.add(i * n + j) += *y.add(i * n + j);
        }
    }
}

unsafe fn worker<E: Elem>(s: &Step, barrier: &SpinBarrier, t: usize, nt: usize) {
    let (m, hidden, d, inter) = (s.m, s.hidden, s.d, s.inter);
    let (nq, nkv) = (s.heads * d, s.kv_heads * d);
    let nqkv = nq + 2 * nkv;
    let group = s.heads / s.kv_heads;
    let mut h = vec![0f32; m * hidden];
    let (i0, i1) = items(m * s.kv_heads, t, nt);
    let (qkv_lo, qkv_hi) = columns(nqkv, t, nt);
    let (hid_lo, hid_hi) = columns(hidden, t, nt);
    let (int_lo, int_hi) = columns(inter, t, nt);
    let (qkv, q, attn, tmp, act) = (s.qkv as *mut f32, s.q as *mut f32, s.attn, s.tmp as *mut f32, s.act as *mut f32);
    for layer in 0..s.weights.len() / PER_LAYER {
        let w = &s.weights[layer * PER_LAYER..(layer + 1) * PER_LAYER];
        // 1. norm, q/k/v
        rms_norm::<E>(s.x, w[0], &mut h, m, hidden, s.eps);
        gemm::rows::<E>(&Dims { m, k: hidden, n: nqkv }, h.as_ptr() as usize, w[1], s.qkv, qkv_lo, qkv_hi);
        barrier.wait();
        // 2. rotary embedding, KV write, attention of this thread's (sequence, KV head) items
        let k_pool = (s.k_pool as *mut E).add(layer * s.layer_stride);
        let v_pool = (s.v_pool as *mut E).add(layer * s.layer_stride);
        for item in i0..i1 {
            let (i, g) = (item / s.kv_heads, item % s.kv_heads);
            let row = qkv.add(i * nqkv);
            let (cos, sin) = ((s.cos as *const f32).add(i * d), (s.sin as *const f32).add(i * d));
            let slot = s.slots[i] as usize;
            rope(row.add(nq + g * d), cos, sin, k_pool.add(slot * nkv + g * d), d);
            let (value, to) = (row.add(nq + nkv + g * d), v_pool.add(slot * nkv + g * d));
            for j in 0..d {
                *to.add(j) = E::from_f32(*value.add(j));
            }
            for head in g * group..(g + 1) * group {
                rope(row.add(head * d), cos, sin, q.add((i * s.heads + head) * d), d);
            }
        }
        attention::run::<E>(&s.shape, s.q, k_pool as usize, v_pool as usize, attn, s.tables, s.lengths, i0, i1, true);
        barrier.wait();
        // 3. output projection into the residual stream
        gemm::rows::<E>(&Dims { m, k: nq, n: hidden }, attn, w[2], s.tmp, hid_lo, hid_hi);
        add_columns(s.x, s.tmp, m, hidden, hid_lo, hid_hi);
        barrier.wait();
        // 4. norm, gate and up (the same columns of both), silu(gate) · up
        rms_norm::<E>(s.x, w[3], &mut h, m, hidden, s.eps);
        let gate_up = Dims { m, k: hidden, n: 2 * inter };
        gemm::rows::<E>(&gate_up, h.as_ptr() as usize, w[4], s.tmp, int_lo, int_hi);
        gemm::rows::<E>(&gate_up, h.as_ptr() as usize, w[4], s.tmp, inter + int_lo, inter + int_hi);
        for i in 0..m {
            for j in int_lo..int_hi {
                let g = *tmp.add(i * 2 * inter + j);
                *act.add(i * inter + j) = g / (1.0 + (-g).exp()) * *tmp.add(i * 2 * inter + inter + j);
            }
        }
        barrier.wait();
        // 5. down projection into the residual stream
        gemm::rows::<E>(&Dims { m, k: inter, n: hidden }, s.act, w[5], s.tmp, hid_lo, hid_hi);
        add_columns(s.x, s.tmp, m, hidden, hid_lo, hid_hi);
        barrier.wait();
    }
}

/// Run every decoder layer for `m` decode tokens, updating the residual stream `x` (`[m,
/// hidden]`) in place; each token's key and value are written to its pool slot on the way.
///
/// Addresses of contiguous tensors: `x` f32 `[m, hidden]`; `weights`: per layer (`PER_LAYER`)
/// the input norm `[hidden]`, fused q/k/v `[(heads + 2·kv_heads)·d, hidden]`, output projection
/// `[hidden, heads·d]`, post-attention norm `[hidden]`, fused gate/up `[2·inter, hidden]`, down
/// `[hidden, inter]`; `k_pool`, `v_pool` `[layers, n_blocks, block_size, kv_heads, d]`; the
/// weights and the pool f32, or all bf16 with `bf16` (the arithmetic stays f32, keys and values
/// rounded to bf16 as they are written); `cos`, `sin` f32 `[m, d]` (each token's position); `slots` i64 `[m]` (the token's flat
/// slot in a layer's pool); `tables` i64 `[m, width]`; `lengths` i64 `[m]` (keys each token sees,
/// itself included).
#[pyfunction]
#[pyo3(signature = (x, weights, k_pool, v_pool, cos, sin, slots, tables, lengths, m, hidden, heads, kv_heads,
                    head_dim, inter, n_blocks, block_size, width, eps, scale, threads, bf16=false))]
#[allow(clippy::too_many_arguments)]
pub fn decode_layers(py: Python<'_>, x: usize, weights: Vec<usize>, k_pool: usize, v_pool: usize, cos: usize,
                     sin: usize, slots: usize, tables: usize, lengths: usize, m: usize, hidden: usize, heads: usize,
                     kv_heads: usize, head_dim: usize, inter: usize, n_blocks: usize, block_size: usize,
                     width: usize, eps: f32, scale: f32, threads: usize, bf16: bool) -> PyResult<()> {
    if m == 0 || hidden == 0 || inter == 0 || head_dim == 0 || !head_dim.is_multiple_of(2) || block_size == 0 || width == 0
        || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(PyValueError::new_err("decode_layers: bad shape"));
    }
    if weights.is_empty() || !weights.len().is_multiple_of(PER_LAYER) {
        return Err(PyValueError::new_err(format!("decode_layers: {} weights, not {PER_LAYER} per layer",
                                                 weights.len())));
    }
    let slots = unsafe { std::slice::from_raw_parts(slots as *const i64, m) };
    let tables = unsafe { std::slice::from_raw_parts(tables as *const i64, m * width) };
    let lengths = unsafe { std::slice::from_raw_parts(lengths as *const i64, m) };
    attention::check_tables(tables, lengths, width, block_size, n_blocks)?;
    for i in 0..m {
        // The token's own slot is its last key's: the block its table gives for position len - 1.
        let pos = lengths[i] as usize - 1;
        let own = tables[i * width + pos / block_size] * block_size as i64 + (pos % block_size) as i64;
        if slots[i] != own {
            return Err(PyValueError::new_err(format!("token {i}: slot {} is not its position's ({own})", slots[i])));
        }
    }
    let nq = heads * head_dim;
    let nqkv = nq + 2 * kv_heads * head_dim;
    let mut qkv = vec![0f32; m * nqkv];
    let mut q = vec![0f32; m * nq];
    let mut attn = vec![0f32; m * nq];
    let mut tmp = vec![0f32; m * hidden.max(2 * inter)];
    let mut act = vec![0f32; m * inter];
    let step = Step {
        m, hidden, heads, kv_heads, d: head_dim, inter, eps, weights: &weights, k_pool, v_pool,
        layer_stride: n_blocks * block_size * kv_heads * head_dim, cos, sin, slots, tables, lengths,
        shape: Shape { n_seqs: m, n_heads: heads, n_kv: kv_heads, d: head_dim, bs: block_size, width, scale },
        x, qkv: qkv.as_mut_ptr() as usize, q: q.as_mut_ptr() as usize, attn: attn.as_mut_ptr() as usize,
        tmp: tmp.as_mut_ptr() as usize, act: act.as_mut_ptr() as usize,
    };
    let nt = threads.clamp(1, 64);
    let barrier = SpinBarrier::new(nt);
    py.detach(|| {
        thread::scope(|scope| {
            let work = if bf16 { worker::<Bf16> } else { worker::<f32> };
            for t in 1..nt {
                let (step, barrier) = (&step, &barrier);
                scope.spawn(move || unsafe { work(step, barrier, t, nt) });
            }
            unsafe { work(&step, &barrier, 0, nt) };
        });
    });
    Ok(())
}
