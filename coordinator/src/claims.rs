//! What a worker claims about a job, checked against the job before it is trusted.
//!
//! A worker that answers a regroup's Suspend says which steps of the job it holds in memory;
//! the newest claim becomes the step the next generation starts from, and its holder the root
//! that broadcasts the weights. Every worker holds the cluster token, so a claim is a peer's
//! word, not a proof: a hostile or broken worker could claim a step the ring never reached and
//! make the job jump ahead on its weights. A claim is therefore trusted only where the job's
//! own record of progress makes it possible:
//!
//! 1. no claim past the job's last step (`train.max_steps`) is ever a replica of it
//!    ([`within_last_step`]);
//! 2. the newest claim is *corroborated* when another member holds at least the step before it
//!    (in a synchronous ring, a rank finishes step `s` only after every other rank sent its
//!    gradients of step `s`, so every other survivor of that ring holds `s - 1` or later), or
//!    when it lies within the steps the ring could have run since the coordinator last heard the
//!    job's step from rank 0's step reports ([`plausible_lead`]); an uncorroborated newest claim
//!    is set aside and the next newest tried ([`corroborated_newest`]).
//!
//! What this does not stop: a hostile rank 0 that also forges its step reports, or a hostile
//! sole survivor (it is then the only source of the weights anyway).

use std::time::Duration;

/// The step time assumed when the job has reported none yet (seconds): faster than any
/// model Keel trains steps, so an honest claim is never set aside for want of a measurement.
pub const UNMEASURED_STEP_SECONDS: f64 = 0.01;

/// The fastest a step is taken to be, as a fraction of the last reported step time: steps
/// vary (evaluations, checkpoints, a shorter last batch), so the bound allows twice the rate.
const STEP_TIME_MARGIN: f64 = 0.5;

/// The claims of `held_steps` that the job can have: a claim past the job's last step
/// (`max_steps`; e.g. 2^64-1) cannot be a replica of it and is ignored with a warning naming
/// `worker`. The newest of the rest, or `None`.
pub fn within_last_step(worker: &str, held_steps: &[u64], max_steps: u64) -> Option<u64> {
    let (trusted, refused): (Vec<u64>, Vec<u64>) =
        held_steps.iter().partition(|&&s| s <= max_steps);
    if !refused.is_empty() {
        tracing::warn!(
            worker = ?worker,
            claimed = ?refused,
            max_steps,
            "held-step claim past the job's last step ignored"
        );
    }
    trusted.into_iter().max()
}

/// How many steps past the last step the coordinator heard the ring may have run `elapsed`
/// later (steps): one in flight, plus `elapsed` over half of `step_seconds` (the last reported
/// step time; [`UNMEASURED_STEP_SECONDS`] when there is none or it is not a positive number),
/// rounded up.
pub fn plausible_lead(elapsed: Duration, step_seconds: Option<f64>) -> u64 {
    let step = step_seconds
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(UNMEASURED_STEP_SECONDS);
    let fastest = (step * STEP_TIME_MARGIN).max(1e-6);
    let steps = (elapsed.as_secs_f64() / fastest).ceil();
    1 + if steps.is_finite() && steps < u64::MAX as f64 {
        steps as u64
    } else {
        u64::MAX - 1
    }
}

/// The newest trusted claim among `claims` (worker, newest step it holds that is within the
/// job's last step, if any) and its holder: the newest claim is kept when another worker holds
/// at least the step before it, or when it is at most `heard_step + lead` (the job's step as
/// rank 0 last reported it, plus [`plausible_lead`] since then); otherwise that worker's claim
/// is set aside with a warning (it still joins the ring, and receives the weights) and the
/// next newest is tried. Ties go to the first worker in `claims`.
pub fn corroborated_newest(
    claims: &[(String, Option<u64>)],
    heard_step: u64,
    lead: u64,
) -> Option<(u64, String)> {
    let mut candidates: Vec<(u64, usize)> = claims
        .iter()
        .enumerate()
        .filter_map(|(i, (_, s))| s.map(|s| (s, i)))
        .collect();
    // Newest first; among equals, the earliest in `claims`.
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let reachable = heard_step.saturating_add(lead);
    for &(step, i) in &candidates {
        let worker = &claims[i].0;
        let backed = candidates
            .iter()
            .any(|&(other, j)| j != i && claims[j].0 != *worker && other + 1 >= step);
        if backed || step <= reachable {
            return Some((step, worker.clone()));
        }
        tracing::warn!(
            worker = %worker,
            claimed = step,
            heard_step,
            reachable,
            "held-step claim set aside: no other member holds step {} or later, and the job \
             was last heard at step {heard_step}, from which the ring could have reached at \
             most step {reachable} since",
            step.saturating_sub(1)
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(c: &[(&str, Option<u64>)]) -> Vec<(String, Option<u64>)> {
        c.iter().map(|(w, s)| (w.to_string(), *s)).collect()
    }

    #[test]
    fn claims_past_the_last_step_are_ignored() {
        assert_eq!(within_last_step("w-1", &[3, u64::MAX, 21], 20), Some(3));
        assert_eq!(within_last_step("w-1", &[u64::MAX], 20), None);
        assert_eq!(within_last_step("w-1", &[20, 4], 20), Some(20));
    }

    #[test]
    fn the_lead_grows_with_the_time_since_the_step_was_heard() {
        // 1 s steps: twice the rate, plus the one in flight.
        assert_eq!(plausible_lead(Duration::ZERO, Some(1.0)), 1);
        assert_eq!(plausible_lead(Duration::from_secs(10), Some(1.0)), 21);
        // No measurement, a NaN or a zero: the unmeasured step time (10 ms).
        assert_eq!(plausible_lead(Duration::from_secs(1), None), 201);
        assert_eq!(plausible_lead(Duration::from_secs(1), Some(f64::NAN)), 201);
        assert_eq!(plausible_lead(Duration::from_secs(1), Some(0.0)), 201);
        // A measured step faster than the unmeasured one counts at its own rate.
        assert_eq!(plausible_lead(Duration::from_secs(1), Some(0.002)), 1001);
    }

    #[test]
    fn a_forged_claim_among_honest_members_is_set_aside() {
        // The ring reached step 50; w-3 claims 990 (below max_steps), the others hold 50.
        let c = claims(&[("w-1", Some(50)), ("w-2", Some(50)), ("w-3", Some(990))]);
        assert_eq!(
            corroborated_newest(&c, 48, 3),
            Some((50, "w-1".to_string()))
        );
    }

    #[test]
    fn an_honest_claim_one_step_ahead_of_the_others_is_kept() {
        // w-2 finished step 51; w-1 died in it after sending its gradients and holds 50.
        let c = claims(&[("w-1", Some(50)), ("w-2", Some(51))]);
        assert_eq!(
            corroborated_newest(&c, 10, 1),
            Some((51, "w-2".to_string()))
        );
    }

    #[test]
    fn a_sole_claim_is_kept_only_within_the_reachable_steps() {
        let c = claims(&[("w-1", Some(30)), ("w-2", None)]);
        assert_eq!(
            corroborated_newest(&c, 25, 5),
            Some((30, "w-1".to_string()))
        );
        assert_eq!(corroborated_newest(&c, 24, 5), None);
        // Its own second claim does not back it.
        let twice = claims(&[("w-1", Some(30)), ("w-1", Some(29))]);
        assert_eq!(corroborated_newest(&twice, 0, 1), None);
    }

    #[test]
    fn the_next_newest_is_tried_after_one_is_set_aside() {
        let c = claims(&[("w-1", Some(12)), ("w-2", Some(11)), ("w-3", Some(400))]);
        assert_eq!(corroborated_newest(&c, 0, 1), Some((12, "w-1".to_string())));
    }
}
