#!/usr/bin/env bash
# Tries every attack and careless input that the resource bounds answer against real local clusters, and reports
# each case. Each case is an integration test that starts a real coordinator and real workers
# on 127.0.0.1 (and, for some, raw TCP or gRPC clients acting as a hostile peer), tries one
# thing and checks what the cluster did; this script runs them one at a time, each under a
# time limit, and prints one line per case and a summary. Every loop inside the tests is
# bounded; so is every case here (ABUSE_CASE_TIMEOUT seconds, default 600).
#
#   scripts/abuse.sh            # build, then every case
#   scripts/abuse.sh 3 5        # only the cases of findings 3 and 5
#
# Writes target/abuse-report.txt (the table) and exits non-zero if any case failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null; then export PATH="$HOME/.cargo/bin:$PATH"; fi
limit="${ABUSE_CASE_TIMEOUT:-600}"

# finding | what is tried | package | test target | test name
cases=(
  "1|model sizes past the caps or a worker's memory, and sizes whose products overflow|keel-cli|bounds|models_too_large_are_refused_at_submit_or_failed_at_assignment"
  "2|a 3 GiB line, /dev/zero as vocabulary, a 2 MiB config; a restart after a failed preparation|keel-cli|bounds|unbounded_inputs_fail_the_job_which_stays_failed_after_a_restart"
  "2|a coordinator killed during every preparation of a job (crash loop)|keel-cli|bounds|a_job_whose_preparation_keeps_being_interrupted_is_failed_not_retried"
  "2|a multi-gigabyte corpus line, a device and a FIFO as corpus|keel-coordinator|corpus_errors|a_multi_gigabyte_line_a_device_or_a_fifo_is_refused_naming_the_file_and_limit"
  "3|a ring failure at a chosen step while the coordinator suspends the ring|keel-cli|ring_fault|a_ring_failure_recovers_at_once_from_memory_with_every_worker"
  "4|a flood of frames for buckets and steps that will never run, up to the frame limit|keel-worker|allreduce_flood|a_flood_of_unplanned_frames_neither_stalls_the_ring_nor_stays_held"
  "5|40 idle or half-open (partial HTTP/2 preface) connections, then a silent full preface|keel-cli|connections|partial_prefaces_and_silent_connections_are_closed_after_their_timeouts"
  "5|more connections than the cap, held without a token|keel-cli|connections|connections_over_the_cap_are_refused_at_once_and_freed_slots_serve_again"
  "5|the coordinator out of file descriptors (RLIMIT_NOFILE 64, 100 connections)|keel-cli|connections|out_of_file_descriptors_the_coordinator_does_not_spin_and_recovers"
  "5|a partial preface on a worker's ring port|keel-cli|connections|a_workers_ring_port_closes_partial_prefaces_too"
  "6|corpus, vocabulary, config and checkpoint paths outside the input roots|keel-cli|input_roots|job_paths_outside_the_input_roots_are_refused_naming_key_path_and_roots"
  "6|relative paths without roots|keel-cli|input_roots|without_roots_relative_paths_are_refused_and_the_start_warns"
  "6|a restored job outside the new input roots|keel-cli|input_roots|a_restored_job_outside_the_new_input_roots_is_failed_not_prepared"
  "6|a symlink out of the roots added after the submit|keel-coordinator|prepare_roots|a_symlink_out_of_the_roots_added_after_submit_fails_the_preparation"
  "6|a 4 MB TOML key and other huge inputs echoed in errors|keel-cli|untrusted_input|errors_quote_only_a_bounded_prefix_of_the_input"
  "6|newlines and control characters in paths and names (forged log lines)|keel-cli|untrusted_input|control_characters_in_client_strings_cannot_forge_log_lines"
  "7|a claim to hold step 2^64-1|keel-cli|untrusted_input|a_held_step_claim_past_the_jobs_last_step_is_ignored"
  "7|two live registrations of one --advertise-addr|keel-cli|untrusted_input|a_second_live_registration_of_an_address_is_refused_but_a_restarted_worker_is_accepted"
  "7|a fake worker that heartbeats but never steps (no recovery left)|keel-cli|stall|a_job_whose_worker_never_steps_fails_naming_it"
  "7|a fake worker that never steps, with a real worker to take its place|keel-cli|stall|a_stalled_job_reforms_without_the_stalled_worker_and_completes"
  "8|a 2 GiB sparse model.safetensors behind a small manifest (pull, fill-mask)|keel-cli|bounds|pull_stops_past_the_manifest_size_and_fill_mask_checks_the_header"
)

wanted=("$@")
selected() {
  [ "${#wanted[@]}" = 0 ] && return 0
  local f
  for f in "${wanted[@]}"; do [ "$f" = "$1" ] && return 0; done
  return 1
}

echo "abuse: building the tests (release)" >&2
cargo test --release --workspace --no-run >/dev/null 2>&1 || {
  cargo test --release --workspace --no-run
  exit 1
}

report=target/abuse-report.txt
mkdir -p target/abuse-logs
{
  echo "# scripts/abuse.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
  printf '%-8s %-6s %-8s %s\n' finding result seconds "case (test)"
} >"$report"
failed=0
for c in "${cases[@]}"; do
  IFS='|' read -r finding what package target name <<<"$c"
  selected "$finding" || continue
  log="target/abuse-logs/${target}-${name}.log"
  start=$(date +%s)
  timeout "$limit" cargo test --release -q -p "$package" --test "$target" -- --exact "$name" \
    --nocapture >"$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  if [ "$rc" = 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
    result=held
  else
    result=FAILED
    failed=$((failed + 1))
  fi
  [ "$rc" = 124 ] && result=TIMEOUT
  line=$(printf '%-8s %-6s %-8s %s (%s::%s)' "$finding" "$result" "$secs" "$what" "$target" "$name")
  echo "$line" | tee -a "$report"
done
echo "abuse: $failed case(s) failed; table in $report, logs in target/abuse-logs/" | tee -a "$report"
[ "$failed" = 0 ]
