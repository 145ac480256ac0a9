//! The element types the node's kernels read weights and keys/values in: f32, and bf16 (the
//! upper half of an f32, as torch stores `torch.bfloat16`). Arithmetic is always f32: a bf16
//! value widens exactly; an f32 narrows to bf16 rounding to nearest, ties to even, as torch's
//! `Tensor.to(torch.bfloat16)` does (c10's `round_to_nearest_even`).

/// An element the kernels load as f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// Eight elements from `p` as f32 lanes (inlined into the AVX2 kernels).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// A bf16 value's bits.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(transparent)]
pub(crate) struct Bf16(pub(crate) u16);

impl Elem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        if v.is_nan() {
            return Bf16(0x7fc0);
        }
        let bits = v.to_bits();
        Bf16((bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
    }
}
