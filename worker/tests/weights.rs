//! `model.safetensors` I/O against the files `save_pretrained` wrote (the fixtures), and the
//! fixture's `config.json`.

use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};
use keel_proto::weights::{WeightsError, load_safetensors, save_safetensors, tensor_names};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures");

#[test]
fn save_load_round_trips_bit_exactly_with_hf_names() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["bert-micro-mlm", "bert-micro-pretraining"] {
        let src = format!("{FIXTURES}/{name}/model.safetensors");
        let config = BertConfig::from_json_file(format!("{FIXTURES}/{name}/config.json")).unwrap();
        let layout = ParamLayout::bert(&config, config.heads());
        let params = load_safetensors(&src, &layout).unwrap();
        let out = dir.path().join(format!("{name}.safetensors"));
        save_safetensors(&out, &layout, &params).unwrap();
        let back = load_safetensors(&out, &layout).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&back), bits(&params));
        // Exactly the tensors save_pretrained wrote (no tied decoder), and the same bytes.
        assert_eq!(tensor_names(&out).unwrap(), tensor_names(&src).unwrap());
        assert!(
            !tensor_names(&out)
                .unwrap()
                .iter()
                .any(|n| n.starts_with("cls.predictions.decoder"))
        );
        let ours = std::fs::read(&out).unwrap();
        let theirs = std::fs::read(&src).unwrap();
        let header = |b: &[u8]| -> serde_json::Value {
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            serde_json::from_slice(&b[8..8 + n]).unwrap()
        };
        assert_eq!(header(&ours), header(&theirs));
        assert_eq!(header(&ours)["__metadata__"]["format"], "pt");
        // The layout names are exactly the fixture's tensor names.
        let mut names: Vec<String> = layout.entries().iter().map(|e| e.name.clone()).collect();
        names.sort();
        assert_eq!(names, tensor_names(&src).unwrap());
        // No temp files left behind.
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            if name == "bert-micro-mlm" { 1 } else { 2 }
        );
    }
}

#[test]
fn missing_or_misshaped_tensors_are_named() {
    let config =
        BertConfig::from_json_file(format!("{FIXTURES}/bert-micro-mlm/config.json")).unwrap();
    // An MLM file lacks the pooler a PreTraining layout wants.
    let pre = ParamLayout::bert(&config, Heads::PreTraining);
    match load_safetensors(format!("{FIXTURES}/bert-micro-mlm/model.safetensors"), &pre) {
        Err(WeightsError::MissingTensor { name, .. }) => {
            assert_eq!(name, "bert.pooler.dense.weight")
        }
        other => panic!("{other:?}"),
    }
    // A bigger vocabulary: the word embeddings have the wrong shape.
    let big = BertConfig {
        vocab_size: 600,
        ..config.clone()
    };
    match load_safetensors(
        format!("{FIXTURES}/bert-micro-mlm/model.safetensors"),
        &ParamLayout::bert(&big, Heads::MaskedLm),
    ) {
        Err(WeightsError::ShapeMismatch {
            name,
            expected,
            got,
            ..
        }) => {
            assert_eq!(name, "bert.embeddings.word_embeddings.weight");
            assert_eq!((expected, got), (vec![600, 64], vec![512, 64]));
        }
        other => panic!("{other:?}"),
    }
    // A PreTraining file loads into a MaskedLm layout (extra tensors ignored, as HF does).
    let mlm = ParamLayout::bert(&config, Heads::MaskedLm);
    assert!(
        load_safetensors(
            format!("{FIXTURES}/bert-micro-pretraining/model.safetensors"),
            &mlm
        )
        .is_ok()
    );
    // Not a safetensors file.
    assert!(matches!(
        load_safetensors(format!("{FIXTURES}/bert-micro-mlm/config.json"), &mlm),
        Err(WeightsError::Format { .. })
    ));
    let wrong_len = save_safetensors(
        std::env::temp_dir().join("never-written.safetensors"),
        &mlm,
        &[0.0; 3],
    );
    assert!(matches!(
        wrong_len,
        Err(WeightsError::LengthMismatch { .. })
    ));
}

#[test]
fn fixture_config_parses_and_round_trips() {
    let text =
        std::fs::read_to_string(format!("{FIXTURES}/bert-micro-pretraining/config.json")).unwrap();
    let config: BertConfig = serde_json::from_str(&text).unwrap();
    config.validate().unwrap();
    assert_eq!(config.heads(), Heads::PreTraining);
    let ours: serde_json::Value = serde_json::from_str(&config.to_json_pretty()).unwrap();
    let theirs: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(ours, theirs);
}
