//! Loading the PyTorch reference fixtures (fixtures/ in the repository) for the tests.
#![allow(dead_code)]

use std::collections::BTreeMap;

use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use keel_proto::weights::load_tensors_f64;
use keel_worker::batch::Batch;
use ndarray::Array2;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures");

pub struct Fixture {
    pub dir: String,
    pub config: BertConfig,
    pub heads: Heads,
    pub layout: ParamLayout,
    pub batch: Batch,
    pub expected: serde_json::Value,
}

pub fn fixture(name: &str) -> Fixture {
    let dir = format!("{FIXTURES}/{name}");
    let config = BertConfig::from_json_file(format!("{dir}/config.json")).unwrap();
    let heads = config.heads();
    let layout = ParamLayout::bert(&config, heads);
    let batch_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/batch.json")).unwrap())
            .unwrap();
    let rows =
        |key: &str| -> Vec<Vec<i64>> { serde_json::from_value(batch_json[key].clone()).unwrap() };
    let ids = rows("input_ids");
    let (b, t) = (ids.len(), ids[0].len());
    let to2 = |v: Vec<Vec<i64>>| -> Vec<i64> { v.into_iter().flatten().collect() };
    let labels = to2(rows("labels"));
    let masked_positions: Vec<usize> = (0..b * t).filter(|&i| labels[i] != -100).collect();
    let batch = Batch {
        input_ids: Array2::from_shape_vec((b, t), to2(ids).into_iter().map(|x| x as u32).collect())
            .unwrap(),
        token_type_ids: Array2::from_shape_vec(
            (b, t),
            to2(rows("token_type_ids"))
                .into_iter()
                .map(|x| x as u32)
                .collect(),
        )
        .unwrap(),
        attention_mask: Array2::from_shape_vec(
            (b, t),
            to2(rows("attention_mask"))
                .into_iter()
                .map(|x| x as u8)
                .collect(),
        )
        .unwrap(),
        masked_labels: masked_positions.iter().map(|&i| labels[i] as u32).collect(),
        masked_positions,
        next_sentence_labels: batch_json
            .get("next_sentence_label")
            .map(|v| serde_json::from_value::<Vec<u32>>(v.clone()).unwrap()),
        sample_ids: (0..b as u64).collect(),
    };
    let expected =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/expected.json")).unwrap())
            .unwrap();
    Fixture {
        dir,
        config,
        heads,
        layout,
        batch,
        expected,
    }
}

/// max |got - want| / max |want| (with max |want| floored at 1e-3: some gradients are exactly
/// zero in exact arithmetic, e.g. the key bias, whose shift every softmax ignores).
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0, f64::max);
    diff / scale.max(1e-3)
}

pub fn tensors(f: &Fixture, file: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    load_tensors_f64(format!("{}/{file}", f.dir)).unwrap()
}
