//! Padding rows left out of the computation ("unpadding"; the idea of Krell et al. 2021,
//! "Efficient Sequence Packing without Cross-contamination", and of NVIDIA's and
//! FlashAttention's variable-length BERT kernels).
//!
//! A batch is `[b, t]`, each sequence's real tokens first and padding after them. Every op of
//! the model but attention works row by row (the Linears, LayerNorm, the activation, dropout
//! keyed per sequence and element), and a padding row never reaches a real one: attention
//! gives padded keys probability exactly 0 and no head reads a padding row. So in the padded
//! layout the padding rows are dead work, and their gradients are exactly 0 (nothing reads
//! them, so nothing sends a gradient back to them). [`Packing`] lists each sequence's real rows
//! back to back (`[n_real, c]`, sequence `i` at rows `starts[i]..starts[i] + lens[i]`);
//! attention, which needs each sequence's `t` rows at a fixed stride, gets its inputs
//! scattered into the padded layout (`[b * t, c]`, padding rows 0) and its output gathered
//! back. On the time-to-quality corpus (`examples/ttq-mini.toml`: fortunes and verses cut into
//! sequences of at most 32 tokens) 17% of the padded rows are padding.
//!
//! Same math as the padded layout: the real rows see the same values, so losses and
//! gradients differ only in the rounding of GEMMs whose blocking depends on the row count
//! (`tests/unpadding.rs` and `tests/unpadding_threads.rs` compare the two).
//!
//! Not packed (the padded rows are used as they are, [`Packing::is_identity`]): batches
//! without padding, a mask that is not real tokens followed by padding, a sequence with no
//! real token, or a masked position on padding. Those keep exactly the old layout.

use super::pass_profile::{Pass, bytes, region};
use std::ops::Range;

use super::Element;
use super::parallel;

/// Fewest elements worth a thread of their own in a copy or dropout pass.
const MIN_ELEMENTS_PER_THREAD: usize = 1 << 15;

/// What the model rounds its packed rows up to by default (`super::Bert::set_unpadding`).
/// Each row count is a new GEMM shape, for which oneDNN compiles a primitive (0.1 to several
/// ms); rounding keeps a job's shapes to a handful. Exact counts (a new one every batch, two
/// alternating in `keel-worker bench`) also ran slower: a mini bf16 step with 17% padding
/// saved 6% with them and 9-13% rounded to 64 (Intel Xeon with AMX, 2026-12-04).
pub const DEFAULT_ROW_MULTIPLE: usize = 64;

/// The rows one batch is computed on. Buffers are reused from batch to batch.
#[derive(Debug, Default)]
pub(crate) struct Packing {
    /// Sequences `b`.
    b: usize,
    /// Padded length `t`.
    t: usize,
    /// `[b + 1]`: first row of sequence `i` (its `[CLS]` row) at `starts[i]`, `starts[b]` rows.
    starts: Vec<usize>,
    /// `[rows]`: each row's flat index `i * t + col` in the padded `[b, t]` batch.
    padded: Vec<usize>,
    /// `[m]`: each masked position's row.
    positions: Vec<usize>,
    /// True when the rows are the padded rows themselves.
    identity: bool,
}

impl Packing {
    /// Plans the rows of a `[b, t]` batch with `mask` `[b, t]` (1 = real token) and masked
    /// positions (flat `i * t + col`, `[m]`): the real rows, rounded up to a multiple of
    /// `pack` rows. `pack: None`, a batch that cannot be packed (module docs), or one whose
    /// rounded rows would not be fewer than `b * t`, gives the padded rows.
    pub fn plan(&mut self, mask: &[u8], b: usize, t: usize, masked: &[usize], pack: Option<usize>) {
        self.b = b;
        self.t = t;
        self.identity = !pack.is_some_and(|multiple| self.plan_packed(mask, masked, multiple));
        if self.identity {
            // A packed plan given up half way leaves its rows behind.
            self.clear();
            self.starts.extend((0..=b).map(|i| i * t));
            self.padded.extend(0..b * t);
            self.positions.extend_from_slice(masked);
        }
    }

    fn clear(&mut self) {
        self.starts.clear();
        self.padded.clear();
        self.positions.clear();
    }

    /// Fills the packed plan; false when the batch has no padding or cannot be packed.
    fn plan_packed(&mut self, mask: &[u8], masked: &[usize], multiple: usize) -> bool {
        self.clear();
        let (b, t) = (self.b, self.t);
        if mask.len() != b * t || mask.iter().all(|&m| m != 0) {
            return false;
        }
        self.starts.push(0);
        for seq in mask.chunks_exact(t.max(1)).take(b) {
            let len = seq.iter().take_while(|&&m| m != 0).count();
            if len == 0 || seq[len..].iter().any(|&m| m != 0) {
                return false;
            }
            let i = self.starts.len() - 1;
            self.padded.extend(i * t..i * t + len);
            self.starts.push(self.padded.len());
        }
        for &p in masked {
            let (i, col) = (p / t, p % t);
            if i >= b || col >= self.starts[i + 1] - self.starts[i] {
                return false;
            }
            self.positions.push(self.starts[i] + col);
        }
        let rows = self.padded.len().next_multiple_of(multiple.max(1));
        if rows >= b * t {
            return false;
        }
        // Spare rows up to the multiple, in no sequence: they compute a padding token's
        // embedding, nothing reads them, and their gradients are 0 (`gather` writes 0 there).
        let pad = mask.iter().position(|&m| m == 0).unwrap_or(0);
        self.padded.resize(rows, pad);
        true
    }

    /// Rows computed: `b * t`, or when packed the real tokens' rows rounded up to the plan's
    /// multiple (the spare rows after the last sequence's).
    pub fn rows(&self) -> usize {
        self.padded.len()
    }

    /// True when the rows are the padded batch's own (nothing to scatter or gather).
    pub fn is_identity(&self) -> bool {
        self.identity
    }

    /// `[rows]`: each row's flat index in the padded `[b, t]` batch.
    pub fn padded_index(&self) -> &[usize] {
        &self.padded
    }

    /// `[m]`: the row of each masked position given to [`Packing::plan`].
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// `[b]`: the first row of each sequence (its `[CLS]`).
    pub fn firsts(&self) -> &[usize] {
        &self.starts[..self.b]
    }

    /// Rows of sequence `i`.
    fn seq(&self, i: usize) -> Range<usize> {
        self.starts[i]..self.starts[i + 1]
    }

    /// Runs `f(i, rows_of_sequence_i)` over `x` `[rows, c]`, sequences split among the
    /// model's threads.
    pub fn for_each_sequence<A: Element>(
        &self,
        x: &mut [A],
        c: usize,
        f: impl Fn(usize, &mut [A]) + Sync,
    ) {
        let mut rest = &mut x[..self.rows() * c];
        let mut work = Vec::new();
        for part in self.parts(c) {
            let len = (self.starts[part.end] - self.starts[part.start]) * c;
            let (mine, tail) = rest.split_at_mut(len);
            rest = tail;
            work.push((part, mine));
        }
        parallel::run_parts(work, |(part, mut x)| {
            for i in part {
                let (seq, tail) = x.split_at_mut(self.seq(i).len() * c);
                f(i, seq);
                x = tail;
            }
        });
    }

    /// `padded` `[b * t, c]` from `packed` `[rows, c]`: each sequence's rows in place, its
    /// padding rows 0.
    pub fn scatter<A: Element>(&self, packed: &[A], padded: &mut [A], c: usize) {
        let tc = self.t * c;
        let _region = region(
            Pass::Packing,
            bytes::<A>(self.rows() * c),
            bytes::<A>(self.b * tc),
        );
        let padded = &mut padded[..self.b * tc];
        let mut rest = padded;
        let mut work = Vec::new();
        for part in self.parts(c) {
            let (mine, tail) = rest.split_at_mut(part.len() * tc);
            rest = tail;
            work.push((part, mine));
        }
        parallel::run_parts(work, |(part, out)| {
            for (i, seq) in part.zip(out.chunks_exact_mut(tc)) {
                let rows = self.seq(i);
                let real = rows.len() * c;
                seq[..real].copy_from_slice(&packed[rows.start * c..rows.end * c]);
                seq[real..].fill(A::zero());
            }
        });
    }

    /// `packed` `[rows, c]` from the real rows of `padded` `[b * t, c]`; the spare rows 0.
    pub fn gather<A: Element>(&self, padded: &[A], packed: &mut [A], c: usize) {
        let tc = self.t * c;
        let _region = region(
            Pass::Packing,
            bytes::<A>(self.rows() * c),
            bytes::<A>(self.rows() * c),
        );
        self.for_each_sequence(packed, c, |i, seq| {
            seq.copy_from_slice(&padded[i * tc..i * tc + seq.len()]);
        });
        packed[self.starts[self.b] * c..self.rows() * c].fill(A::zero());
    }

    /// Sequences cut into contiguous parts of about equal rows, one per thread (at least
    /// [`MIN_ELEMENTS_PER_THREAD`] elements each).
    fn parts(&self, c: usize) -> Vec<Range<usize>> {
        let threads = parallel::available_threads().min(self.rows() * c / MIN_ELEMENTS_PER_THREAD);
        self.parts_among(threads)
    }

    /// Sequences cut into at most `threads` contiguous parts of about equal rows.
    fn parts_among(&self, threads: usize) -> Vec<Range<usize>> {
        let threads = threads.max(1);
        if threads == 1 || self.b == 0 {
            return std::iter::once(0..self.b).collect();
        }
        // Cut by the sequences' rows (the spare rows after them belong to no part).
        let real = self.starts[self.b];
        let mut parts = Vec::with_capacity(threads);
        let mut first = 0;
        for p in 1..threads {
            let target = real * p / threads;
            let end = self
                .starts
                .partition_point(|&s| s < target)
                .clamp(first, self.b);
            if end > first {
                parts.push(first..end);
                first = end;
            }
        }
        if first < self.b {
            parts.push(first..self.b);
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[b, t]` mask with these real lengths.
    fn mask(lens: &[usize], t: usize) -> Vec<u8> {
        lens.iter()
            .flat_map(|&l| (0..t).map(move |j| u8::from(j < l)))
            .collect()
    }

    #[test]
    fn packs_real_rows_back_to_back() {
        let mut p = Packing::default();
        p.plan(&mask(&[3, 1, 4], 4), 3, 4, &[1, 4, 10], Some(1));
        assert!(!p.is_identity());
        assert_eq!(p.rows(), 8);
        assert_eq!(p.padded_index(), &[0, 1, 2, 4, 8, 9, 10, 11]);
        assert_eq!(p.firsts(), &[0, 3, 4]);
        assert_eq!(p.positions(), &[1, 3, 6]);
    }

    #[test]
    fn keeps_the_padded_rows_where_it_cannot_pack() {
        let t = 4;
        let cases: [(&str, Vec<u8>, Vec<usize>); 4] = [
            ("no padding", mask(&[4, 4], t), vec![0]),
            (
                "padding before a real token",
                vec![1, 0, 1, 0, 1, 1, 1, 1],
                vec![0],
            ),
            ("a sequence of padding only", mask(&[0, 4], t), vec![5]),
            ("a masked position on padding", mask(&[2, 4], t), vec![3]),
        ];
        for (what, m, masked) in cases {
            let mut p = Packing::default();
            p.plan(&m, 2, t, &masked, Some(1));
            assert!(p.is_identity(), "{what}");
            assert_eq!(p.rows(), 8, "{what}");
            assert_eq!(p.positions(), &masked[..], "{what}");
            assert_eq!(p.firsts(), &[0, 4], "{what}");
        }
        let mut p = Packing::default();
        p.plan(&mask(&[1, 2], t), 2, t, &[], None);
        assert!(p.is_identity(), "pack: None");
        p.plan(&mask(&[1, 2], t), 2, t, &[], Some(8));
        assert!(
            p.is_identity(),
            "3 real rows rounded up to 8: no fewer than 2 x 4"
        );
    }

    #[test]
    fn spare_rows_round_up_and_gather_to_zero() {
        let (t, c) = (8, 2);
        let mut p = Packing::default();
        p.plan(&mask(&[3, 2, 1, 8], t), 4, t, &[24], Some(4));
        assert!(!p.is_identity());
        assert_eq!(p.rows(), 16, "14 real rows rounded up to 16");
        assert_eq!(p.positions(), &[6]);
        assert_eq!(
            &p.padded_index()[14..],
            &[3, 3],
            "spare rows: the first padding token"
        );
        let padded = vec![1.0f64; 4 * t * c];
        let mut packed = vec![f64::NAN; 16 * c];
        p.gather(&padded, &mut packed, c);
        assert!(packed[..14 * c].iter().all(|&v| v == 1.0));
        assert!(packed[14 * c..].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn scatter_then_gather_gives_back_the_rows_and_zero_padding() {
        let (t, c) = (5, 3);
        let lens = [5, 2, 1, 4];
        let mut p = Packing::default();
        p.plan(&mask(&lens, t), lens.len(), t, &[], Some(1));
        let packed: Vec<f64> = (0..p.rows() * c).map(|x| x as f64 + 1.0).collect();
        let mut padded = vec![f64::NAN; lens.len() * t * c];
        p.scatter(&packed, &mut padded, c);
        for (i, &len) in lens.iter().enumerate() {
            for col in 0..t {
                let row = &padded[(i * t + col) * c..(i * t + col + 1) * c];
                if col < len {
                    let r = p.firsts()[i] + col;
                    assert_eq!(row, &packed[r * c..(r + 1) * c]);
                } else {
                    assert!(row.iter().all(|&v| v == 0.0), "padding row {i},{col}");
                }
            }
        }
        let mut back = vec![0.0; p.rows() * c];
        p.gather(&padded, &mut back, c);
        assert_eq!(back, packed);
    }

    #[test]
    fn parts_cover_every_sequence_once() {
        let lens: Vec<usize> = (0..37).map(|i| 1 + (i * 7) % 32).collect();
        let mut p = Packing::default();
        p.plan(&mask(&lens, 32), lens.len(), 32, &[], Some(1));
        for threads in 1..5 {
            let parts = p.parts_among(threads);
            let mut next = 0;
            for r in &parts {
                assert_eq!(r.start, next);
                assert!(!r.is_empty());
                next = r.end;
            }
            assert_eq!(next, lens.len());
            assert!(parts.len() == threads, "{threads} threads: {parts:?}");
        }
        // Many spare rows (9 real rows rounded up to 64): still no empty part.
        p.plan(&mask(&[3, 3, 3], 32), 3, 32, &[], Some(64));
        assert_eq!(p.rows(), 64);
        for threads in 1..5 {
            let parts = p.parts_among(threads);
            assert!(
                parts.iter().all(|r| !r.is_empty()),
                "{threads} threads: {parts:?}"
            );
            assert_eq!(parts.last().map(|r| r.end), Some(3));
        }
    }
}
