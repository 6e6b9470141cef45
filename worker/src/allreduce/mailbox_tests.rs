//! Unit tests of [`super::Mailbox`]: which frames it refuses, what it holds and when it lets go.

use std::time::Duration;

use super::*;

/// World 2, rank 0, frames of 4 f32: at ring step 0 rank 0 receives chunk 1.
const SHAPE: RingShape = RingShape {
    world_size: 2,
    rank: 0,
    frame_elems: 4,
};

/// The one planned frame of ring step `ring_step` of an all-reduce of 8 f32 (chunk 1, 4..8, at
/// ring step 0; chunk 0 at ring step 1).
fn frame_at(step: u64, bucket: u32, ring_step: u32) -> RingFrame {
    RingFrame {
        job_id: "job-1".into(),
        generation: 1,
        step,
        bucket,
        sender_rank: 1,
        ring_step,
        total_len: 8,
        offset: if ring_step == 0 { 4 } else { 0 },
        data: vec![0u8; 16].into(),
        dtype: WireDtype::F32.into(),
        collective: 0,
    }
}

fn frame(step: u64, bucket: u32) -> RingFrame {
    frame_at(step, bucket, 0)
}

#[tokio::test]
async fn frames_of_an_all_reduce_that_cannot_exist_are_refused_not_buffered() {
    let mailbox = Mailbox::new();
    mailbox.join("job-1", 1, SHAPE).unwrap();
    // Before the first local all-reduce any step may come first (a resumed job).
    mailbox.deliver(frame(40, 0)).await.unwrap();
    assert_eq!(mailbox.held_bytes(), 16);
    let _inbox = mailbox
        .open("job-1", 1, 5, 0, 8, WireDtype::F32, Collective::AllReduce)
        .unwrap();
    // Step 40 is out of reach from step 5: what was held for it is gone.
    assert_eq!(mailbox.held_bytes(), 0);
    for (step, bucket) in [(3, 9), (1000, 0), (8, 0), (7, 0), (40, 0)] {
        let err = mailbox.deliver(frame(step, bucket)).await.unwrap_err();
        assert!(
            matches!(err, FrameRejected::UnknownAllReduce { newest: 5, .. }),
            "step {step} bucket {bucket}: {err}"
        );
    }
    for (step, bucket) in [(4, 9), (5, 1), (6, 0)] {
        mailbox.deliver(frame(step, bucket)).await.unwrap();
    }
    assert_eq!(mailbox.held_bytes(), 3 * 16);
    // A new generation starts afresh, and drops what the old one held ahead.
    mailbox.join("job-1", 2, SHAPE).unwrap();
    assert_eq!(mailbox.held_bytes(), 0);
    let mut f = frame(0, 0);
    f.generation = 2;
    mailbox.deliver(f).await.unwrap();
}

#[tokio::test]
async fn frames_the_plan_does_not_expect_are_refused_naming_why_and_hold_nothing() {
    let mailbox = Mailbox::new();
    mailbox.join("job-1", 1, SHAPE).unwrap();
    let _running = mailbox
        .open("job-1", 1, 1, 0, 8, WireDtype::F32, Collective::AllReduce)
        .unwrap();
    let shifted = RingFrame {
        offset: 3,
        ..frame(1, 0)
    };
    let short = RingFrame {
        data: vec![0u8; 12].into(),
        ..frame(1, 0)
    };
    let past_the_ring = frame_at(1, 0, 2);
    // Not started here: only ring step 0 (the reduce-scatter of world 2) can come first.
    let too_early = frame_at(2, 0, 1);
    for (f, says) in [
        (shifted, "elements 3..7 at ring step 0"),
        (short, "elements 4..7 at ring step 0"),
        (past_the_ring, "ring step 2 out of range"),
        (too_early, "ring step 1 before this worker started"),
    ] {
        let err = mailbox.deliver(f).await.unwrap_err();
        assert!(
            matches!(err, FrameRejected::Unplanned { .. }) && err.to_string().contains(says),
            "{err}"
        );
    }
    assert_eq!(mailbox.held_bytes(), 0);

    // Each planned frame once: a second copy is refused. Before its all-reduce starts, a frame
    // of another length is held apart (its own plan), not refused: see
    // `a_forged_first_frame_of_another_length_does_not_get_the_real_all_reduce_refused`.
    mailbox.deliver(frame(1, 0)).await.unwrap();
    let err = mailbox.deliver(frame(1, 0)).await.unwrap_err();
    assert!(
        matches!(
            err,
            FrameRejected::Duplicate {
                ring_step: 0,
                offset: 4,
                ..
            }
        ),
        "{err}"
    );
    mailbox.deliver(frame(2, 0)).await.unwrap();
    let other_length = RingFrame {
        total_len: 12,
        offset: 6,
        ..frame(2, 0)
    };
    mailbox.deliver(other_length.clone()).await.unwrap();
    let err = mailbox.deliver(other_length).await.unwrap_err();
    assert!(matches!(err, FrameRejected::Duplicate { .. }), "{err}");
    let err = mailbox.deliver(frame(2, 0)).await.unwrap_err();
    assert!(matches!(err, FrameRejected::Duplicate { .. }), "{err}");
    assert_eq!(mailbox.held_bytes(), 3 * 16);
    // Running, the all-reduce refuses any other length outright.
    let err = mailbox
        .deliver(RingFrame {
            total_len: 12,
            offset: 6,
            ..frame(1, 0)
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            FrameRejected::LengthMismatch {
                expected: 8,
                got: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn frames_of_another_dtype_or_an_unknown_one_are_refused() {
    let mailbox = Mailbox::new();
    mailbox.join("job-1", 1, SHAPE).unwrap();
    let bf16 = |step: u64, ring_step: u32, bytes: usize| RingFrame {
        dtype: WireDtype::Bf16.into(),
        data: vec![0u8; bytes].into(),
        ..frame_at(step, 0, ring_step)
    };
    // 4 bf16 elements are 8 bytes: the planned frame of an all-reduce of 8 elements.
    mailbox.deliver(bf16(1, 0, 8)).await.unwrap();
    assert_eq!(mailbox.held_bytes(), 8);
    // The same all-reduce's next frame in f32 (16 bytes for 4 elements): the workers disagree.
    let running = mailbox
        .open("job-1", 1, 1, 0, 8, WireDtype::Bf16, Collective::AllReduce)
        .unwrap();
    let err = mailbox.deliver(frame_at(1, 0, 1)).await.unwrap_err();
    assert!(
        matches!(
            err,
            FrameRejected::DtypeMismatch {
                expected: WireDtype::Bf16,
                got: WireDtype::F32,
                ..
            }
        ),
        "{err}"
    );
    drop(running);
    // An odd number of bytes is no whole number of bf16 elements; dtype 7 is no dtype.
    let err = mailbox.deliver(bf16(2, 0, 7)).await.unwrap_err();
    assert!(
        matches!(&err, FrameRejected::Malformed(m) if m.contains("multiple of 2")),
        "{err}"
    );
    let err = mailbox
        .deliver(RingFrame {
            dtype: 7,
            ..frame(2, 0)
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, FrameRejected::Malformed(m) if m.contains("dtype 7")),
        "{err}"
    );
    // 8 bytes read as f32 are 2 elements, not the planned 4: unplanned.
    let err = mailbox
        .deliver(RingFrame {
            dtype: WireDtype::F32.into(),
            ..bf16(2, 0, 8)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, FrameRejected::Unplanned { .. }), "{err}");
}

#[tokio::test]
async fn frames_held_ahead_are_bounded_apart_and_freed_when_the_step_moves_on() {
    // 1 MiB frames; 16 MiB for running all-reduces, 4 MiB ahead.
    let shape = RingShape {
        world_size: 2,
        rank: 0,
        frame_elems: 1 << 18,
    };
    let mailbox = Mailbox::with_capacity(16 << 20);
    mailbox.join("job-1", 1, shape).unwrap();
    let len: u64 = 1 << 24;
    let big = move |step: u64, bucket: u32, k: u64| RingFrame {
        total_len: len,
        offset: len / 2 + k * (1 << 18),
        data: vec![0u8; 1 << 20].into(),
        ..frame(step, bucket)
    };
    let mut step1 = mailbox
        .open(
            "job-1",
            1,
            1,
            0,
            len as usize,
            WireDtype::F32,
            Collective::AllReduce,
        )
        .unwrap();
    // A bucket that never runs fills the ahead budget ...
    for k in 0..4 {
        mailbox.deliver(big(1, 7, k)).await.unwrap();
    }
    // ... which neither refuses nor holds back frames of the running all-reduce ...
    mailbox.deliver(big(1, 0, 0)).await.unwrap();
    assert!(step1.recv().await.is_some());
    // ... while a frame of the next all-reduce waits for room ahead, until that one starts.
    let waiting = {
        let mailbox = Arc::clone(&mailbox);
        tokio::spawn(async move { mailbox.deliver(big(2, 0, 0)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "no room ahead: the frame must wait");
    assert_eq!(mailbox.held_bytes(), 4 << 20);
    drop(step1);
    let mut step2 = mailbox
        .open(
            "job-1",
            1,
            2,
            0,
            len as usize,
            WireDtype::F32,
            Collective::AllReduce,
        )
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the waiting frame goes on once its all-reduce started")
        .unwrap()
        .unwrap();
    assert!(step2.recv().await.is_some());
    // At step 3 nothing of step 1 can come any more: the bucket that never ran is let go.
    assert_eq!(mailbox.held_bytes(), 4 << 20);
    drop(step2);
    let _step3 = mailbox
        .open(
            "job-1",
            1,
            3,
            0,
            len as usize,
            WireDtype::F32,
            Collective::AllReduce,
        )
        .unwrap();
    assert_eq!(mailbox.held_bytes(), 0);
}

#[tokio::test]
async fn a_forged_first_frame_of_another_length_does_not_get_the_real_all_reduce_refused() {
    // A peer pushes, for step 6 bucket 0 (not started here yet), a frame of a 16-element
    // buffer; the real all-reduce there is of 8 elements. Both orders: the real frame before
    // and after the local start.
    for real_before_start in [true, false] {
        let mailbox = Mailbox::new();
        mailbox.join("job-1", 1, SHAPE).unwrap();
        drop(
            mailbox
                .open("job-1", 1, 5, 0, 8, WireDtype::F32, Collective::AllReduce)
                .unwrap(),
        );
        let forged = RingFrame {
            total_len: 16,
            offset: 8,
            data: vec![0xffu8; 16].into(),
            ..frame(6, 0)
        };
        mailbox.deliver(forged).await.unwrap();
        let real = RingFrame {
            data: vec![1u8; 16].into(),
            ..frame(6, 0)
        };
        if real_before_start {
            mailbox.deliver(real.clone()).await.unwrap();
            assert_eq!(mailbox.held_bytes(), 32);
        }
        let mut inbox = mailbox
            .open("job-1", 1, 6, 0, 8, WireDtype::F32, Collective::AllReduce)
            .unwrap();
        // The forged frame is gone; only the real one's bytes can be held.
        let expected = if real_before_start { 16 } else { 0 };
        assert_eq!(
            mailbox.held_bytes(),
            expected,
            "before: {real_before_start}"
        );
        if !real_before_start {
            mailbox.deliver(real).await.unwrap();
        }
        let got = tokio::time::timeout(Duration::from_secs(5), inbox.recv())
            .await
            .expect("the real frame arrives")
            .expect("the inbox is open");
        assert_eq!((got.total_len, got.offset), (8, 4));
        assert_eq!(&got.data[..], &[1u8; 16][..]);
        // Now the all-reduce runs, a frame of another length is refused outright.
        let late = RingFrame {
            total_len: 16,
            offset: 12,
            ..frame(6, 0)
        };
        let err = mailbox.deliver(late).await.unwrap_err();
        assert!(matches!(err, FrameRejected::LengthMismatch { .. }), "{err}");
    }
}
