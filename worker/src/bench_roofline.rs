//! The bench's pass-by-pass table: each pass of a step (`crate::model::pass_profile`) with its
//! time, the bytes it must move and the rate that gives, held against this machine's copy
//! bandwidth measured in the same run on the same threads; each GEMM class with its flop rate.
//! A pass near the bandwidth can only get faster by moving fewer bytes (fusing, bf16 storage);
//! one far below it is held back by something else (arithmetic, a serial loop, a split).

use std::time::Instant;

use crate::model::pass_profile::{self, PassTotals};

/// Bytes each thread copies per round of the bandwidth probe: well past any cache.
const PROBE_BYTES_PER_THREAD: usize = 128 << 20;
/// Rounds of the probe; the fastest counts (the first also faults the pages in).
const PROBE_ROUNDS: usize = 4;

/// The copy bandwidth of `threads` threads, each copying its own buffer (GB/s, 10^9 bytes
/// per second, bytes read plus bytes written: STREAM's "Copy" convention).
pub fn copy_bandwidth_gb_s(threads: usize) -> f64 {
    let threads = threads.max(1);
    let len = PROBE_BYTES_PER_THREAD / std::mem::size_of::<f32>();
    let mut buffers: Vec<(Vec<f32>, Vec<f32>)> = (0..threads)
        .map(|i| (vec![i as f32; len], vec![0.0f32; len]))
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..PROBE_ROUNDS {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (src, dst) in buffers.iter_mut() {
                scope.spawn(move || dst.copy_from_slice(src));
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    // Keep the copies observable so they are not optimised away.
    let check: f32 = buffers.iter().map(|(_, d)| d[len / 2]).sum();
    std::hint::black_box(check);
    (2 * PROBE_BYTES_PER_THREAD * threads) as f64 / best / 1e9
}

/// The table as JSON: one row per pass that ran, then `untimed` (step time no region names).
/// `totals` cover `steps` steps of `step_seconds` each; `bandwidth_gb_s` from
/// [`copy_bandwidth_gb_s`].
pub fn table(
    totals: &[PassTotals],
    steps: usize,
    step_seconds: f64,
    bandwidth_gb_s: f64,
) -> serde_json::Value {
    let steps_f = steps.max(1) as f64;
    let mut rows = Vec::new();
    let mut timed = 0.0;
    for t in totals.iter().filter(|t| t.calls > 0) {
        let seconds = t.seconds / steps_f;
        timed += seconds;
        let moved = (t.bytes_read + t.bytes_written) as f64 / steps_f;
        let gb_s = if seconds > 0.0 {
            moved / seconds / 1e9
        } else {
            0.0
        };
        let mut row = serde_json::json!({
            "pass": t.pass.name(),
            "calls_per_step": t.calls as f64 / steps_f,
            "ms_per_step": seconds * 1e3,
            "share": seconds / step_seconds,
            "mib_read_per_step": t.bytes_read as f64 / steps_f / (1 << 20) as f64,
            "mib_written_per_step": t.bytes_written as f64 / steps_f / (1 << 20) as f64,
            "gb_s": gb_s,
            "of_bandwidth": gb_s / bandwidth_gb_s,
            "join_wait_ms_per_step": t.join_seconds / steps_f * 1e3,
        });
        if t.pass.is_gemm() {
            row["gflops"] = serde_json::json!(if seconds > 0.0 {
                t.flops as f64 / steps_f / seconds / 1e9
            } else {
                0.0
            });
        }
        rows.push(row);
    }
    rows.push(serde_json::json!({
        "pass": "untimed",
        "ms_per_step": (step_seconds - timed) * 1e3,
        "share": (step_seconds - timed) / step_seconds,
    }));
    serde_json::Value::Array(rows)
}

/// Starts the counts afresh (with the GEMM stats: the timed steps begin).
pub fn reset() {
    pass_profile::reset();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::pass_profile::Pass;

    #[test]
    fn the_table_adds_up_to_the_step() {
        let totals = [
            PassTotals {
                pass: Pass::LayerNormForward,
                calls: 4,
                seconds: 0.2,
                bytes_read: 4 << 30,
                bytes_written: 2 << 30,
                flops: 0,
                join_seconds: 0.0,
            },
            PassTotals {
                pass: Pass::GemmLinear,
                calls: 8,
                seconds: 0.6,
                bytes_read: 0,
                bytes_written: 0,
                flops: 600_000_000_000,
                join_seconds: 0.0,
            },
            PassTotals {
                pass: Pass::Dropout,
                calls: 0,
                seconds: 0.0,
                bytes_read: 0,
                bytes_written: 0,
                flops: 0,
                join_seconds: 0.0,
            },
        ];
        let rows = table(&totals, 2, 0.5, 10.0);
        let rows = rows.as_array().expect("an array");
        assert_eq!(
            rows.len(),
            3,
            "passes that never ran are left out: {rows:?}"
        );
        let ln = &rows[0];
        assert_eq!(ln["pass"], "layernorm_forward");
        assert!((ln["ms_per_step"].as_f64().unwrap() - 100.0).abs() < 1e-9);
        // 3 GiB per step in 0.1 s.
        let gb_s = 3.0 * (1u64 << 30) as f64 / 0.1 / 1e9;
        assert!((ln["gb_s"].as_f64().unwrap() - gb_s).abs() < 1e-6);
        assert!((ln["of_bandwidth"].as_f64().unwrap() - gb_s / 10.0).abs() < 1e-6);
        assert!((rows[1]["gflops"].as_f64().unwrap() - 1000.0).abs() < 1e-6);
        assert_eq!(rows[2]["pass"], "untimed");
        // 0.5 s per step, 0.1 + 0.3 timed.
        assert!((rows[2]["ms_per_step"].as_f64().unwrap() - 100.0).abs() < 1e-9);
    }

    #[test]
    fn the_probe_measures_a_positive_bandwidth() {
        let gb_s = copy_bandwidth_gb_s(1);
        assert!(gb_s.is_finite() && gb_s > 0.1, "{gb_s}");
    }
}
