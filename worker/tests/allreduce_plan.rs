//! Property tests of the chunk and frame plans: exact, ordered cover for many (len, n),
//! including len < n and len 0 (burn's ring once produced the range 6..5 for 5 elements over 4).

use keel_worker::allreduce::{chunk_plan, frame_count, frame_plan, recv_chunk, send_chunk};
use rand::{RngExt, SeedableRng};

fn assert_exact_cover(len: usize, n: usize) {
    let chunks = chunk_plan(len, n);
    assert_eq!(chunks.len(), n, "len {len} n {n}");
    let mut next = 0;
    for c in &chunks {
        assert_eq!(c.start, next, "len {len} n {n}: gap or overlap at {c:?}");
        assert!(c.start <= c.end, "len {len} n {n}: reversed range {c:?}");
        next = c.end;
    }
    assert_eq!(next, len, "len {len} n {n}: cover ends at {next}");
    let (min, max) = chunks.iter().fold((usize::MAX, 0), |(lo, hi), c| {
        (lo.min(c.len()), hi.max(c.len()))
    });
    assert!(max - min <= 1, "len {len} n {n}: unbalanced {min}..{max}");
}

#[test]
fn chunk_plan_covers_exactly_for_small_cases() {
    for n in 1..=33 {
        for len in 0..=200 {
            assert_exact_cover(len, n);
        }
    }
    assert_eq!(chunk_plan(5, 4), vec![0..2, 2..3, 3..4, 4..5]);
    assert_eq!(chunk_plan(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
    assert!(chunk_plan(7, 0).is_empty());
}

#[test]
fn chunk_plan_covers_exactly_for_random_large_cases() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for _ in 0..2000 {
        let len = rng.random_range(0..200_000_000usize);
        let n = rng.random_range(1..=1024usize);
        assert_exact_cover(len, n);
    }
}

#[test]
fn frame_plan_covers_each_chunk_exactly() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for _ in 0..5000 {
        let start = rng.random_range(0..10_000usize);
        let len = rng.random_range(0..10_000usize);
        let frame = rng.random_range(0..3000usize);
        let frames: Vec<_> = frame_plan(start..start + len, frame).collect();
        assert_eq!(frames.len(), frame_count(&(start..start + len), frame));
        let mut next = start;
        for f in &frames {
            assert_eq!(f.start, next);
            assert!(f.start < f.end && f.len() <= frame.max(1));
            next = f.end;
        }
        assert_eq!(next, start + len);
    }
}

#[test]
fn ring_schedule_matches_neighbours_and_visits_every_chunk() {
    for n in 2..=12 {
        for rank in 0..n {
            let left = (rank + n - 1) % n;
            let mut rs: Vec<usize> = (0..n - 1).map(|t| recv_chunk(rank, n, t)).collect();
            let mut ag: Vec<usize> = (n - 1..2 * (n - 1))
                .map(|t| recv_chunk(rank, n, t))
                .collect();
            for t in 0..2 * (n - 1) {
                // What the left neighbour sends at step t is what this rank receives.
                assert_eq!(send_chunk(left, n, t), recv_chunk(rank, n, t));
            }
            // Reduce-scatter: a rank adds every chunk but its own successor's... once each.
            assert_eq!(send_chunk(rank, n, 0), rank, "starts with its own chunk");
            assert_eq!(
                recv_chunk(rank, n, n - 2),
                (rank + 1) % n,
                "ends owning chunk r+1"
            );
            rs.sort_unstable();
            rs.dedup();
            assert_eq!(rs.len(), n - 1);
            ag.sort_unstable();
            ag.dedup();
            assert_eq!(ag.len(), n - 1);
            assert!(
                !ag.contains(&((rank + 1) % n)),
                "never receives the chunk it finished"
            );
        }
    }
}
