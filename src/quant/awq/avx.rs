//! Hand-written AVX versions of [`super::kernels`]' dot products (x86_64 only; the caller
//! checks [`available`] first, see `Kernels::avx`).
//!
//! They perform exactly the operations of the portable ones (lane `l` accumulates the
//! products of the elements `l mod 8` (`dot4`) or `l mod 16` (`dot`), separate multiply and
//! add, no FMA, the same final sums), so the results are bit-identical and the choice of AWQ
//! scales does not depend on the CPU.
//!
//! Why they exist: the baseline x86_64 target has only 128-bit SSE2, and LLVM vectorizes the
//! portable `dot4` badly (it packs the same lane of the four accumulators into one register
//! and shuffles every load); compiling the portable code with `target_feature(enable =
//! "avx")` instead did not close the gap (1.0-1.2x on the products, 1.0-1.6x on the error
//! sums). `cargo bench --bench awq` times both on SmolLM2-135M's shapes, one thread, medians of
//! 21 (2-core x86_64 VM, shared; measured when awq.rs was split, issue 17): the calibration
//! products (256 tokens) run 1.1-1.6x faster with AVX (1.4x over a layer's seven), the
//! search's error sums (32 sampled tokens) 4.2-4.8x, with the same bits. Rerun it before
//! deciding to drop them.

use std::arch::x86_64::*;

pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx")
}

#[target_feature(enable = "avx")]
fn hsum(v: __m256) -> f32 {
    let mut a = [0f32; 8];
    // SAFETY: `a` holds 8 f32.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
    a.iter().sum::<f32>()
}

/// The portable `kernels::dot4`: `e[j] . x` for `j < 4`.
#[target_feature(enable = "avx")]
pub fn dot4(e: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let n = x.len() / 8 * 8;
    assert!(e.iter().all(|r| r.len() >= x.len()));
    let mut a = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        // SAFETY: i + 8 <= n <= len of x and of every e[j] (asserted above).
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            for j in 0..4 {
                a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_loadu_ps(e[j].as_ptr().add(i)), xv));
            }
        }
        i += 8;
    }
    let tail = |ej: &[f32]| ej[n..x.len()].iter().zip(&x[n..]).map(|(p, q)| p * q).sum::<f32>();
    [hsum(a[0]) + tail(e[0]), hsum(a[1]) + tail(e[1]), hsum(a[2]) + tail(e[2]), hsum(a[3]) + tail(e[3])]
}

/// The portable `kernels::dot`: 16 lanes as two registers.
#[target_feature(enable = "avx")]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len().min(b.len());
    let n = len / 16 * 16;
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= len of both slices.
        unsafe {
            lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i))));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), _mm256_loadu_ps(b.as_ptr().add(i + 8))));
        }
        i += 16;
    }
    let mut acc = [0f32; 16];
    // SAFETY: `acc` holds 16 f32.
    unsafe {
        _mm256_storeu_ps(acc.as_mut_ptr(), lo);
        _mm256_storeu_ps(acc.as_mut_ptr().add(8), hi);
    }
    let mut s = 0f32;
    for (x, y) in a[n..len].iter().zip(&b[n..len]) {
        s += x * y;
    }
    acc.iter().sum::<f32>() + s
}
