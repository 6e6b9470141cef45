# shellcheck shell=bash
# Sourced by the deployment tests (container, Slurm, systemd, multi-host): the job file they all
# submit, a BERT-tiny MLM job on one corpus, short enough for a test.
#
# tiny_job_sections CORPUS STEPS CHECKPOINT_EVERY EVAL_EVERY: prints the [data], [model] and
# [train] sections (the [train] section left open, so a caller may add keys to it before its
# own [cluster] section).
tiny_job_sections() {
  cat <<JOB
[data]
corpus = ["$1"]
vocab_size = 2000
lowercase = true
objective = "mlm"
max_seq_length = 64
masked_lm_prob = 0.15
max_predictions_per_seq = 10
heldout_fraction = 0.01

[model]
preset = "tiny"

[train]
micro_batch_size = 8
gradient_accumulation_steps = 1
max_steps = $2
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 3
schedule = "linear"
weight_decay = 0.01
max_grad_norm = 1.0
seed = 42
checkpoint_every = $3
eval_every = $4
JOB
}
