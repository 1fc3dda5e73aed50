//! A small, stable pseudo-random generator (SplitMix64). The data windows and the embedded corpus
//! depend on it, so its output must never change between versions of a dependency.

#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for one (seed, stream, index) triple, independent of every other triple.
    pub fn for_stream(seed: u64, stream: u64, index: u64) -> Self {
        let mut g = Self(seed ^ 0x9E37_79B9_7F4A_7C15);
        let a = g.next_u64() ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut g = Self(a);
        Self(g.next_u64() ^ index.wrapping_mul(0xA24B_AED4_963E_E407))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        let x = self.next_u64();
        if (n as u64) < 1 << 32 {
            // Multiply-shift on the top 32 bits; bias below n / 2^32. (Kept as is: the embedded
            // corpus and every data window depend on these exact values.)
            (((x >> 32) * n as u64) >> 32) as usize
        } else {
            // Streams of 2^32 tokens or more: the same idea in 128 bits.
            ((x as u128 * n as u128) >> 64) as usize
        }
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() <= p
    }

    /// Uniform in [0, 1), 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The high 32 bits of the next value.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
}
