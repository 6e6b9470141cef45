//! Every refusal of a job file, word for word: the messages users see from `keel submit` and
//! `keel local`, kept as they are when the validation code moves.

use keel_proto::jobspec::JobSpec;

const GOOD: &str = r#"
[data]
corpus = ["/c.txt"]
vocab_size = 8000
max_seq_length = 128
[model]
preset = "tiny"
[train]
micro_batch_size = 16
max_steps = 300
learning_rate = 1e-3
warmup_steps = 30
checkpoint_every = 100
eval_every = 100
[cluster]
min_workers = 2
max_workers = 2
"#;

/// (`from` replaced by `to` in [`GOOD`], the whole message or `ok`), as Keel said them before
/// the job spec's checks were split by section.
const CASES: &[(&str, &str, &str)] = &[
    (
        "corpus = [\"/c.txt\"]",
        "corpus = []",
        "job.toml: `data.corpus` = []: at least one file, directory or glob",
    ),
    (
        "vocab_size = 8000",
        "vocab_size = 8000\nvocab = \"v.txt\"",
        "job.toml: `data.vocab` = Some(\"v.txt\"): give either data.vocab_size (train a vocabulary) or data.vocab (use a file), not both",
    ),
    (
        "vocab_size = 8000",
        "",
        "job.toml: `data.vocab_size` = (missing): give data.vocab_size (train a vocabulary) or data.vocab (a vocab.txt or tokenizer.json)",
    ),
    (
        "vocab_size = 8000",
        "vocab_size = 50",
        "job.toml: `data.vocab_size` = 50: between 100 and 1000000",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 4",
        "job.toml: `data.max_seq_length` = 4: between 8 and 8192 tokens",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 10000",
        "job.toml: `data.max_seq_length` = 10000: between 8 and 8192 tokens",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 128\nmasked_lm_prob = 0.0",
        "job.toml: `data.masked_lm_prob` = 0: a probability strictly between 0 and 1 (BERT: 0.15)",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 128\nmax_predictions_per_seq = 0",
        "job.toml: `data.max_predictions_per_seq` = 0: between 1 and data.max_seq_length",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 16\nmax_predictions_per_seq = 20",
        "job.toml: `data.max_predictions_per_seq` = 20: between 1 and data.max_seq_length",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 128\nheldout_fraction = 0.5",
        "job.toml: `data.heldout_fraction` = 0.5: a fraction in [0, 0.5)",
    ),
    (
        "preset = \"tiny\"",
        "",
        "job.toml: `model` = preset=None config=None init_checkpoint=None: exactly one of model.preset, model.config, model.init_checkpoint",
    ),
    (
        "preset = \"tiny\"",
        "preset = \"tiny\"\nconfig = \"c.json\"",
        "job.toml: `model` = preset=Some(\"tiny\") config=Some(\"c.json\") init_checkpoint=None: exactly one of model.preset, model.config, model.init_checkpoint",
    ),
    (
        "preset = \"tiny\"",
        "config = \"c.json\"\ninit_checkpoint = \"ck\"",
        "job.toml: `model` = preset=None config=Some(\"c.json\") init_checkpoint=Some(\"ck\"): exactly one of model.preset, model.config, model.init_checkpoint",
    ),
    (
        "preset = \"tiny\"",
        "preset = \"huge\"",
        "job.toml: `model.preset` = \"huge\": one of tiny, mini, small, medium, base, large",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 600",
        "job.toml: `data.max_seq_length` = 600: at most 512 tokens with a model.preset (its max_position_embeddings)",
    ),
    ("preset = \"tiny\"", "config = \"c.json\"", "ok"),
    (
        "preset = \"tiny\"",
        "config = \"c.json\"\n[data2]",
        "job.toml: TOML parse error at line 8, column 2\n  |\n8 | [data2]\n  |  ^^^^^\nunknown field `data2`, expected one of `data`, `model`, `train`, `cluster`, `diloco`, `phase`",
    ),
    (
        "preset = \"tiny\"",
        "preset = \"tiny\"\ndropout = 1.0",
        "job.toml: `model.dropout` = 1: a probability in [0, 1)",
    ),
    (
        "micro_batch_size = 16",
        "micro_batch_size = 0",
        "job.toml: `train.micro_batch_size` = 0: between 1 and 65536 sequences",
    ),
    (
        "micro_batch_size = 16",
        "micro_batch_size = 70000",
        "job.toml: `train.micro_batch_size` = 70000: between 1 and 65536 sequences",
    ),
    (
        "micro_batch_size = 16",
        "micro_batch_size = 16\ngradient_accumulation_steps = 0",
        "job.toml: `train.gradient_accumulation_steps` = 0: between 1 and 65536",
    ),
    (
        "max_steps = 300",
        "max_steps = 0",
        "job.toml: `train.max_steps` = 0: at least 1 step",
    ),
    (
        "learning_rate = 1e-3",
        "learning_rate = 10.0",
        "job.toml: `train.learning_rate` = 10: a positive number below 10",
    ),
    (
        "learning_rate = 1e-3",
        "learning_rate = nan",
        "job.toml: `train.learning_rate` = NaN: a positive number below 10",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 301",
        "job.toml: `train.warmup_steps` = 301: at most train.max_steps",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\npoly_power = 0.0",
        "job.toml: `train.poly_power` = 0: a positive number",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nweight_decay = 1.0",
        "job.toml: `train.weight_decay` = 1: a number in [0, 1)",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nadam_beta1 = 1.0",
        "job.toml: `train.adam_beta1` = 1: a number in [0, 1)",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nadam_beta2 = -0.5",
        "job.toml: `train.adam_beta2` = -0.5: a number in [0, 1)",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nadam_epsilon = 0.0",
        "job.toml: `train.adam_epsilon` = 0: a positive number",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nmax_grad_norm = -1.0",
        "job.toml: `train.max_grad_norm` = -1: a number >= 0 (0 turns clipping off)",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nkeep_checkpoints = 0",
        "job.toml: `train.keep_checkpoints` = 0: at least 1 checkpoint",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nbucket_mib = 0",
        "job.toml: `train.bucket_mib` = 0: 1 to 1024 MiB",
    ),
    (
        "warmup_steps = 30",
        "warmup_steps = 30\nshard_optimizer = true",
        "ok",
    ),
    ("[cluster]", "[diloco]\ninner_steps = 10\n[cluster]", "ok"),
    (
        "eval_every = 100\n",
        "eval_every = 100\nshard_optimizer = true\n[diloco]\ninner_steps = 10\n",
        "job.toml: `train.shard_optimizer` = true: not with [diloco] (its workers keep moments of their own: there is nothing to shard)",
    ),
    (
        "corpus = [\"/c.txt\"]",
        "corpus = [\"/c.txt\"]\nvocab_sise = 1",
        "job.toml: TOML parse error at line 4, column 1\n  |\n4 | vocab_sise = 1\n  | ^^^^^^^^^^\nunknown field `vocab_sise`, expected one of `corpus`, `vocab_size`, `vocab`, `lowercase`, `objective`, `max_seq_length`, `masked_lm_prob`, `max_predictions_per_seq`, `whole_word_masking`, `dupe_factor`, `heldout_fraction`, `shards`",
    ),
    (
        "corpus = [\"/c.txt\"]",
        "",
        "job.toml: TOML parse error at line 2, column 1\n  |\n2 | [data]\n  | ^^^^^^\nmissing field `corpus`",
    ),
    // Two errors, one reported: the vocabulary is chosen (both given) before `[data]`'s values
    // are checked, so this names data.vocab where it named data.corpus before.
    (
        "corpus = [\"/c.txt\"]",
        "corpus = []\nvocab = \"v.txt\"",
        "job.toml: `data.vocab` = Some(\"v.txt\"): give either data.vocab_size (train a vocabulary) or data.vocab (use a file), not both",
    ),
    (
        "vocab_size = 8000",
        "vocab_size = \"big\"",
        "job.toml: TOML parse error at line 4, column 14\n  |\n4 | vocab_size = \"big\"\n  |              ^^^^^\ninvalid type: string \"big\", expected usize",
    ),
    (
        "vocab_size = 8000",
        "vocab = 5",
        "job.toml: TOML parse error at line 4, column 9\n  |\n4 | vocab = 5\n  |         ^\ninvalid type: integer `5`, expected path string",
    ),
    (
        "preset = \"tiny\"",
        "preset = \"tiny\"\nlayers = 2",
        "job.toml: TOML parse error at line 8, column 1\n  |\n8 | layers = 2\n  | ^^^^^^\nunknown field `layers`, expected one of `preset`, `config`, `init_checkpoint`, `dropout`",
    ),
    (
        "preset = \"tiny\"",
        "preset = 3",
        "job.toml: TOML parse error at line 7, column 10\n  |\n7 | preset = 3\n  |          ^\ninvalid type: integer `3`, expected a string",
    ),
    (
        "[model]\npreset = \"tiny\"\n",
        "",
        "job.toml: TOML parse error at line 1, column 1\n  |\n1 | \n  | ^\nmissing field `model`",
    ),
    (
        "preset = \"tiny\"",
        "preset = \"huge\"\ndropout = 2.0",
        "job.toml: `model.preset` = \"huge\": one of tiny, mini, small, medium, base, large",
    ),
    (
        "max_seq_length = 128",
        "max_seq_length = 600\nmax_predictions_per_seq = 0",
        "job.toml: `data.max_predictions_per_seq` = 0: between 1 and data.max_seq_length",
    ),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 0\n[cluster]",
        "job.toml: `diloco.inner_steps` = 0: at least 1",
    ),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 10\nouter_learning_rate = 0.0\n[cluster]",
        "job.toml: `diloco.outer_learning_rate` = 0: a positive number",
    ),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 10\nouter_momentum = 1.0\n[cluster]",
        "job.toml: `diloco.outer_momentum` = 1: a number in [0, 1)",
    ),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 7\n[cluster]",
        "job.toml: `train.max_steps` = 300: a multiple of diloco.inner_steps = 7 (weights agree only there)",
    ),
    ("[cluster]", "[diloco]\ninner_steps = 50\n[cluster]", "ok"),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 30\n[cluster]",
        "job.toml: `train.eval_every` = 100: a multiple of diloco.inner_steps = 30 (weights agree only there)",
    ),
    ("[cluster]", "[diloco]\ninner_steps = 10\n[cluster]", "ok"),
    (
        "[cluster]",
        "[diloco]\ninner_steps = 10\n[[phase]]\nstart_step = 155\n[cluster]",
        "job.toml: `phase.start_step` = phase 2: 155: a multiple of diloco.inner_steps = 10 (weights agree only there)",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 0\n[cluster]",
        "job.toml: `phase.start_step` = phase 2: 0: after the previous phase's start (0) and before train.max_steps (300)",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 300\n[cluster]",
        "job.toml: `phase.start_step` = phase 2: 300: after the previous phase's start (0) and before train.max_steps (300)",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\n[[phase]]\nstart_step = 100\n[cluster]",
        "job.toml: `phase.start_step` = phase 3: 100: after the previous phase's start (200) and before train.max_steps (300)",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nmax_seq_length = 1024\n[cluster]",
        "job.toml: `phase.max_seq_length` = phase 2: 1024: between 8 and 512 tokens",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nmax_seq_length = 16\n[cluster]",
        "job.toml: `phase.max_predictions_per_seq` = phase 2: 20 (inherited from phase 1): between 1 and the phase's max_seq_length",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nmicro_batch_size = 0\n[cluster]",
        "job.toml: `phase.micro_batch_size` = phase 2: 0: between 1 and 65536 sequences",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\ngradient_accumulation_steps = 0\n[cluster]",
        "job.toml: `phase.gradient_accumulation_steps` = phase 2: 0: between 1 and 65536",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nlearning_rate = 0.0\n[cluster]",
        "job.toml: `phase.learning_rate` = phase 2: 0: a positive number below 10",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 290\n[cluster]",
        "job.toml: `phase.warmup_steps` = phase 2: 30 (inherited from phase 1): at most the phase's 10 steps",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 20\n[cluster]",
        "job.toml: `train.warmup_steps` = phase 1: 30: at most the phase's 20 steps",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nwarmup_steps = 200\n[cluster]",
        "job.toml: `phase.warmup_steps` = phase 2: 200: at most the phase's 100 steps",
    ),
    (
        "[cluster]",
        "[[phase]]\nstart_step = 200\nmax_seq_len = 256\n[cluster]",
        "job.toml: TOML parse error at line 17, column 1\n   |\n17 | max_seq_len = 256\n   | ^^^^^^^^^^^\nunknown field `max_seq_len`, expected one of `start_step`, `max_seq_length`, `max_predictions_per_seq`, `micro_batch_size`, `gradient_accumulation_steps`, `learning_rate`, `warmup_steps`",
    ),
    (
        "min_workers = 2",
        "min_workers = 0",
        "job.toml: `cluster.min_workers` = 0: at least 1 worker",
    ),
    (
        "max_workers = 2",
        "max_workers = 1",
        "job.toml: `cluster.max_workers` = 1: at least cluster.min_workers and at most 4096",
    ),
    (
        "max_workers = 2",
        "max_workers = 5000",
        "job.toml: `cluster.max_workers` = 5000: at least cluster.min_workers and at most 4096",
    ),
    (
        "max_workers = 2",
        "max_workers = 2\npeer_timeout_seconds = 0.1",
        "job.toml: `cluster.peer_timeout_seconds` = 0.1: between 0.5 and 3600 seconds",
    ),
    (
        "max_workers = 2",
        "max_workers = 2\nreplacement_timeout_seconds = 0.5",
        "job.toml: `cluster.replacement_timeout_seconds` = 0.5: between 1 second and 604800 (one week)",
    ),
    (
        "max_workers = 2",
        "max_workers = 2\nprogress_timeout_seconds = inf",
        "job.toml: `cluster.progress_timeout_seconds` = inf: between 1 second and 604800 (one week)",
    ),
    (
        "max_steps = 300",
        "max_step = 300",
        "job.toml: TOML parse error at line 10, column 1\n   |\n10 | max_step = 300\n   | ^^^^^^^^\nunknown field `max_step`, expected one of `micro_batch_size`, `gradient_accumulation_steps`, `max_steps`, `optimizer`, `learning_rate`, `warmup_steps`, `schedule`, `poly_power`, `weight_decay`, `adam_beta1`, `adam_beta2`, `adam_epsilon`, `max_grad_norm`, `seed`, `checkpoint_every`, `eval_every`, `keep_checkpoints`, `max_skipped_steps`, `precision`, `allreduce_dtype`, `bucket_mib`, `shard_optimizer`",
    ),
    (
        "max_steps = 300",
        "max_steps = \"x\"",
        "job.toml: TOML parse error at line 10, column 13\n   |\n10 | max_steps = \"x\"\n   |             ^^^\ninvalid type: string \"x\", expected u64",
    ),
    (
        "[model]",
        "[models]",
        "job.toml: TOML parse error at line 6, column 2\n  |\n6 | [models]\n  |  ^^^^^^\nunknown field `models`, expected one of `data`, `model`, `train`, `cluster`, `diloco`, `phase`",
    ),
    ("objective", "objective", "ok"),
    (
        "max_seq_length = 128",
        "max_seq_length = 128\nobjective = \"clm\"",
        "job.toml: TOML parse error at line 6, column 13\n  |\n6 | objective = \"clm\"\n  |             ^^^^^\nunknown variant `clm`, expected `mlm` or `mlm+nsp`",
    ),
];

#[test]
fn every_refusal_reads_as_before() {
    let mut wrong = String::new();
    for (from, to, want) in CASES {
        assert!(GOOD.contains(from) || *from == "objective", "{from}");
        let text = GOOD.replace(from, to);
        let got = match JobSpec::from_toml_str(&text, "job.toml") {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        if got != *want {
            wrong.push_str(&format!("{to:?}:\n  was {want:?}\n  now {got:?}\n"));
        }
    }
    assert!(wrong.is_empty(), "messages changed:\n{wrong}");
}
