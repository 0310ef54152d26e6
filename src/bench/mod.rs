//! The parts of `kiln-bench` that are not tied to one backend: the bytes a decode step must move
//! ([`bytes`]), the bandwidth the roofline divides by ([`bandwidth`]), the table it prints
//! ([`report`]), speculative against plain decoding ([`speculative`]), what a faster numerics
//! mode costs in agreement with the exact path ([`numerics`]), and the statistics and
//! token streams every timed run shares. The binary keeps
//! the command line and the timing loops; a backend's timing plugs in beside the CPU's and
//! reuses all of this.

pub mod bandwidth;
pub mod bytes;
pub mod load;
pub mod numerics;
pub mod report;
pub mod serving;
pub mod speculative;

/// A xorshift stream of token ids below the vocabulary size.
pub fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

/// `134.5 M`, `111.9 K`, `1.24 B`: parameter counts as llama-bench writes them.
pub fn params_text(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} M", n / 1e6)
    } else {
        format!("{:.1} K", n / 1e3)
    }
}

/// Median of sorted values (NaN for none).
pub fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Mean and sample standard deviation (0 for one sample).
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert!(median(&[]).is_nan());
        assert_eq!(mean_sd(&[2.0]), (2.0, 0.0));
        let (m, sd) = mean_sd(&[1.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((sd - 2f64.sqrt()).abs() < 1e-12);
        assert_eq!(params_text(1_235_814_400), "1.24 B");
        assert_eq!(params_text(134_515_008), "134.5 M");
    }

    #[test]
    fn token_ids_are_seeded_and_in_range() {
        let a = token_ids(100, 7, 1);
        assert_eq!(a, token_ids(100, 7, 1));
        assert_ne!(a, token_ids(100, 7, 2));
        assert!(a.iter().all(|&t| t < 7));
    }
}
