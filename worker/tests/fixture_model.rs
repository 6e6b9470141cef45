//! The model against PyTorch + transformers (the fixtures in fixtures/, made in
//! float64 from float32 weights): hidden states, logits, losses and every gradient, for
//! `BertForMaskedLM` and `BertForPreTraining`, in f64 (to ~1e-10) and in f32.

mod common;

use std::ops::Range;

use common::{Fixture, fixture, rel_err, tensors};
use keel_proto::params::Heads;
use keel_proto::weights::{load_safetensors, load_safetensors_f64};
use keel_worker::model::{Bert, Element, LookupGrads, LossSums, StepOptions};
use ndarray::Array2;

fn check_forward<A: Element>(f: &Fixture, params: &[A], tol: f64) {
    let mut model = Bert::<A>::new(&f.config, f.heads).unwrap();
    let out = model.forward_outputs(params, &f.batch).unwrap();
    let want = tensors(f, "forward.safetensors");
    let as64 = |a: &Array2<A>| a.iter().map(|x| x.to64()).collect::<Vec<f64>>();
    assert_eq!(out.hidden_states.len(), f.config.num_hidden_layers + 1);
    for (l, h) in out.hidden_states.iter().enumerate() {
        let e = rel_err(&as64(h), &want[&format!("hidden_states.{l}")].1);
        assert!(e < tol, "{}: hidden_states.{l} rel err {e:e}", f.dir);
    }
    let e = rel_err(&as64(&out.logits), &want["logits"].1);
    assert!(e < tol, "{}: logits rel err {e:e}", f.dir);
    match (
        &out.seq_relationship_logits,
        want.get("seq_relationship_logits"),
    ) {
        (Some(got), Some(w)) => {
            let e = rel_err(&as64(got), &w.1);
            assert!(e < tol, "{}: seq_relationship_logits rel err {e:e}", f.dir);
        }
        (None, None) => {}
        _ => panic!("NSP logits present on one side only"),
    }
    // mlm_logits on one unpadded row agrees with the batched logits at the same positions.
    let row = 1;
    let len = f
        .batch
        .attention_mask
        .row(row)
        .iter()
        .filter(|&&m| m != 0)
        .count();
    let ids: Vec<u32> = f
        .batch
        .input_ids
        .row(row)
        .iter()
        .take(len)
        .copied()
        .collect();
    let types: Vec<u32> = f
        .batch
        .token_type_ids
        .row(row)
        .iter()
        .take(len)
        .copied()
        .collect();
    let got = model
        .mlm_logits(params, &ids, &types, &[0, 3, len - 1])
        .unwrap();
    let t = f.batch.seq_len();
    for (i, &p) in [0, 3, len - 1].iter().enumerate() {
        let want_row = out
            .logits
            .row(row * t + p)
            .iter()
            .map(|x| x.to64())
            .collect::<Vec<_>>();
        let got_row = got.row(i).iter().map(|x| x.to64()).collect::<Vec<_>>();
        let e = rel_err(&got_row, &want_row);
        assert!(e < tol, "mlm_logits position {p}: rel err {e:e}");
    }
}

/// Runs forward_backward with the HF loss scaling (mean over masked tokens, mean over
/// sequences), checking the reported ranges: in the order `ready_ranges` gives, covering the
/// buffer exactly once. With `split_lookup`, the word embeddings' lookup share goes through
/// [`LookupGrads`] (rows for the batch's tokens and two unused ids) and is added back after.
/// `unpad` as [`Bert::set_unpadding`]: the fixture's batch has padding, and `Some(1)` computes
/// only its real tokens' rows.
fn gradients<A: Element>(
    f: &Fixture,
    params: &[A],
    split_lookup: bool,
    unpad: Option<usize>,
) -> (LossSums<A>, Vec<A>) {
    let mut model = Bert::<A>::new(&f.config, f.heads).unwrap();
    model.set_unpadding(unpad);
    let mut grads = vec![A::zero(); f.layout.total_len()];
    let opts = StepOptions {
        mlm_scale: A::one() / A::of(f.batch.masked_positions.len() as f64),
        nsp_scale: A::one() / A::of(f.batch.batch_size() as f64),
        dropout: None,
        report_ready: true,
    };
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut on_ready = |r: Range<usize>, g: &[A]| {
        assert_eq!(r.len(), g.len());
        ranges.push(r)
    };
    let sums = if split_lookup {
        let mut presence = vec![0.0f32; f.config.vocab_size];
        for &id in &f.batch.input_ids {
            presence[id as usize] = 1.0;
        }
        // Rows another rank's batch would add: they stay zero here.
        let unused = (0..presence.len())
            .rev()
            .filter(|&i| presence[i] == 0.0)
            .take(2);
        for i in unused.collect::<Vec<_>>() {
            presence[i] = 1.0;
        }
        let mut lookup = LookupGrads::from_presence(&presence, f.config.hidden_size);
        let sums = model
            .forward_backward_split_lookup(
                params,
                &mut grads,
                &mut lookup,
                &f.batch,
                &opts,
                &mut on_ready,
            )
            .unwrap();
        let word = f
            .layout
            .find("bert.embeddings.word_embeddings.weight")
            .unwrap()
            .range();
        lookup.add_into(&mut grads[word]).unwrap();
        sums
    } else {
        model
            .forward_backward(params, &mut grads, &f.batch, &opts, &mut on_ready)
            .unwrap()
    };
    let rows = model.rows_computed();
    match unpad {
        None => assert_eq!(rows, f.batch.input_ids.len()),
        Some(_) => assert_eq!(rows, f.batch.real_tokens(), "only the real tokens' rows"),
    }
    assert_eq!(ranges, model.ready_ranges(split_lookup));
    ranges.sort_by_key(|r| r.start);
    let mut next = 0;
    for r in &ranges {
        assert_eq!(r.start, next, "ranges {ranges:?}");
        next = r.end;
    }
    assert_eq!(next, f.layout.total_len());
    (sums, grads)
}

fn check_gradients<A: Element>(f: &Fixture, params: &[A], loss_tol: f64, grad_tol: f64) {
    for split_lookup in [false, true] {
        for unpad in [None, Some(1)] {
            check_gradients_of(f, params, loss_tol, grad_tol, split_lookup, unpad);
        }
    }
}

fn check_gradients_of<A: Element>(
    f: &Fixture,
    params: &[A],
    loss_tol: f64,
    grad_tol: f64,
    split_lookup: bool,
    unpad: Option<usize>,
) {
    let (sums, grads) = gradients(f, params, split_lookup, unpad);
    let n_masked = f.expected["n_masked"].as_u64().unwrap() as usize;
    assert_eq!(sums.mlm_count, n_masked);
    let mlm_sum = f.expected["mlm_loss_sum"].as_f64().unwrap();
    let e = (sums.mlm_loss_sum.to64() - mlm_sum).abs() / mlm_sum;
    assert!(
        e < loss_tol,
        "mlm_loss_sum {} vs {mlm_sum}: {e:e}",
        sums.mlm_loss_sum
    );
    let mut loss = sums.mlm_loss_sum.to64() / n_masked as f64;
    if f.heads == Heads::PreTraining {
        assert_eq!(sums.nsp_count, f.batch.batch_size());
        loss += sums.nsp_loss_sum.to64() / sums.nsp_count as f64;
    }
    let want_loss = f.expected["loss"].as_f64().unwrap();
    let e = (loss - want_loss).abs() / want_loss;
    assert!(e < loss_tol, "loss {loss} vs {want_loss}: {e:e}");

    let want = tensors(f, "grads.safetensors");
    for entry in f.layout.entries() {
        let got: Vec<f64> = grads[entry.range()].iter().map(|x| x.to64()).collect();
        let (shape, w) = &want[&entry.name];
        assert_eq!(shape, &entry.shape, "{}", entry.name);
        let e = rel_err(&got, w);
        assert!(e < grad_tol, "{}: grad rel err {e:e}", entry.name);
    }
    // The tied names hold the same summed gradient.
    assert_eq!(
        want["cls.predictions.decoder.weight"].1,
        want["bert.embeddings.word_embeddings.weight"].1
    );
    assert_eq!(
        want["cls.predictions.decoder.bias"].1,
        want["cls.predictions.bias"].1
    );
    let norm = grads
        .iter()
        .map(|g| g.to64() * g.to64())
        .sum::<f64>()
        .sqrt();
    let want_norm = f.expected["grad_global_norm"].as_f64().unwrap();
    let e = (norm - want_norm).abs() / want_norm;
    assert!(e < grad_tol, "grad norm {norm} vs {want_norm}: {e:e}");
}

#[test]
fn mlm_forward_and_gradients_f64() {
    let f = fixture("bert-micro-mlm");
    assert_eq!(f.heads, Heads::MaskedLm);
    let params = load_safetensors_f64(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check_forward(&f, &params, 1e-10);
    check_gradients(&f, &params, 1e-11, 1e-9);
}

#[test]
fn pretraining_forward_and_gradients_f64() {
    let f = fixture("bert-micro-pretraining");
    assert_eq!(f.heads, Heads::PreTraining);
    let params = load_safetensors_f64(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check_forward(&f, &params, 1e-10);
    check_gradients(&f, &params, 1e-11, 1e-9);
}

#[test]
fn mlm_forward_and_gradients_f32() {
    let f = fixture("bert-micro-mlm");
    let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check_forward(&f, &params, 1e-5);
    check_gradients(&f, &params, 1e-5, 1e-4);
}

#[test]
fn pretraining_forward_and_gradients_f32() {
    let f = fixture("bert-micro-pretraining");
    let params = load_safetensors(format!("{}/model.safetensors", f.dir), &f.layout).unwrap();
    check_forward(&f, &params, 1e-5);
    check_gradients(&f, &params, 1e-5, 1e-4);
}
