//! Dense math on row-major `[T]` slices: the few kernels the model needs, written out so that
//! every forward and backward is explicit and the summation order is fixed (each output
//! element is a sum over `k` in increasing order, whatever the surrounding partitioning;
//! that is what makes pipelined and sequential runs agree to rounding).
//!
//! Shapes are given as `(rows, cols)`; a matrix `m × n` is `m*n` elements, row `i` at
//! `i*n..(i+1)*n`. Functions panic only on shape mismatches, which are programming errors
//! (callers construct every shape from one [`crate::model::ModelConfig`]).

use num_traits::Float;
use std::fmt::Debug;

/// The element type: `f32` or `f64`.
///
/// The three matrix kernels are trait methods implemented for each concrete type (by
/// `impl_real!`), so that their inner loops use primitive arithmetic even in unoptimized
/// builds; the free functions [`matmul`], [`matmul_bt`] and [`add_matmul_at`] check the shapes
/// and call them.
pub trait Real:
    Float + Debug + Default + Send + Sync + 'static + std::iter::Sum + std::ops::AddAssign
{
    /// Converts from `f64` (rounding for `f32`).
    fn of(x: f64) -> Self;
    /// Converts to `f64` (exact).
    fn f64(self) -> f64;
    /// The type's name, `f32` or `f64`.
    const NAME: &'static str;
    /// `c += a b` with `a` `m × k`, `b` `k × n`, `c` `m × n` (shapes already checked).
    fn gemm_nn(c: &mut [Self], a: &[Self], b: &[Self], m: usize, k: usize, n: usize);
    /// `c = a bᵀ` with `a` `m × n`, `b` `k × n`, `c` `m × k` (shapes already checked).
    fn gemm_nt(c: &mut [Self], a: &[Self], b: &[Self], m: usize, n: usize, k: usize);
    /// `g += aᵀ b` with `a` `m × k`, `b` `m × n`, `g` `k × n` (shapes already checked).
    fn gemm_tn(g: &mut [Self], a: &[Self], b: &[Self], m: usize, k: usize, n: usize);
}

macro_rules! impl_real {
    ($t:ty, $name:literal) => {
        impl Real for $t {
            fn of(x: f64) -> Self {
                x as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            const NAME: &'static str = $name;
            fn gemm_nn(c: &mut [$t], a: &[$t], b: &[$t], m: usize, k: usize, n: usize) {
                let mut i = 0;
                while i < m {
                    let ci = &mut c[i * n..(i + 1) * n];
                    let mut p = 0;
                    while p < k {
                        let aip = a[i * k + p];
                        let bp = &b[p * n..(p + 1) * n];
                        let mut j = 0;
                        while j < n {
                            ci[j] += aip * bp[j];
                            j += 1;
                        }
                        p += 1;
                    }
                    i += 1;
                }
            }
            fn gemm_nt(c: &mut [$t], a: &[$t], b: &[$t], m: usize, n: usize, k: usize) {
                let mut i = 0;
                while i < m {
                    let ai = &a[i * n..(i + 1) * n];
                    let mut p = 0;
                    while p < k {
                        let bp = &b[p * n..(p + 1) * n];
                        let mut s: $t = 0.0;
                        let mut j = 0;
                        while j < n {
                            s += ai[j] * bp[j];
                            j += 1;
                        }
                        c[i * k + p] = s;
                        p += 1;
                    }
                    i += 1;
                }
            }
            fn gemm_tn(g: &mut [$t], a: &[$t], b: &[$t], m: usize, k: usize, n: usize) {
                let mut i = 0;
                while i < m {
                    let bi = &b[i * n..(i + 1) * n];
                    let mut p = 0;
                    while p < k {
                        let aip = a[i * k + p];
                        let gp = &mut g[p * n..(p + 1) * n];
                        let mut j = 0;
                        while j < n {
                            gp[j] += aip * bi[j];
                            j += 1;
                        }
                        p += 1;
                    }
                    i += 1;
                }
            }
        }
    };
}

impl_real!(f64, "f64");
impl_real!(f32, "f32");

/// `C = A B`: `a` is `m × k`, `b` is `k × n`; returns `m × n`.
pub fn matmul<T: Real>(a: &[T], b: &[T], m: usize, k: usize, n: usize) -> Vec<T> {
    assert_eq!(a.len(), m * k, "matmul: a is not {m}x{k}");
    assert_eq!(b.len(), k * n, "matmul: b is not {k}x{n}");
    let mut c = vec![T::zero(); m * n];
    T::gemm_nn(&mut c, a, b, m, k, n);
    c
}

/// `C = A Bᵀ`: `a` is `m × n`, `b` is `k × n`; returns `m × k` (input gradients:
/// `dX = dY Wᵀ` with `W` stored `k × n`).
pub fn matmul_bt<T: Real>(a: &[T], b: &[T], m: usize, n: usize, k: usize) -> Vec<T> {
    assert_eq!(a.len(), m * n, "matmul_bt: a is not {m}x{n}");
    assert_eq!(b.len(), k * n, "matmul_bt: b is not {k}x{n}");
    let mut c = vec![T::zero(); m * k];
    T::gemm_nt(&mut c, a, b, m, n, k);
    c
}

/// `G += Aᵀ B`: `a` is `m × k`, `b` is `m × n`, `g` is `k × n` (weight gradients:
/// `dW += Xᵀ dY`).
pub fn add_matmul_at<T: Real>(g: &mut [T], a: &[T], b: &[T], m: usize, k: usize, n: usize) {
    assert_eq!(a.len(), m * k, "add_matmul_at: a is not {m}x{k}");
    assert_eq!(b.len(), m * n, "add_matmul_at: b is not {m}x{n}");
    assert_eq!(g.len(), k * n, "add_matmul_at: g is not {k}x{n}");
    T::gemm_tn(g, a, b, m, k, n);
}

/// `a += b` elementwise.
pub fn add_into<T: Real>(a: &mut [T], b: &[T]) {
    assert_eq!(a.len(), b.len(), "add_into: lengths differ");
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

/// The logistic function `1 / (1 + e^-x)`.
pub fn sigmoid<T: Real>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// `silu(x) = x σ(x)`.
pub fn silu<T: Real>(x: T) -> T {
    x * sigmoid(x)
}

/// `d silu / dx = σ(x) (1 + x (1 - σ(x)))`.
pub fn silu_grad<T: Real>(x: T) -> T {
    let s = sigmoid(x);
    s * (T::one() + x * (T::one() - s))
}

/// In-place softmax of one row (max-subtracted).
pub fn softmax_row<T: Real>(row: &mut [T]) {
    let mx = row.iter().copied().fold(T::neg_infinity(), T::max);
    let mut sum = T::zero();
    for v in row.iter_mut() {
        *v = (*v - mx).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v = *v / sum;
    }
}

/// Largest absolute value (0 for an empty slice).
pub fn max_abs<T: Real>(a: &[T]) -> f64 {
    a.iter().fold(0.0, |m, x| m.max(x.f64().abs()))
}

/// `max |a - b| / max(max |b|, floor)`: the relative error of `a` against reference `b`
/// in the infinity norm; NaN if any element of either is NaN (or both are the same
/// infinity). Panics if the lengths differ.
pub fn rel_err<T: Real, U: Real>(a: &[T], b: &[U], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err: lengths differ");
    let mut d: f64 = 0.0;
    for (x, y) in a.iter().zip(b) {
        let e = (x.f64() - y.f64()).abs();
        // `f64::max` drops a NaN: a NaN (or an infinity minus itself) is the error itself.
        if e.is_nan() {
            return f64::NAN;
        }
        d = d.max(e);
    }
    let scale = max_abs(b);
    if scale.is_nan() {
        return f64::NAN;
    }
    d / scale.max(floor)
}

/// A deterministic generator (SplitMix64): weight initialization and test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeds the generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Seeds from a seed and a name (FNV-1a of the name mixed in), so that a tensor's
    /// initial values depend only on its name, not on where it lives.
    pub fn named(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        Rng(seed ^ h)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmuls_agree() {
        // a 2x3, b 3x2.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        assert_eq!(matmul(&a, &b, 2, 3, 2), vec![58.0, 64.0, 139.0, 154.0]);
        // a (2x3) times bt where bt is b transposed stored 2x3.
        let bt = [7.0, 9.0, 11.0, 8.0, 10.0, 12.0];
        assert_eq!(matmul_bt(&a, &bt, 2, 3, 2), vec![58.0, 64.0, 139.0, 154.0]);
        // aᵀ c with a 2x3, c 2x2 -> 3x2.
        let c = [1.0, 0.0, 0.0, 1.0];
        let mut g = vec![0.0; 6];
        add_matmul_at(&mut g, &a, &c, 2, 3, 2);
        assert_eq!(g, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }

    #[test]
    fn scalar_functions() {
        assert!((sigmoid(0.0f64) - 0.5).abs() < 1e-15);
        let x = 0.7f64;
        let h = 1e-6;
        let fd = (silu(x + h) - silu(x - h)) / (2.0 * h);
        assert!((fd - silu_grad(x)).abs() < 1e-9);
        let mut r = [1.0f64, 2.0, 3.0];
        softmax_row(&mut r);
        assert!((r.iter().sum::<f64>() - 1.0).abs() < 1e-15);
        assert!((r[2] / r[1] - std::f64::consts::E).abs() < 1e-12);
        assert_eq!(rel_err(&[1.0f64, 2.0], &[1.0f64, 4.0], 1e-30), 0.5);
        // A NaN is an error, not a zero difference.
        assert!(rel_err(&[1.0f64, f64::NAN], &[1.0f64, 4.0], 1e-30).is_nan());
        assert!(rel_err(&[1.0f64, 2.0], &[f64::NAN, 4.0], 1e-30).is_nan());
    }

    #[test]
    fn rng_is_deterministic_and_bounded() {
        let mut a = Rng::named(1, "layer0.wq");
        let mut b = Rng::named(1, "layer0.wq");
        let mut c = Rng::named(1, "layer0.wk");
        let xs: Vec<f64> = (0..100).map(|_| a.uniform()).collect();
        let ys: Vec<f64> = (0..100).map(|_| b.uniform()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs[0], c.uniform());
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
    }
}
