//! `y = x · Wᵀ` for the few rows of a decode step (`inference_node.model.native.linear`); the
//! weight in f32 or bf16 (`elem.rs`), the rows and the sums in f32.
//!
//! A decode step multiplies every weight matrix by a handful of rows (one per running sequence).
//! BLAS libraries are built for large products: for 2–32 rows on this project's CPUs (AVX2) they
//! took 3–4× the time of one row, copying ("packing") the whole weight matrix on every call. Here
//! each weight row is read once, in the layout `nn.Linear` keeps it (`[out, in]`, contiguous), and
//! multiplied with every input row while it is in the L1 cache: four weight rows by two input rows
//! at a time, eight lanes per fused multiply-add, sums in f32 (only their order differs from
//! torch's). Below, the time of a step is the time to read the weights once.
//!
//! Output rows are split over threads (the GIL released); x and y are small and stay in cache.

use crate::elem::{Bf16, Elem};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::thread;

pub(crate) struct Dims {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
}

/// Portable version: weight rows `j0..j1`, every input row.
unsafe fn rows_scalar<W: Elem>(d: &Dims, x: *const f32, w: *const W, y: *mut f32, j0: usize, j1: usize) {
    let mut row = vec![0f32; d.k];
    for j in j0..j1 {
        for (t, r) in row.iter_mut().enumerate() {
            *r = (*w.add(j * d.k + t)).to_f32();
        }
        for i in 0..d.m {
            let xr = std::slice::from_raw_parts(x.add(i * d.k), d.k);
            *y.add(i * d.n + j) = crate::attention::dot(&row, xr);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Dims;
    use crate::elem::Elem;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    #[inline(always)]
    unsafe fn tail<W: Elem>(a: *const W, b: *const f32, from: usize, to: usize) -> f32 {
        let mut s = 0f32;
        for t in from..to {
            s += (*a.add(t)).to_f32() * *b.add(t);
        }
        s
    }

    /// Weight rows `j0..j1`: four at a time against two input rows at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows<W: Elem>(d: &Dims, x: *const f32, w: *const W, y: *mut f32, j0: usize, j1: usize) {
        let (k, n, m) = (d.k, d.n, d.m);
        let k8 = k / 8 * 8;
        let mut j = j0;
        while j + 4 <= j1 {
            let w0 = w.add(j * k);
            let (w1, w2, w3) = (w0.add(k), w0.add(2 * k), w0.add(3 * k));
            let mut i = 0;
            while i + 2 <= m {
                let (x0, x1) = (x.add(i * k), x.add((i + 1) * k));
                let z = _mm256_setzero_ps();
                let (mut a0, mut a1, mut a2, mut a3, mut b0, mut b1, mut b2, mut b3) = (z, z, z, z, z, z, z, z);
                let mut t = 0;
                while t < k8 {
                    let (u, v) = (_mm256_loadu_ps(x0.add(t)), _mm256_loadu_ps(x1.add(t)));
                    let r = W::load8(w0.add(t));
                    a0 = _mm256_fmadd_ps(r, u, a0);
                    b0 = _mm256_fmadd_ps(r, v, b0);
                    let r = W::load8(w1.add(t));
                    a1 = _mm256_fmadd_ps(r, u, a1);
                    b1 = _mm256_fmadd_ps(r, v, b1);
                    let r = W::load8(w2.add(t));
                    a2 = _mm256_fmadd_ps(r, u, a2);
                    b2 = _mm256_fmadd_ps(r, v, b2);
                    let r = W::load8(w3.add(t));
                    a3 = _mm256_fmadd_ps(r, u, a3);
                    b3 = _mm256_fmadd_ps(r, v, b3);
                    t += 8;
                }
                let (y0, y1) = (y.add(i * n + j), y.add((i + 1) * n + j));
                *y0 = hsum(a0) + tail(w0, x0, k8, k);
                *y0.add(1) = hsum(a1) + tail(w1, x0, k8, k);
                *y0.add(2) = hsum(a2) + tail(w2, x0, k8, k);
                *y0.add(3) = hsum(a3) + tail(w3, x0, k8, k);
                *y1 = hsum(b0) + tail(w0, x1, k8, k);
                *y1.add(1) = hsum(b1) + tail(w1, x1, k8, k);
                *y1.add(2) = hsum(b2) + tail(w2, x1, k8, k);
                *y1.add(3) = hsum(b3) + tail(w3, x1, k8, k);
                i += 2;
            }
            if i < m {
                let x0 = x.add(i * k);
                let z = _mm256_setzero_ps();
                let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
                let mut t = 0;
                while t < k8 {
                    let u = _mm256_loadu_ps(x0.add(t));
                    a0 = _mm256_fmadd_ps(W::load8(w0.add(t)), u, a0);
                    a1 = _mm256_fmadd_ps(W::load8(w1.add(t)), u, a1);
                    a2 = _mm256_fmadd_ps(W::load8(w2.add(t)), u, a2);
                    a3 = _mm256_fmadd_ps(W::load8(w3.add(t)), u, a3);
                    t += 8;
                }
                let y0 = y.add(i * n + j);
                *y0 = hsum(a0) + tail(w0, x0, k8, k);
                *y0.add(1) = hsum(a1) + tail(w1, x0, k8, k);
                *y0.add(2) = hsum(a2) + tail(w2, x0, k8, k);
                *y0.add(3) = hsum(a3) + tail(w3, x0, k8, k);
            }
            j += 4;
        }
        for j in j..j1 {
            let wr = w.add(j * k);
            for i in 0..m {
                let xr = x.add(i * k);
                let mut a = _mm256_setzero_ps();
                let mut t = 0;
                while t < k8 {
                    a = _mm256_fmadd_ps(W::load8(wr.add(t)), _mm256_loadu_ps(xr.add(t)), a);
                    t += 8;
                }
                *y.add(i * n + j) = hsum(a) + tail(wr, xr, k8, k);
            }
        }
    }
}

pub(crate) fn rows<W: Elem>(d: &Dims, x: usize, w: usize, y: usize, j0: usize, j1: usize) {
    let (x, w, y) = (x as *const f32, w as *const W, y as *mut f32);
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            unsafe { avx2::rows::<W>(d, x, w, y, j0, j1) };
            return;
        }
    }
    unsafe { rows_scalar::<W>(d, x, w, y, j0, j1) }
}

/// `y[m, n] = Σ_k x[m, k] · w[n, k]`: addresses of contiguous f32 tensors `x` `[m, k]`, `w`
/// `[n, k]` (an `nn.Linear` weight), `y` `[m, n]`; the output columns split over `threads`.
/// Weight rows `j0..j1` of `y = x · Wᵀ` with the weight's elements of type `W`.
fn split<W: Elem>(d: &Dims, x: usize, w: usize, y: usize, threads: usize) {
    let n = d.n;
    if threads == 1 {
        rows::<W>(d, x, w, y, 0, n);
        return;
    }
    let per = n.div_ceil(threads).div_ceil(4) * 4;
    thread::scope(|scope| {
        for t in 1..threads {
            let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
            if lo < hi {
                scope.spawn(move || rows::<W>(d, x, w, y, lo, hi));
            }
        }
        rows::<W>(d, x, w, y, 0, per.min(n));
    });
}

/// `y[m, n] = Σ_k x[m, k] · w[n, k]`: addresses of contiguous tensors `x` f32 `[m, k]`, `w`
/// `[n, k]` (an `nn.Linear` weight; f32, or bf16 with `bf16`), `y` f32 `[m, n]`; the output
/// columns split over `threads`.
#[pyfunction]
#[pyo3(signature = (x, w, y, m, k, n, threads, bf16=false))]
#[allow(clippy::too_many_arguments)]
pub fn small_batch_linear(py: Python<'_>, x: usize, w: usize, y: usize, m: usize, k: usize, n: usize,
                          threads: usize, bf16: bool) -> PyResult<()> {
    if m == 0 || k == 0 || n == 0 {
        return Err(PyValueError::new_err("small_batch_linear: an empty dimension"));
    }
    let d = Dims { m, k, n };
    // A thread costs ~0.1 ms to start on the 2-core VM, as much as a 576 x 1536 product by one
    // row: worth it from a few thousand weight rows (the head), not for a layer's matrices.
    let threads = threads.clamp(1, n.div_ceil(4096).max(1));
    py.detach(|| {
        if bf16 {
            split::<Bf16>(&d, x, w, y, threads)
        } else {
            split::<f32>(&d, x, w, y, threads)
        }
    });
    Ok(())
}
