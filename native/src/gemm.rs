//! `y = x · Wᵀ` for the few rows of a decode step (`inference_node.model.native_linear`).
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

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::thread;

pub(crate) struct Dims {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
}

/// Portable version: weight rows `j0..j1`, every input row.
unsafe fn rows_scalar(d: &Dims, x: *const f32, w: *const f32, y: *mut f32, j0: usize, j1: usize) {
    for j in j0..j1 {
        let wr = std::slice::from_raw_parts(w.add(j * d.k), d.k);
        for i in 0..d.m {
            let xr = std::slice::from_raw_parts(x.add(i * d.k), d.k);
            *y.add(i * d.n + j) = crate::attention::dot(wr, xr);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Dims;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    #[inline(always)]
    unsafe fn tail(a: *const f32, b: *const f32, from: usize, to: usize) -> f32 {
        let mut s = 0f32;
        for t in from..to {
            s += *a.add(t) * *b.add(t);
        }
        s
    }

    /// Weight rows `j0..j1`: four at a time against two input rows at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows(d: &Dims, x: *const f32, w: *const f32, y: *mut f32, j0: usize, j1: usize) {
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
                    let r = _mm256_loadu_ps(w0.add(t));
                    a0 = _mm256_fmadd_ps(r, u, a0);
                    b0 = _mm256_fmadd_ps(r, v, b0);
                    let r = _mm256_loadu_ps(w1.add(t));
                    a1 = _mm256_fmadd_ps(r, u, a1);
                    b1 = _mm256_fmadd_ps(r, v, b1);
                    let r = _mm256_loadu_ps(w2.add(t));
                    a2 = _mm256_fmadd_ps(r, u, a2);
                    b2 = _mm256_fmadd_ps(r, v, b2);
                    let r = _mm256_loadu_ps(w3.add(t));
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
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0.add(t)), u, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1.add(t)), u, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2.add(t)), u, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3.add(t)), u, a3);
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
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(wr.add(t)), _mm256_loadu_ps(xr.add(t)), a);
                    t += 8;
                }
                *y.add(i * n + j) = hsum(a) + tail(wr, xr, k8, k);
            }
        }
    }
}

pub(crate) fn rows(d: &Dims, x: usize, w: usize, y: usize, j0: usize, j1: usize) {
    let (x, w, y) = (x as *const f32, w as *const f32, y as *mut f32);
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            unsafe { avx2::rows(d, x, w, y, j0, j1) };
            return;
        }
    }
    unsafe { rows_scalar(d, x, w, y, j0, j1) }
}

/// `y[m, n] = Σ_k x[m, k] · w[n, k]`: addresses of contiguous f32 tensors `x` `[m, k]`, `w`
/// `[n, k]` (an `nn.Linear` weight), `y` `[m, n]`; the output columns split over `threads`.
#[pyfunction]
#[pyo3(signature = (x, w, y, m, k, n, threads))]
#[allow(clippy::too_many_arguments)]
pub fn small_batch_linear(py: Python<'_>, x: usize, w: usize, y: usize, m: usize, k: usize, n: usize,
                          threads: usize) -> PyResult<()> {
    if m == 0 || k == 0 || n == 0 {
        return Err(PyValueError::new_err("small_batch_linear: an empty dimension"));
    }
    let d = Dims { m, k, n };
    // Chunks of whole 4-row groups, at least 64 rows each: a thread is worth its start.
    let threads = threads.clamp(1, n.div_ceil(64).max(1));
    py.detach(|| {
        if threads == 1 {
            rows(&d, x, w, y, 0, n);
            return;
        }
        let per = n.div_ceil(threads).div_ceil(4) * 4;
        thread::scope(|scope| {
            for t in 1..threads {
                let (lo, hi) = ((t * per).min(n), ((t + 1) * per).min(n));
                if lo < hi {
                    let d = &d;
                    scope.spawn(move || rows(d, x, w, y, lo, hi));
                }
            }
            rows(&d, x, w, y, 0, per.min(n));
        });
    });
    Ok(())
}
