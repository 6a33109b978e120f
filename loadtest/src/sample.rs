//! Random draws: a small seeded PRNG and a Zipf rank sampler.
//!
//! Both are written here rather than pulled in: the generator must be reproducible from the
//! scenario's `seed`, cheap per request, and the Zipf sampler must handle a 1,000,000,000-key space
//! without a probability table (rejection-inversion needs O(1) memory and no set-up per draw).

/// SplitMix64: tiny, fast, and good enough for choosing keys (not for anything secret).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n` > 0); the multiply-shift bias is below 2^-32 for any `n` we use.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[lo, hi]`.
    pub fn range_i64(&mut self, lo: i64, hi: i64) -> i64 {
        let span = hi.wrapping_sub(lo) as u64;
        if span == u64::MAX {
            return self.next_u64() as i64;
        }
        lo.wrapping_add(self.below(span + 1) as i64)
    }
}

/// Derives an independent stream seed from a base seed and a stream number.
pub fn stream_seed(base: u64, stream: u64) -> u64 {
    let mut r = Rng::new(base ^ stream.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    r.next_u64()
}

/// Zipf distribution over ranks `1..=n`: P(k) proportional to k^-s, s >= 0 (s = 0 is uniform).
///
/// Sampling is rejection-inversion (Hörmann and Derflinger, 1996): draw from the continuous hat
/// x^-s by inverting its integral, round to the nearest rank, and accept unless the point falls in
/// the sliver where the hat overshoots the step. Acceptance is above 90% for every s, so the loop
/// bound below is never reached in practice; it only makes the loop provably finite.
#[derive(Debug, Clone)]
pub struct Zipf {
    n: u64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    shortcut: f64,
}

const MAX_REJECTIONS: usize = 64;

impl Zipf {
    /// `None` when `n` is 0 or `s` is negative or not finite.
    pub fn new(n: u64, s: f64) -> Option<Zipf> {
        if n == 0 || !s.is_finite() || s < 0.0 {
            return None;
        }
        Some(Zipf::build(n, s))
    }

    /// Like [`Zipf::new`], but clamps invalid input (n = 0 to 1; a negative or NaN exponent to 0).
    pub fn clamped(n: u64, s: f64) -> Zipf {
        let s = if s.is_finite() && s > 0.0 { s } else { 0.0 };
        Zipf::build(n.max(1), s)
    }

    fn build(n: u64, s: f64) -> Zipf {
        let mut z = Zipf {
            n,
            s,
            h_x1: 0.0,
            h_n: 0.0,
            shortcut: 0.0,
        };
        z.h_x1 = z.big_h(1.5) - 1.0;
        z.h_n = z.big_h(n as f64 + 0.5);
        z.shortcut = 2.0 - z.big_h_inv(z.big_h(2.5) - z.h(2.0));
        z
    }

    /// A rank in `1..=n`.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let mut k = 1;
        for _ in 0..MAX_REJECTIONS {
            let u = self.h_n + rng.next_f64() * (self.h_x1 - self.h_n);
            let x = self.big_h_inv(u);
            k = ((x + 0.5).floor() as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.shortcut || u >= self.big_h(kf + 0.5) - self.h(kf) {
                return k;
            }
        }
        k
    }

    /// The hat function x^-s.
    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// Integral of the hat: (x^(1-s) - 1) / (1 - s), which tends to ln x as s -> 1.
    fn big_h(&self, x: f64) -> f64 {
        let log_x = x.ln();
        expm1_over_x((1.0 - self.s) * log_x) * log_x
    }

    fn big_h_inv(&self, y: f64) -> f64 {
        let t = ((1.0 - self.s) * y).max(-1.0);
        (ln1p_over_x(t) * y).exp()
    }
}

/// expm1(x)/x, continuous at 0.
fn expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + x * 0.25))
    }
}

/// ln(1+x)/x, continuous at 0.
fn ln1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frequencies(n: u64, s: f64, draws: usize) -> Vec<f64> {
        let z = Zipf::new(n, s).expect("valid zipf");
        let mut rng = Rng::new(7);
        let mut counts = vec![0u64; n as usize + 1];
        for _ in 0..draws {
            let k = z.sample(&mut rng);
            assert!((1..=n).contains(&k), "rank {k} out of 1..={n}");
            counts[k as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    #[test]
    fn rank_one_beats_rank_ten_at_1_1() {
        let f = frequencies(1000, 1.1, 200_000);
        assert!(f[1] > f[10], "rank 1 {} vs rank 10 {}", f[1], f[10]);
        assert!(
            f[1] > 5.0 * f[10],
            "expected a steep head: {} vs {}",
            f[1],
            f[10]
        );
    }

    #[test]
    fn exponent_zero_is_uniform() {
        let n = 20;
        let f = frequencies(n, 0.0, 200_000);
        for (k, p) in f.iter().enumerate().skip(1) {
            assert!((p - 0.05).abs() < 0.005, "rank {k}: {p}");
        }
    }

    #[test]
    fn matches_exact_pmf() {
        for s in [0.3, 0.99, 1.0, 1.1, 2.5] {
            let n = 12;
            let norm: f64 = (1..=n).map(|k| (k as f64).powf(-s)).sum();
            let f = frequencies(n, s, 300_000);
            for k in 1..=n {
                let p = (k as f64).powf(-s) / norm;
                assert!(
                    (f[k as usize] - p).abs() < 0.006,
                    "s={s} rank {k}: got {} want {p}",
                    f[k as usize]
                );
            }
        }
    }

    #[test]
    fn huge_key_space_and_invalid_input() {
        let z = Zipf::new(1_000_000_000, 0.2).expect("valid");
        let mut rng = Rng::new(1);
        let max = (0..10_000).map(|_| z.sample(&mut rng)).max().unwrap_or(0);
        assert!(
            max > 1_000_000,
            "a flat zipf over 1e9 keys should reach far: {max}"
        );
        assert!(Zipf::new(0, 1.0).is_none());
        assert!(Zipf::new(10, -0.1).is_none());
        assert!(Zipf::new(10, f64::NAN).is_none());
    }

    #[test]
    fn rng_ranges() {
        let mut r = Rng::new(3);
        for _ in 0..10_000 {
            let v = r.range_i64(0, 23);
            assert!((0..=23).contains(&v));
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert_ne!(stream_seed(1, 1), stream_seed(1, 2));
    }
}
