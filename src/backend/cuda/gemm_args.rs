//! How kiln's row-major prefill matmul maps onto cuBLAS's column-major `cublasGemmEx`.
//! Pure arithmetic (no feature, no GPU), so the mapping is unit-tested here against a CPU GEMM
//! that reads its arguments the way cuBLAS does.
//!
//! kiln computes `out[t, r] = Σ_k x[t, k] · W[r, k]` for `t < T` token rows and `r < R` weight
//! rows, with `W` bf16 row-major `[R, K]`, `x` row-major `[T, K]` (row stride `xs`) and `out`
//! row-major `[T, R]` (row stride `os`).
//!
//! cuBLAS computes `C = op(A) · op(B)` with every matrix column-major: element `(i, j)` of a
//! matrix with leading dimension `ld` is at `i + j·ld`. A row-major `[rows, cols]` array with
//! row stride `s` is therefore the column-major `[cols, rows]` matrix with `ld = s` (its
//! transpose, for free). So
//!
//! * `W` row-major `[R, K]` is column-major `Wc = Wᵀ`, `[K, R]`, `ld = K`;
//! * `x` row-major `[T, K]` is column-major `Xc = xᵀ`, `[K, T]`, `ld = xs`;
//! * `out` row-major `[T, R]` is column-major `Oc = outᵀ`, `[R, T]`, `ld = os`.
//!
//! `out = x · Wᵀ` transposed is `outᵀ = W · xᵀ`, i.e. `Oc = Wcᵀ · Xc`: `A = W` with
//! `transa = T` (`op(A) = Wcᵀ`, `[R, K]`), `B = x` with `transb = N` (`[K, T]`), and
//! `m = R`, `n = T`, `k = K`, `lda = K`, `ldb = xs`, `ldc = os`.

/// cuBLAS's `cublasOperation_t`, as far as kiln uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trans {
    /// `CUBLAS_OP_N`
    N,
    /// `CUBLAS_OP_T`
    T,
}

/// The shape arguments of one `cublasGemmEx` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmArgs {
    pub transa: Trans,
    pub transb: Trans,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// The arguments for `out[t, r] = Σ_k x[t, k] W[r, k]` (see the module docs): `tokens` rows of
/// `x` (row stride `x_stride`), `weight_rows` rows of a `[weight_rows, k]` weight, `out` with row
/// stride `out_stride`. `A` is the weight, `B` the activations, `C` the output.
pub fn prefill_gemm(
    tokens: usize,
    weight_rows: usize,
    k: usize,
    x_stride: usize,
    out_stride: usize,
) -> GemmArgs {
    GemmArgs {
        transa: Trans::T,
        transb: Trans::N,
        m: weight_rows,
        n: tokens,
        k,
        lda: k,
        ldb: x_stride,
        ldc: out_stride,
    }
}

impl GemmArgs {
    /// cuBLAS's own argument checks (`CUBLAS_STATUS_INVALID_VALUE` otherwise): the leading
    /// dimensions cover the stored rows of each operand, and every size fits in an `int`.
    pub fn valid(&self) -> bool {
        let rows_a = if self.transa == Trans::N {
            self.m
        } else {
            self.k
        };
        let rows_b = if self.transb == Trans::N {
            self.k
        } else {
            self.n
        };
        let fits = [self.m, self.n, self.k, self.lda, self.ldb, self.ldc]
            .iter()
            .all(|&v| v <= i32::MAX as usize);
        fits && self.lda >= rows_a.max(1) && self.ldb >= rows_b.max(1) && self.ldc >= self.m.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `C = α op(A) op(B) + β C`, every matrix column-major, exactly as the cuBLAS reference
    /// documents `cublasGemmEx` (f32 here; the device uses bf16 A/B and f32 C).
    fn gemm_col_major(g: &GemmArgs, a: &[f32], b: &[f32], c: &mut [f32], alpha: f32, beta: f32) {
        let op_a = |i: usize, p: usize| match g.transa {
            Trans::N => a[i + p * g.lda],
            Trans::T => a[p + i * g.lda],
        };
        let op_b = |p: usize, j: usize| match g.transb {
            Trans::N => b[p + j * g.ldb],
            Trans::T => b[j + p * g.ldb],
        };
        for j in 0..g.n {
            for i in 0..g.m {
                let s: f32 = (0..g.k).map(|p| op_a(i, p) * op_b(p, j)).sum();
                let at = i + j * g.ldc;
                c[at] = alpha * s + beta * c[at];
            }
        }
    }

    #[test]
    fn row_major_prefill_maps_to_column_major_gemm() {
        for (t, r, k, xs, os) in [(1, 1, 1, 1, 1), (9, 5, 7, 7, 5), (17, 6, 3, 10, 11)] {
            let w: Vec<f32> = (0..r * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let x: Vec<f32> = (0..t * xs).map(|i| (i as f32 * 0.11).cos()).collect();
            // Padding columns of `out` (beyond r) must survive untouched.
            let mut out = vec![-7.0f32; t * os];
            let g = prefill_gemm(t, r, k, xs, os);
            assert!(g.valid(), "{g:?}");
            gemm_col_major(&g, &w, &x, &mut out, 1.0, 0.0);
            for tt in 0..t {
                for rr in 0..os {
                    let got = out[tt * os + rr];
                    if rr >= r {
                        assert_eq!(got, -7.0, "padding column {rr} of row {tt} written");
                        continue;
                    }
                    let want: f32 = (0..k).map(|p| x[tt * xs + p] * w[rr * k + p]).sum();
                    assert!((got - want).abs() < 1e-5, "[{tt},{rr}]: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn beta_one_is_the_in_place_residual_add() {
        let (t, r, k) = (3, 4, 5);
        let w: Vec<f32> = (0..r * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let x: Vec<f32> = (0..t * k).map(|i| (i % 7) as f32).collect();
        let res: Vec<f32> = (0..t * r).map(|i| i as f32 * 10.0).collect();
        let mut out = res.clone();
        gemm_col_major(&prefill_gemm(t, r, k, k, r), &w, &x, &mut out, 1.0, 1.0);
        for tt in 0..t {
            for rr in 0..r {
                let s: f32 = (0..k).map(|p| x[tt * k + p] * w[rr * k + p]).sum();
                assert_eq!(out[tt * r + rr], res[tt * r + rr] + s);
            }
        }
    }

    #[test]
    fn invalid_leading_dimensions_are_caught() {
        assert!(!prefill_gemm(4, 8, 16, 8, 8).valid(), "x stride below k");
        assert!(
            !prefill_gemm(4, 8, 16, 16, 4).valid(),
            "out stride below rows"
        );
        assert!(prefill_gemm(4, 8, 16, 16, 8).valid());
    }
}
