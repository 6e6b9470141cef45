//! Which elements of the flat parameter buffer this rank's optimizer owns: ZeRO stage 1,
//! optimizer-state partitioning `P_os` (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
//! Toward Training Trillion Parameter Models", section 5.1).
//!
//! Each of the `W` ranks owns a set of disjoint element ranges of the buffer `[P]` (the chunks
//! the ring's reduce-scatter leaves reduced on it), keeps the moments for those elements only,
//! in one compact buffer `[L]` (`L` = [`ShardPlan::local_len`], about `P / W`), and updates only
//! those parameters; the all-gather then hands every rank the others' updated elements.
//!
//! Shapes: `P` = `ParamLayout::total_len()`, `L` = the rank's owned element count, `E` = the
//! number of layout entries (tensors).

use std::ops::Range;

use keel_proto::params::ParamLayout;

/// One piece of a layout entry that this rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The elements in the flat buffer `[P]` (inside one entry, never empty).
    pub global: Range<usize>,
    /// Where they start in the rank's compact buffers `[L]` (moments, update scratch).
    pub local: usize,
    /// Index of the entry in `layout.entries()` (LAMB's trust ratio is per entry).
    pub entry: usize,
    /// The entry's weight-decay flag (`ParamView::decay`).
    pub decay: bool,
}

impl Segment {
    /// The segment's elements in the compact buffers `[L]`.
    pub fn local_range(&self) -> Range<usize> {
        self.local..self.local + self.global.len()
    }
}

/// The elements of `[P]` one rank's optimizer owns, as segments in buffer order.
///
/// Invariants: segments are non-empty, each lies inside one layout entry, they are in
/// increasing buffer order without overlap, their local offsets are consecutive from 0 (so
/// `L` is the sum of their lengths), and two pieces of one entry that touch are one segment.
/// Hence a plan owning every element ([`ShardPlan::is_full`]) has exactly one segment per
/// non-empty entry, with `local == global.start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// The owned pieces, in buffer order.
    segments: Vec<Segment>,
    /// `L`: the owned element count, the length of the compact buffers.
    local_len: usize,
    /// `P`: the flat buffer's length.
    total_len: usize,
    /// Each layout entry's decay flag, `[E]`: every rank computes every entry's trust ratio,
    /// including entries it owns no element of.
    entry_decay: Vec<bool>,
}

impl ShardPlan {
    /// The whole buffer: one segment per non-empty entry, `local == global.start`
    /// (an unsharded optimizer).
    pub fn full(layout: &ParamLayout) -> ShardPlan {
        ShardPlan::owned(layout, std::slice::from_ref(&(0..layout.total_len())))
    }

    /// The elements `owned` of `layout`'s buffer: the non-empty intersections of the ranges
    /// with the layout's entries, in buffer order, numbered consecutively from 0 in the compact
    /// buffers. The ranges may cut entries anywhere and may be empty.
    ///
    /// Panics (a caller's bug: the ranges come from the ring's chunk plan, never from input)
    /// when `owned` is not sorted and disjoint (each range starting at or after the previous
    /// one's end) or a range ends past `layout.total_len()` or is reversed.
    pub fn owned(layout: &ParamLayout, owned: &[Range<usize>]) -> ShardPlan {
        let total_len = layout.total_len();
        let entries = layout.entries();
        let mut segments: Vec<Segment> = Vec::new();
        let mut local_len = 0;
        let mut prev_end = 0;
        // Index of the first entry that may meet the next range (entries tile [0, P) in order).
        let mut first = 0;
        for r in owned {
            assert!(
                r.start <= r.end && r.start >= prev_end && r.end <= total_len,
                "owned ranges must be sorted, disjoint and inside [0, {total_len}): {r:?} after \
                 {prev_end}"
            );
            prev_end = r.end;
            if r.is_empty() {
                continue;
            }
            while first < entries.len() && entries[first].range().end <= r.start {
                first += 1;
            }
            for (i, e) in entries.iter().enumerate().skip(first) {
                let er = e.range();
                if er.start >= r.end {
                    break;
                }
                let global = er.start.max(r.start)..er.end.min(r.end);
                if global.is_empty() {
                    continue;
                }
                let len = global.len();
                match segments.last_mut() {
                    Some(last) if last.entry == i && last.global.end == global.start => {
                        last.global.end = global.end;
                    }
                    _ => segments.push(Segment {
                        global,
                        local: local_len,
                        entry: i,
                        decay: e.decay,
                    }),
                }
                local_len += len;
            }
        }
        ShardPlan {
            segments,
            local_len,
            total_len,
            entry_decay: entries.iter().map(|e| e.decay).collect(),
        }
    }

    /// The owned pieces, in buffer order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// `L`: how many elements this rank owns (the compact buffers' length).
    pub fn local_len(&self) -> usize {
        self.local_len
    }

    /// `P`: the flat buffer's length.
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// `E`: the number of layout entries.
    pub fn entries(&self) -> usize {
        self.entry_decay.len()
    }

    /// The decay flag of layout entry `entry` (`ParamView::decay`). Panics if out of range.
    pub fn entry_decay(&self, entry: usize) -> bool {
        self.entry_decay[entry]
    }

    /// Whether this rank owns every element (then `[L]` is `[P]`, element for element).
    pub fn is_full(&self) -> bool {
        self.local_len == self.total_len
    }

    /// The owned elements of `full` `[P]`, compacted: `[L]`.
    ///
    /// Panics if `full` is not `[P]` (a caller's bug).
    pub fn extract<A: Copy>(&self, full: &[A]) -> Vec<A> {
        assert_eq!(full.len(), self.total_len, "extract wants a [P] buffer");
        let mut out = Vec::with_capacity(self.local_len);
        for s in &self.segments {
            out.extend_from_slice(&full[s.global.clone()]);
        }
        out
    }

    /// Writes `local` `[L]` to its positions in `full` `[P]`; other elements are untouched.
    ///
    /// Panics if the lengths are not `[L]` and `[P]` (a caller's bug).
    pub fn scatter_into<A: Copy>(&self, local: &[A], full: &mut [A]) {
        assert_eq!(
            local.len(),
            self.local_len,
            "scatter_into wants an [L] buffer"
        );
        assert_eq!(
            full.len(),
            self.total_len,
            "scatter_into wants a [P] buffer"
        );
        for s in &self.segments {
            full[s.global.clone()].copy_from_slice(&local[s.local_range()]);
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use keel_proto::config::BertConfig;

    fn layout() -> ParamLayout {
        let config = BertConfig::preset("tiny", 1000).expect("tiny");
        ParamLayout::bert(&config, config.heads())
    }

    /// `allreduce::plan::chunk_plan`, copied: `len` elements in `world` near-equal chunks.
    fn chunk_plan(len: usize, world: usize) -> Vec<Range<usize>> {
        let (base, extra) = (len / world, len % world);
        (0..world)
            .map(|i| {
                let start = i * base + i.min(extra);
                start..start + base + usize::from(i < extra)
            })
            .collect()
    }

    /// Rank `rank`'s ranges when `[0, total)` is cut into uneven buckets (one tiny, so some
    /// chunks are empty) and, as after a ring's reduce-scatter, rank `r` holds chunk
    /// `(r + 1) % world` of each.
    pub(crate) fn ring_owned(total: usize, world: usize, rank: usize) -> Vec<Range<usize>> {
        let cuts = [
            0,
            1,
            70_001,
            total / 3 + 17,
            total / 3 + 18,
            total - 5000,
            total,
        ];
        cuts.windows(2)
            .map(|w| {
                let chunk = chunk_plan(w[1] - w[0], world)[(rank + 1) % world].clone();
                w[0] + chunk.start..w[0] + chunk.end
            })
            .collect()
    }

    #[test]
    fn the_full_plan_is_the_layout() {
        let layout = layout();
        let plan = ShardPlan::full(&layout);
        assert!(plan.is_full());
        assert_eq!(plan.local_len(), layout.total_len());
        assert_eq!(plan.entries(), layout.entries().len());
        assert_eq!(plan.segments().len(), layout.entries().len());
        for (s, e) in plan.segments().iter().zip(layout.entries()) {
            assert_eq!(
                (s.global.clone(), s.local, s.decay),
                (e.range(), e.offset, e.decay)
            );
        }
        // Owning the buffer in pieces that touch is the same plan.
        let p = layout.total_len();
        let pieces = [0..10, 10..10, 10..p / 2, p / 2..p];
        assert_eq!(ShardPlan::owned(&layout, &pieces), plan);
    }

    #[test]
    fn ring_shards_cover_every_element_once() {
        let layout = layout();
        let p = layout.total_len();
        let full: Vec<u64> = (0..p as u64).collect();
        for world in [2, 3] {
            let mut seen = vec![0u8; p];
            let mut merged = vec![u64::MAX; p];
            let mut local_sum = 0;
            for rank in 0..world {
                let plan = ShardPlan::owned(&layout, &ring_owned(p, world, rank));
                assert!(!plan.is_full());
                let mut next_local = 0;
                let mut prev_end = 0;
                for s in plan.segments() {
                    let e = &layout.entries()[s.entry];
                    assert!(!s.global.is_empty() && s.global.start >= prev_end);
                    assert!(e.range().start <= s.global.start && s.global.end <= e.range().end);
                    assert_eq!((s.local, s.decay), (next_local, e.decay));
                    next_local += s.global.len();
                    prev_end = s.global.end;
                    seen[s.global.clone()].iter_mut().for_each(|c| *c += 1);
                }
                assert_eq!(plan.local_len(), next_local);
                assert!(
                    plan.local_len().abs_diff(p / world) < 5 * world,
                    "about P / W"
                );
                local_sum += plan.local_len();
                let local = plan.extract(&full);
                assert_eq!(local.len(), plan.local_len());
                plan.scatter_into(&local, &mut merged);
            }
            assert_eq!(local_sum, p);
            assert!(seen.iter().all(|&c| c == 1), "W = {world}: exact cover");
            assert_eq!(
                merged, full,
                "W = {world}: extract / scatter_into round-trip"
            );
        }
    }

    #[test]
    fn scatter_into_leaves_other_elements_alone() {
        let layout = layout();
        let p = layout.total_len();
        // Entry 0 (word embeddings) is [0, 128000).
        let plan = ShardPlan::owned(&layout, &[5..20, 127_995..128_005]);
        assert_eq!(
            plan.segments().len(),
            3,
            "the second range crosses an entry boundary"
        );
        assert_eq!(plan.local_len(), 25);
        let mut full = vec![-1i32; p];
        plan.scatter_into(&(0..25).collect::<Vec<i32>>(), &mut full);
        assert_eq!(full[4..6], [-1, 0]);
        assert_eq!(full[19..21], [14, -1]);
        assert_eq!(full[127_994..127_996], [-1, 15]);
        assert_eq!(full[128_004..128_006], [24, -1]);
        assert_eq!(full.iter().filter(|&&x| x >= 0).count(), 25);
    }

    #[test]
    #[should_panic(expected = "sorted, disjoint")]
    fn overlapping_ranges_are_a_bug() {
        ShardPlan::owned(&layout(), &[0..10, 5..20]);
    }
}
