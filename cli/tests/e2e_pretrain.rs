//! End to end with real processes on 127.0.0.1: `keel local` runs a coordinator and 2 workers
//! that pretrain a tiny BERT on a real corpus; the MLM loss falls well below ln(vocab_size);
//! the pulled checkpoint has exactly HF's tensor scheme, loads back into Keel, and gives the
//! logits `keel fill-mask` prints.

mod common;

use common::*;
use keel_model::Bert;
use keel_proto::config::BertConfig;
use keel_proto::params::ParamLayout;
use std::collections::BTreeMap;
use std::path::Path;

/// Expected shape of every HF tensor of a BertForMaskedLM with this config, by name.
fn expected_shape(name: &str, c: &BertConfig) -> Vec<usize> {
    let (v, h, i, p, t) = (
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.max_position_embeddings,
        c.type_vocab_size,
    );
    if name.ends_with("word_embeddings.weight") {
        vec![v, h]
    } else if name.ends_with("position_embeddings.weight") {
        vec![p, h]
    } else if name.ends_with("token_type_embeddings.weight") {
        vec![t, h]
    } else if name == "cls.predictions.bias" {
        vec![v]
    } else if name.ends_with("intermediate.dense.weight") {
        vec![i, h]
    } else if name.ends_with("intermediate.dense.bias") {
        vec![i]
    } else if name.contains(".output.dense.weight") && !name.contains("attention") {
        vec![h, i]
    } else if name.ends_with(".weight") && !name.contains("LayerNorm") {
        vec![h, h]
    } else {
        vec![h]
    }
}

fn shapes(path: &Path) -> BTreeMap<String, Vec<usize>> {
    keel_proto::weights::load_tensors_f64(path)
        .unwrap()
        .into_iter()
        .map(|(name, (shape, _))| (name, shape))
        .collect()
}

fn pretrain(corpus_name: &str, lowercase: bool, vocab_size: usize, fill_mask_text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut job = JobFile::new(corpus(corpus_name));
    job.lowercase = lowercase;
    job.vocab_size = vocab_size;
    let job_path = job.write(dir.path());
    let out = dir.path().join("checkpoint");
    let work = dir.path().join("work");
    let run = keel_local(&job_path, 2, &out, &work);
    println!("{}", String::from_utf8_lossy(&run.stdout));

    // The loss curve: every step reported, and the MLM loss far below chance.
    let lines = metrics(&out.join("metrics.jsonl"));
    let losses: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("loss")?.as_f64())
        .collect();
    assert_eq!(
        losses.len() as u64,
        job.max_steps,
        "one metrics line per step"
    );
    let vocab = std::fs::read_to_string(out.join("vocab.txt"))
        .unwrap()
        .lines()
        .count();
    let chance = (vocab as f64).ln();
    let first: f64 = losses[..10].iter().sum::<f64>() / 10.0;
    let last: f64 = losses[losses.len() - 10..].iter().sum::<f64>() / 10.0;
    println!(
        "{corpus_name}: vocab {vocab}, ln(V) {chance:.3}, loss first 10 steps {first:.3}, last 10 steps {last:.3}"
    );
    // 2 nats below chance: perplexity under 14% of the vocabulary size.
    assert!(
        last < chance - 2.0,
        "final loss {last:.3} is not well below ln(V) = {chance:.3}"
    );
    assert!(
        last < first - 0.75,
        "loss did not fall: {first:.3} -> {last:.3}"
    );
    let evals: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("eval_loss")?.as_f64())
        .collect();
    assert_eq!(evals.len(), 2, "eval at steps 100 and 200");
    assert!(
        evals[1] < chance - 2.0,
        "eval loss {} not below ln(V)",
        evals[1]
    );
    assert!(out.join("loss.png").is_file());

    // HF layout: the files from_pretrained reads, and exactly HF's tensor scheme.
    for f in [
        "config.json",
        "model.safetensors",
        "vocab.txt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "optimizer.safetensors",
        "trainer_state.json",
        "manifest.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing from the checkpoint");
    }
    let config = BertConfig::from_json_file(out.join("config.json")).unwrap();
    assert_eq!(config.vocab_size, vocab);
    let fixture_dir = fixture("bert-micro-mlm");
    let fixture_config = BertConfig::from_json_file(fixture_dir.join("config.json")).unwrap();
    let fixture_shapes = shapes(&fixture_dir.join("model.safetensors"));
    for (name, shape) in &fixture_shapes {
        assert_eq!(
            shape,
            &expected_shape(name, &fixture_config),
            "the shape rule for {name} disagrees with HF's file"
        );
    }
    let ours = shapes(&out.join("model.safetensors"));
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        fixture_shapes.keys().collect::<Vec<_>>(),
        "tensor names differ from HF's BertForMaskedLM with 2 layers"
    );
    for (name, shape) in &ours {
        assert_eq!(shape, &expected_shape(name, &config), "{name}");
    }

    // Loads back into Keel; fill-mask (a separate process) prints the same probabilities as
    // the logits computed here.
    let layout = ParamLayout::bert(&config, config.heads());
    let params =
        keel_proto::weights::load_safetensors(out.join("model.safetensors"), &layout).unwrap();
    assert!(params.iter().all(|x| x.is_finite()));
    let tokenizer =
        keel_proto::tokenizer::KeelTokenizer::from_tokenizer_json(&out.join("tokenizer.json"))
            .unwrap();
    let special = tokenizer.special();
    let mut ids = vec![special.cls];
    ids.extend(tokenizer.encode(fill_mask_text));
    ids.push(special.sep);
    let pos = ids
        .iter()
        .position(|&id| id == special.mask)
        .expect("a [MASK] in the text");
    let mut model = Bert::<f32>::new(&config, config.heads()).unwrap();
    let logits = model
        .mlm_logits(&params, &ids, &vec![0; ids.len()], &[pos])
        .unwrap();
    let row: Vec<f64> = logits.row(0).iter().map(|&x| f64::from(x)).collect();
    let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = row.iter().map(|x| (x - max).exp()).sum();
    let fill = run_keel(
        &[
            "fill-mask",
            "--checkpoint",
            out.to_str().unwrap(),
            "--top-k",
            "5",
            "--json",
            fill_mask_text,
        ],
        dir.path(),
    );
    let printed: serde_json::Value = serde_json::from_slice(&fill.stdout).unwrap();
    let top = printed[0].as_array().unwrap();
    assert_eq!(top.len(), 5);
    for cand in top {
        let id = cand["token"].as_u64().unwrap() as usize;
        let p = (row[id] - max).exp() / z;
        let score = cand["score"].as_f64().unwrap();
        assert!(
            (p - score).abs() <= 1e-6 * p.max(1e-3),
            "token {id}: fill-mask {score}, here {p}"
        );
    }
    println!(
        "fill-mask {fill_mask_text:?}: {}",
        top.iter()
            .map(|c| format!("{} {:.3}", c["token_str"], c["score"]))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

#[test]
fn two_workers_pretrain_tiny_bert_on_the_king_james_bible() {
    pretrain(
        "en-kjv",
        true,
        4000,
        "and god said , let there be [MASK] : and there was light .",
    );
}

#[test]
fn two_workers_pretrain_tiny_bert_on_chinese_poetry() {
    pretrain("zh-poetry", false, 2000, "床前明月光，疑是地上[MASK]。");
}
