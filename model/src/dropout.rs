//! Reproducible dropout (Srivastava et al. 2014; HF: `nn.Dropout`, inverted: kept values are
//! scaled by `1 / (1 - p)`).
//!
//! The mask of one sequence at one dropout site is a pure function of
//! `(seed, step, sample_id, layer, site)` and of the element's position in the sequence (not
//! of the padded length or of the row in the micro-batch), so a sample gets the same dropout
//! whatever the world size or micro-batch split. Masks are never stored: the backward
//! regenerates them from the same key. The per-sequence key is mixed with splitmix64's
//! finaliser; each element's 32 random bits are two rounds of murmur3's `fmix32` over its
//! index, which vectorises (AVX-512 or AVX2, picked at run time).

use super::Element;
use super::packing::Packing;
use super::pass_profile::{Pass, bytes, region};

/// Training-mode dropout key: the job's seed and the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    /// The job's random seed.
    pub seed: u64,
    /// The optimizer step (0-based).
    pub step: u64,
}

/// Which dropout of the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    /// After the embeddings LayerNorm (HF: `BertEmbeddings.dropout`).
    Embeddings = 1,
    /// On the attention probabilities (HF: `BertSelfAttention.dropout`).
    AttentionProbs = 2,
    /// After the attention output projection (HF: `BertSelfOutput.dropout`).
    AttentionOutput = 3,
    /// After the feed-forward output projection (HF: `BertOutput.dropout`).
    FeedForwardOutput = 4,
}

/// splitmix64's output function (Steele et al. 2014): a bijective 64-bit mixer.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// murmur3's 32-bit finaliser (Appleby 2011): a bijective mixer.
#[inline(always)]
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// The mask stream of one sequence at one site.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mask {
    /// Two 32-bit keys from the mixed `(seed, step, sample_id, layer, site)`.
    keys: (u32, u32),
    /// Values `< threshold` (of 32 random bits) are dropped: `round(p * 2^32)`.
    threshold: u32,
    /// `1 / (1 - p)`.
    scale: f64,
}

impl Mask {
    /// The mask of sequence `sample_id` at `(layer, site)`, dropping with probability `p`.
    pub fn new(key: DropoutKey, sample_id: u64, layer: usize, site: Site, p: f64) -> Mask {
        let mut s = mix(key.seed ^ 0x6b65_656c_6472_6f70); // "keeldrop"
        s = mix(s ^ key.step.wrapping_mul(GOLDEN));
        s = mix(s ^ sample_id.wrapping_mul(GOLDEN));
        s = mix(s ^ ((layer as u64) << 8 | site as u64));
        let threshold = (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
        Mask {
            keys: (s as u32, (s >> 32) as u32),
            threshold,
            scale: 1.0 / (1.0 - p),
        }
    }

    /// `x[j] = keep(first + j) ? x[j] / (1 - p) : 0`: the forward, and also the backward (the
    /// gradient passes through the same mask and scale). Element indices must stay below 2^32.
    pub fn apply<A: Element>(&self, x: &mut [A], first: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F.
                return unsafe { self.apply_avx512(x, first) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                return unsafe { self.apply_avx2(x, first) };
            }
        }
        self.apply_body(x, first)
    }

    /// The same loop, 16 lanes wide (integer hashing: the same bits at any width).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2")]
    fn apply_avx512<A: Element>(&self, x: &mut [A], first: u64) {
        self.apply_body(x, first)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn apply_avx2<A: Element>(&self, x: &mut [A], first: u64) {
        self.apply_body(x, first)
    }

    /// 64 elements at a time: each element's hash is a chain of ~14 dependent integer
    /// operations (4 of them 10-cycle multiplies), and four vectors in flight let the core
    /// overlap their latencies (as `super::vmath`'s loops).
    #[inline(always)]
    fn apply_body<A: Element>(&self, x: &mut [A], first: u64) {
        const LANES: usize = 64;
        let scale = A::of(self.scale);
        let (k0, k1, threshold) = (self.keys.0, self.keys.1, self.threshold);
        let first = first as u32;
        let step = |v: &mut A, j: usize| {
            let i = first.wrapping_add(j as u32);
            let r = fmix32(fmix32(i.wrapping_mul(0x9e37_79b9) ^ k0) ^ k1);
            *v = if r >= threshold {
                *v * scale
            } else {
                A::zero()
            };
        };
        let done = x.len() / LANES * LANES;
        let mut chunks = x.chunks_exact_mut(LANES);
        for (c, block) in (&mut chunks).enumerate() {
            for (j, v) in block.iter_mut().enumerate() {
                step(v, c * LANES + j);
            }
        }
        for (j, v) in chunks.into_remainder().iter_mut().enumerate() {
            step(v, done + j);
        }
    }
}

/// Hidden-state dropout of every sequence of a batch, in place on `x` `[rows, c]` laid out
/// by `packing` (sequence `i`'s rows keyed by `sample_ids[i]`, its element `j` at index `j`
/// of its mask stream, so padded and packed rows get the same masks), split among the
/// model's threads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_sequences<A: Element>(
    x: &mut [A],
    c: usize,
    packing: &Packing,
    key: DropoutKey,
    sample_ids: &[u64],
    layer: usize,
    site: Site,
    p: f64,
) {
    let rows = packing.rows() * c;
    let _region = region(Pass::Dropout, bytes::<A>(rows), bytes::<A>(rows));
    packing.for_each_sequence(x, c, |i, seq| {
        Mask::new(key, sample_ids[i], layer, site, p).apply(seq, 0);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_about_p_and_is_reproducible() {
        let key = DropoutKey { seed: 7, step: 3 };
        let m = Mask::new(key, 42, 1, Site::AttentionProbs, 0.1);
        let mut a = vec![1.0f64; 100_000];
        m.apply(&mut a, 0);
        let dropped = a.iter().filter(|&&v| v == 0.0).count();
        assert!((9_000..11_000).contains(&dropped), "{dropped}");
        assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.9).abs() < 1e-12));
        // Same key, a sub-range starting elsewhere: identical values.
        let mut b = vec![1.0f64; 1000];
        m.apply(&mut b, 500);
        assert_eq!(&a[500..1500], &b[..]);
        // Another sample: a different mask.
        let mut c = vec![1.0f64; 1000];
        Mask::new(key, 43, 1, Site::AttentionProbs, 0.1).apply(&mut c, 500);
        assert_ne!(&b, &c);
    }
}
