//! The job file's parsing, validation and round trip.

use super::*;
use crate::precision::{AllReduceDtype, PrecisionSetting};
use std::path::Path;

const EXAMPLE: &str = r#"
[data]
corpus = ["../corpora/en-kjv"]
vocab_size = 8000
lowercase = true
objective = "mlm"
max_seq_length = 128
masked_lm_prob = 0.15
max_predictions_per_seq = 20
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = 16
gradient_accumulation_steps = 1
max_steps = 300
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 30
schedule = "linear"
weight_decay = 0.01
max_grad_norm = 1.0
seed = 42
checkpoint_every = 100
eval_every = 100
[cluster]
min_workers = 2
max_workers = 2
"#;

fn err_of(text: &str) -> String {
    match JobSpec::from_toml_str(text, "job.toml") {
        Ok(spec) => panic!("expected an error, got {spec:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_issue_example_parses_with_its_values() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    assert_eq!(spec.data.vocabulary, Vocabulary::Train { vocab_size: 8000 });
    assert_eq!(spec.data.objective, Objective::Mlm);
    assert_eq!(spec.model.source, ModelSource::Preset("tiny".into()));
    assert_eq!(spec.train.max_steps, 300);
    assert_eq!(spec.train.optimizer, OptimizerKind::Adamw);
    assert_eq!(spec.train.schedule, ScheduleKind::Linear);
    assert_eq!(spec.train.learning_rate, 1e-3);
    assert_eq!(spec.cluster.max_workers, 2);
    assert_eq!(spec.global_batch(2), 32);
}

#[test]
fn serialised_spec_round_trips() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    let text = spec.to_toml_string().unwrap();
    let back = JobSpec::from_toml_str(&text, "round-trip").unwrap();
    assert_eq!(spec, back);
}

#[test]
fn unknown_key_is_named() {
    let text = EXAMPLE.replace("max_steps = 300", "max_step = 300");
    let e = err_of(&text);
    assert!(e.contains("max_step"), "{e}");
    assert!(e.contains("job.toml"), "{e}");
}

#[test]
fn bad_values_name_the_key_and_what_is_allowed() {
    let cases = [
        (
            "learning_rate = 1e-3",
            "learning_rate = -1.0",
            "train.learning_rate",
        ),
        ("objective = \"mlm\"", "objective = \"clm\"", "objective"),
        ("preset = \"tiny\"", "preset = \"huge\"", "model.preset"),
        (
            "masked_lm_prob = 0.15",
            "masked_lm_prob = 1.5",
            "data.masked_lm_prob",
        ),
        ("max_workers = 2", "max_workers = 1", "cluster.max_workers"),
        (
            "max_workers = 2",
            "max_workers = 2\nprogress_timeout_seconds = 0.5",
            "cluster.progress_timeout_seconds",
        ),
        (
            "max_workers = 2",
            "max_workers = 2\nprogress_timeout_seconds = inf",
            "cluster.progress_timeout_seconds",
        ),
        (
            "warmup_steps = 30",
            "warmup_steps = 3000",
            "train.warmup_steps",
        ),
        (
            "max_seq_length = 128",
            "max_seq_length = 600",
            "data.max_seq_length",
        ),
        (
            "micro_batch_size = 16",
            "micro_batch_size = 0",
            "train.micro_batch_size",
        ),
        (
            "vocab_size = 8000",
            "vocab = \"v.txt\"\nvocab_size = 8000",
            "data.vocab",
        ),
    ];
    for (from, to, key) in cases {
        let e = err_of(&EXAMPLE.replace(from, to));
        assert!(e.contains(key), "{to}: {e}");
    }
}

#[test]
fn precision_defaults_to_auto_and_a_bad_one_is_named() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    assert_eq!(spec.train.precision, PrecisionSetting::Auto);
    let text = EXAMPLE.replace("seed = 42", "seed = 42\nprecision = \"bf16\"");
    let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
    assert_eq!(spec.train.precision, PrecisionSetting::Bf16);
    let e = err_of(&EXAMPLE.replace("seed = 42", "seed = 42\nprecision = \"fp16\""));
    assert!(e.contains("precision") && e.contains("bf16"), "{e}");
}

#[test]
fn allreduce_dtype_defaults_to_fp32_and_a_bad_one_is_named() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    assert_eq!(spec.train.allreduce_dtype, AllReduceDtype::Fp32);
    let text = EXAMPLE.replace("seed = 42", "seed = 42\nallreduce_dtype = \"bf16\"");
    let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
    assert_eq!(spec.train.allreduce_dtype, AllReduceDtype::Bf16);
    let e = err_of(&EXAMPLE.replace("seed = 42", "seed = 42\nallreduce_dtype = \"fp16\""));
    assert!(e.contains("allreduce_dtype") && e.contains("bf16"), "{e}");
}

#[test]
fn bucket_mib_defaults_to_4_and_must_be_1_to_1024() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    assert_eq!(spec.train.bucket_mib, 4);
    let text = EXAMPLE.replace("seed = 42", "seed = 42\nbucket_mib = 64");
    let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
    assert_eq!(spec.train.bucket_mib, 64);
    for bad in ["0", "1025"] {
        let e = err_of(&EXAMPLE.replace("seed = 42", &format!("seed = 42\nbucket_mib = {bad}")));
        assert!(e.contains("train.bucket_mib") && e.contains("1024"), "{e}");
    }
}

#[test]
fn shard_optimizer_defaults_to_false_and_is_refused_with_diloco() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    assert!(!spec.train.shard_optimizer);
    let text = EXAMPLE.replace("seed = 42", "seed = 42\nshard_optimizer = true");
    let spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
    assert!(spec.train.shard_optimizer);
    let e = err_of(&format!("{text}\n[diloco]\ninner_steps = 10\n"));
    assert!(
        e.contains("train.shard_optimizer") && e.contains("diloco"),
        "{e}"
    );
}

#[test]
fn model_needs_exactly_one_source() {
    let e = err_of(&EXAMPLE.replace("preset = \"tiny\"", ""));
    assert!(e.contains("exactly one of model.preset"), "{e}");
}

#[test]
fn relative_paths_resolve_against_the_base() {
    let mut spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    spec.resolve_paths(Path::new("/home/u/keel"));
    assert_eq!(spec.data.corpus, vec!["/home/u/keel/../corpora/en-kjv"]);
}

#[test]
fn either_or_choices_become_enums_and_serialize_as_written() {
    let spec = JobSpec::from_toml_str(EXAMPLE, "job.toml").unwrap();
    let json = serde_json::to_value(&spec).unwrap();
    assert_eq!(json["data"]["vocab_size"], 8000);
    assert!(json["data"].get("vocab").is_none_or(|v| v.is_null()));
    assert_eq!(json["model"]["preset"], "tiny");
    let back: JobSpec = serde_json::from_value(json).unwrap();
    assert_eq!(back, spec);

    let text = EXAMPLE
        .replace("vocab_size = 8000", "vocab = \"v.txt\"")
        .replace("preset = \"tiny\"", "init_checkpoint = \"ckpt\"")
        .replace("max_seq_length = 128", "max_seq_length = 1024");
    let mut spec = JobSpec::from_toml_str(&text, "job.toml").unwrap();
    assert_eq!(spec.data.vocabulary, Vocabulary::File("v.txt".into()));
    assert_eq!(
        spec.model.source,
        ModelSource::InitCheckpoint("ckpt".into())
    );
    spec.resolve_paths(Path::new("/base"));
    assert_eq!(
        spec.named_paths(),
        vec![
            ("data.vocab", Path::new("/base/v.txt")),
            ("model.init_checkpoint", Path::new("/base/ckpt"))
        ]
    );
    let again = JobSpec::from_toml_str(&spec.to_toml_string().unwrap(), "again").unwrap();
    assert_eq!(again, spec);

    let neither = err_of(&EXAMPLE.replace("vocab_size = 8000", ""));
    assert!(
        neither.contains("`data.vocab_size` = (missing)"),
        "{neither}"
    );
}
