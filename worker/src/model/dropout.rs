//! Reproducible dropout (Srivastava et al. 2014; HF: `nn.Dropout`, inverted: kept values are
//! scaled by `1 / (1 - p)`).
//!
//! The mask of one sequence at one dropout site is a pure function of
//! `(seed, step, sample_id, layer, site)` and of the element's position in the sequence (not
//! of the padded length or of the row in the micro-batch), so a sample gets the same dropout
//! whatever the world size or micro-batch split. Masks are never stored: the backward
//! regenerates them from the same key (a counter-based hash, splitmix64's finaliser).

use super::Element;

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

/// The mask stream of one sequence at one site.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mask {
    stream: u64,
    /// Values `< threshold` (of 32 random bits) are dropped: `round(p * 2^32)`.
    threshold: u64,
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
        Mask {
            stream: s,
            threshold: (p * 4_294_967_296.0).round() as u64,
            scale: 1.0 / (1.0 - p),
        }
    }

    /// `x[j] = keep(first + j) ? x[j] / (1 - p) : 0`: the forward, and also the backward (the
    /// gradient passes through the same mask and scale).
    pub fn apply<A: Element>(&self, x: &mut [A], first: u64) {
        let scale = A::of(self.scale);
        for (j, v) in x.iter_mut().enumerate() {
            let i = first + j as u64;
            let bits = mix(self.stream.wrapping_add((i >> 1).wrapping_mul(GOLDEN)));
            let r = if i & 1 == 0 {
                bits & 0xffff_ffff
            } else {
                bits >> 32
            };
            *v = if r >= self.threshold {
                *v * scale
            } else {
                A::zero()
            };
        }
    }
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
