//! The flat parameter layout: every BERT tensor as a named view into one `[f32]` buffer.
//!
//! Weights, gradients and optimizer moments all share this layout, so the all-reduce, the
//! optimizer and the checkpoint each walk one slice.
//!
//! # Layout
//! Tensors in HF state-dict order with HF names (HF: `BertForMaskedLM.state_dict()`, tied
//! `cls.predictions.decoder.*` left out because they are `bert.embeddings.word_embeddings.weight`
//! and `cls.predictions.bias`):
//! 1. `bert.embeddings.{word,position,token_type}_embeddings.weight`, `bert.embeddings.LayerNorm.{weight,bias}`
//! 2. for each layer `l`: `bert.encoder.layer.{l}.attention.self.{query,key,value}.{weight,bias}`,
//!    `...attention.output.dense.*`, `...attention.output.LayerNorm.*`, `...intermediate.dense.*`,
//!    `...output.dense.*`, `...output.LayerNorm.*`
//! 3. PreTraining only: `bert.pooler.dense.{weight,bias}`
//! 4. `cls.predictions.bias`, `cls.predictions.transform.dense.*`, `cls.predictions.transform.LayerNorm.*`
//! 5. PreTraining only: `cls.seq_relationship.{weight,bias}`
//!
//! Linear weights are `[out, in]` (PyTorch's `nn.Linear`), embeddings `[rows, hidden]`.

use std::ops::Range;

use crate::config::BertConfig;
// Which heads sit on the encoder is the model config's (`architectures`); a layout is made
// for one, and `keel_proto::params::Heads` keeps naming it.
pub use crate::config::Heads;

/// One named tensor in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamView {
    /// HF state-dict name, e.g. `bert.encoder.layer.0.attention.self.query.weight`.
    pub name: String,
    /// PyTorch shape, e.g. `[out, in]` for a Linear weight.
    pub shape: Vec<usize>,
    /// Start in the flat buffer (elements).
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub len: usize,
    /// Whether weight decay (and LAMB's trust ratio) applies: false for biases and LayerNorm
    /// parameters, as in BERT's optimizer (Devlin et al. 2019, `optimization.py`) and HF's
    /// `no_decay = ["bias", "LayerNorm.weight"]`.
    pub decay: bool,
}

impl ParamView {
    /// The elements `offset..offset + len` (for slicing weights, grads, moments).
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The named views of a flat parameter buffer, and the same views grouped by the module
/// that owns them ([`BertParams`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamView>,
    total_len: usize,
    modules: BertParams,
}

/// A Linear's tensors (HF `nn.Linear`): `weight` `[out, in]`, `bias` `[out]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearParams {
    /// `{prefix}.weight`, `[out, in]`.
    pub weight: ParamView,
    /// `{prefix}.bias`, `[out]`.
    pub bias: ParamView,
}

impl LinearParams {
    /// Output features (`weight.shape[0]`).
    pub fn out_features(&self) -> usize {
        self.weight.shape[0]
    }

    /// Input features (`weight.shape[1]`).
    pub fn in_features(&self) -> usize {
        self.weight.shape[1]
    }
}

/// A LayerNorm's tensors (HF `nn.LayerNorm`): `weight` (gamma) and `bias` (beta), `[hidden]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerNormParams {
    /// `{prefix}.weight` (gamma), `[hidden]`.
    pub weight: ParamView,
    /// `{prefix}.bias` (beta), `[hidden]`.
    pub bias: ParamView,
}

/// `bert.embeddings.*` (HF `BertEmbeddings`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingParams {
    /// `word_embeddings.weight`, `[vocab_size, hidden]`; also the MLM decoder's weight (tied).
    pub word: ParamView,
    /// `position_embeddings.weight`, `[max_position_embeddings, hidden]`.
    pub position: ParamView,
    /// `token_type_embeddings.weight`, `[type_vocab_size, hidden]`.
    pub token_type: ParamView,
    /// `LayerNorm.*`.
    pub layer_norm: LayerNormParams,
    /// Every element of the embeddings' tensors, in the flat buffer.
    pub span: Range<usize>,
}

/// `bert.encoder.layer.{l}.*` (HF `BertLayer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderLayerParams {
    /// `attention.self.query`, `[hidden, hidden]`.
    pub query: LinearParams,
    /// `attention.self.key`, `[hidden, hidden]`.
    pub key: LinearParams,
    /// `attention.self.value`, `[hidden, hidden]`.
    pub value: LinearParams,
    /// `attention.output.dense`, `[hidden, hidden]`.
    pub attention_output: LinearParams,
    /// `attention.output.LayerNorm`.
    pub attention_layer_norm: LayerNormParams,
    /// `intermediate.dense`, `[intermediate_size, hidden]`.
    pub intermediate: LinearParams,
    /// `output.dense`, `[hidden, intermediate_size]`.
    pub output: LinearParams,
    /// `output.LayerNorm`.
    pub output_layer_norm: LayerNormParams,
    /// Every element of this layer's tensors, in the flat buffer.
    pub span: Range<usize>,
}

/// `cls.predictions.*` (HF `BertLMPredictionHead`); its decoder weight is tied to
/// [`EmbeddingParams::word`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlmHeadParams {
    /// `bias`, `[vocab_size]`: the decoder's bias.
    pub bias: ParamView,
    /// `transform.dense`, `[hidden, hidden]`.
    pub transform: LinearParams,
    /// `transform.LayerNorm`.
    pub layer_norm: LayerNormParams,
}

/// The next-sentence head: `bert.pooler.dense` (HF `BertPooler`) and `cls.seq_relationship`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NspHeadParams {
    /// `bert.pooler.dense`, `[hidden, hidden]`.
    pub pooler: LinearParams,
    /// `cls.seq_relationship`, `[2, hidden]`.
    pub classifier: LinearParams,
}

/// Every module's tensors, each named once, in the walk that made the layout
/// ([`ParamLayout::bert`]): the model's modules take their handles from here, and the
/// gradient all-reduce its ready ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BertParams {
    /// `bert.embeddings`.
    pub embeddings: EmbeddingParams,
    /// `bert.encoder.layer.{l}`, `[num_hidden_layers]`.
    pub layers: Vec<EncoderLayerParams>,
    /// `cls.predictions`.
    pub mlm: MlmHeadParams,
    /// The pooler and `cls.seq_relationship` ([`Heads::PreTraining`] only).
    pub nsp: Option<NspHeadParams>,
    /// The heads' elements, from the first head tensor (the pooler, or `cls.predictions.bias`)
    /// to the end of the buffer.
    pub heads_span: Range<usize>,
}

impl ParamLayout {
    /// The layout of a BERT with the given heads (see the module docs for the order). Each
    /// name is written once here, as the segments of a path (`bert`, `encoder`, `layer`, `0`,
    /// ...), in the style of candle's `VarBuilder::pp`.
    /// The config is assumed valid ([`BertConfig::validate`]).
    pub fn bert(config: &BertConfig, heads: Heads) -> ParamLayout {
        let (c, f) = (config.hidden_size, config.intermediate_size);
        let mut entries = Entries::default();
        let mut root = Builder {
            prefix: String::new(),
            entries: &mut entries,
        };
        let mut bert = root.pp("bert");
        let embeddings = EmbeddingParams::walk(&mut bert.pp("embeddings"), config);
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                EncoderLayerParams::walk(
                    &mut bert.pp("encoder").pp("layer").pp(&l.to_string()),
                    c,
                    f,
                )
            })
            .collect();
        let heads_start = bert.offset();
        let pooler = (heads == Heads::PreTraining).then(|| bert.pp("pooler").linear("dense", c, c));
        let mut cls = root.pp("cls");
        let mut predictions = cls.pp("predictions");
        let bias = predictions.push("bias", &[config.vocab_size]);
        let mut transform = predictions.pp("transform");
        let mlm = MlmHeadParams {
            bias,
            transform: transform.linear("dense", c, c),
            layer_norm: transform.layer_norm("LayerNorm", c),
        };
        let nsp = pooler.map(|pooler| NspHeadParams {
            pooler,
            classifier: cls.linear("seq_relationship", 2, c),
        });
        ParamLayout {
            total_len: entries.offset,
            modules: BertParams {
                embeddings,
                layers,
                mlm,
                nsp,
                heads_span: heads_start..entries.offset,
            },
            entries: entries.entries,
        }
    }

    /// All tensors in layout order.
    pub fn entries(&self) -> &[ParamView] {
        &self.entries
    }

    /// Total number of elements (parameters) in the flat buffer.
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// The view with this HF name, if any.
    pub fn find(&self, name: &str) -> Option<&ParamView> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The same views grouped by module (names written once, in [`ParamLayout::bert`]).
    pub fn modules(&self) -> &BertParams {
        &self.modules
    }
}

impl EmbeddingParams {
    /// Appends `word_embeddings`, `position_embeddings`, `token_type_embeddings` and
    /// `LayerNorm` under `scope` (`bert.embeddings`).
    fn walk(scope: &mut Builder, config: &BertConfig) -> EmbeddingParams {
        let c = config.hidden_size;
        let start = scope.offset();
        EmbeddingParams {
            word: scope.push("word_embeddings.weight", &[config.vocab_size, c]),
            position: scope.push(
                "position_embeddings.weight",
                &[config.max_position_embeddings, c],
            ),
            token_type: scope.push("token_type_embeddings.weight", &[config.type_vocab_size, c]),
            layer_norm: scope.layer_norm("LayerNorm", c),
            span: start..scope.offset(),
        }
    }
}

impl EncoderLayerParams {
    /// Appends one encoder layer's tensors under `scope` (`bert.encoder.layer.{l}`), hidden
    /// size `c`, intermediate size `f`.
    fn walk(scope: &mut Builder, c: usize, f: usize) -> EncoderLayerParams {
        let start = scope.offset();
        let mut attention = scope.pp("attention");
        let mut self_attention = attention.pp("self");
        let query = self_attention.linear("query", c, c);
        let key = self_attention.linear("key", c, c);
        let value = self_attention.linear("value", c, c);
        let mut attention_output = attention.pp("output");
        let dense = attention_output.linear("dense", c, c);
        let attention_layer_norm = attention_output.layer_norm("LayerNorm", c);
        let intermediate = scope.pp("intermediate").linear("dense", f, c);
        let mut output = scope.pp("output");
        let output_dense = output.linear("dense", c, f);
        let output_layer_norm = output.layer_norm("LayerNorm", c);
        EncoderLayerParams {
            query,
            key,
            value,
            attention_output: dense,
            attention_layer_norm,
            intermediate,
            output: output_dense,
            output_layer_norm,
            span: start..scope.offset(),
        }
    }
}

/// The views appended so far by one walk.
#[derive(Default)]
struct Entries {
    entries: Vec<ParamView>,
    offset: usize,
}

/// A scope of the layout walk: a name prefix (`bert.encoder.layer.0`) over the views appended
/// so far. [`Builder::pp`] opens a child scope one segment deeper.
struct Builder<'a> {
    prefix: String,
    entries: &'a mut Entries,
}

impl Builder<'_> {
    /// The child scope `{prefix}.{segment}` (candle's `pp`, "push prefix").
    fn pp(&mut self, segment: &str) -> Builder<'_> {
        Builder {
            prefix: self.name(segment),
            entries: self.entries,
        }
    }

    fn name(&self, segment: &str) -> String {
        if self.prefix.is_empty() {
            segment.to_string()
        } else {
            format!("{}.{segment}", self.prefix)
        }
    }

    /// The next free element of the flat buffer.
    fn offset(&self) -> usize {
        self.entries.offset
    }

    /// Appends the tensor `{prefix}.{name}` of `shape`.
    fn push(&mut self, name: &str, shape: &[usize]) -> ParamView {
        let name = self.name(name);
        let len = shape.iter().product();
        let decay = !(name.ends_with(".bias") || name.contains("LayerNorm"));
        let view = ParamView {
            name,
            shape: shape.to_vec(),
            offset: self.entries.offset,
            len,
            decay,
        };
        self.entries.entries.push(view.clone());
        self.entries.offset += len;
        view
    }

    fn linear(&mut self, name: &str, out: usize, inp: usize) -> LinearParams {
        let mut scope = self.pp(name);
        LinearParams {
            weight: scope.push("weight", &[out, inp]),
            bias: scope.push("bias", &[out]),
        }
    }

    fn layer_norm(&mut self, name: &str, c: usize) -> LayerNormParams {
        let mut scope = self.pp(name);
        LayerNormParams {
            weight: scope.push("weight", &[c]),
            bias: scope.push("bias", &[c]),
        }
    }
}

/// The config fields that give the shape of the tensor named `name` in [`ParamLayout::bert`],
/// for messages ("[vocab_size, hidden_size]"): a shape that does not match names what in the
/// config to look at.
pub fn config_fields(name: &str) -> &'static str {
    let last = |suffix: &str| name.ends_with(suffix);
    if last("word_embeddings.weight") {
        "[vocab_size, hidden_size]"
    } else if last("position_embeddings.weight") {
        "[max_position_embeddings, hidden_size]"
    } else if last("token_type_embeddings.weight") {
        "[type_vocab_size, hidden_size]"
    } else if name == "cls.predictions.bias" {
        "[vocab_size]"
    } else if last("intermediate.dense.weight") {
        "[intermediate_size, hidden_size]"
    } else if last("intermediate.dense.bias") {
        "[intermediate_size]"
    } else if last(".output.dense.weight") && !name.contains("attention") {
        "[hidden_size, intermediate_size]"
    } else if name.starts_with("cls.seq_relationship") {
        if last(".weight") {
            "[2, hidden_size]"
        } else {
            "[2]"
        }
    } else if last(".bias") || name.contains("LayerNorm") {
        "[hidden_size]"
    } else {
        "[hidden_size, hidden_size]"
    }
}

/// What a missing tensor says about the config, for messages: an encoder layer the file does
/// not have means `num_hidden_layers` is larger than the model's.
pub fn missing_hint(name: &str) -> &'static str {
    if name.starts_with("bert.encoder.layer.") {
        " (the model config's num_hidden_layers is larger than the weights')"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_tile_the_buffer_and_decay_flags_follow_names() {
        let config = BertConfig::preset("tiny", 1000).unwrap();
        for heads in [Heads::MaskedLm, Heads::PreTraining] {
            let layout = ParamLayout::bert(&config, heads);
            let mut next = 0;
            for e in layout.entries() {
                assert_eq!(e.offset, next, "{}", e.name);
                assert_eq!(e.len, e.shape.iter().product::<usize>());
                next += e.len;
                let no_decay = e.name.ends_with(".bias") || e.name.contains("LayerNorm");
                assert_eq!(e.decay, !no_decay, "{}", e.name);
            }
            assert_eq!(next, layout.total_len());
            assert_eq!(
                layout.find("bert.pooler.dense.weight").is_some(),
                heads == Heads::PreTraining
            );
        }
        // BERT-tiny with vocab 1000: 2 layers of 4*128*128+4*128 + 2*(128*512)+512+128 + 4*128.
        let layout = ParamLayout::bert(&config, Heads::MaskedLm);
        let per_layer =
            4 * (128 * 128 + 128) + 2 * 128 + (512 * 128 + 512) + (128 * 512 + 128) + 2 * 128;
        let emb = (1000 + 512 + 2) * 128 + 2 * 128;
        let head = 1000 + 128 * 128 + 128 + 2 * 128;
        assert_eq!(layout.total_len(), emb + 2 * per_layer + head);
    }

    /// The names are Hugging Face's `BertForPreTraining.state_dict()` order, less the tied
    /// decoder (written out here as the expected output of the one walk that names them).
    #[test]
    fn names_are_hugging_faces_in_state_dict_order() {
        let mut config = BertConfig::preset("tiny", 1000).unwrap();
        config.num_hidden_layers = 1;
        let layout = ParamLayout::bert(&config, Heads::PreTraining);
        let names: Vec<&str> = layout.entries().iter().map(|e| e.name.as_str()).collect();
        let mut expected = vec![
            "bert.embeddings.word_embeddings.weight".to_string(),
            "bert.embeddings.position_embeddings.weight".into(),
            "bert.embeddings.token_type_embeddings.weight".into(),
            "bert.embeddings.LayerNorm.weight".into(),
            "bert.embeddings.LayerNorm.bias".into(),
        ];
        for part in [
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "attention.output.LayerNorm",
            "intermediate.dense",
            "output.dense",
            "output.LayerNorm",
        ] {
            for t in ["weight", "bias"] {
                expected.push(format!("bert.encoder.layer.0.{part}.{t}"));
            }
        }
        for name in [
            "bert.pooler.dense.weight",
            "bert.pooler.dense.bias",
            "cls.predictions.bias",
            "cls.predictions.transform.dense.weight",
            "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.LayerNorm.weight",
            "cls.predictions.transform.LayerNorm.bias",
            "cls.seq_relationship.weight",
            "cls.seq_relationship.bias",
        ] {
            expected.push(name.to_string());
        }
        assert_eq!(names, expected);
    }

    /// Each module's handles are the views of the same names, and the spans tile the buffer:
    /// embeddings, each layer, then the heads.
    #[test]
    fn module_handles_match_the_named_views_and_spans_tile_the_buffer() {
        let config = BertConfig::preset("tiny", 1000).unwrap();
        for heads in [Heads::MaskedLm, Heads::PreTraining] {
            let layout = ParamLayout::bert(&config, heads);
            let m = layout.modules();
            let named = |v: &ParamView| assert_eq!(layout.find(&v.name), Some(v), "{}", v.name);
            named(&m.embeddings.word);
            named(&m.embeddings.layer_norm.bias);
            let l1 = &m.layers[1];
            assert_eq!(
                l1.query.weight.name,
                "bert.encoder.layer.1.attention.self.query.weight"
            );
            assert_eq!(
                l1.output_layer_norm.bias.name,
                "bert.encoder.layer.1.output.LayerNorm.bias"
            );
            for v in [
                &l1.intermediate.weight,
                &l1.output.bias,
                &l1.attention_output.weight,
            ] {
                named(v);
            }
            named(&m.mlm.bias);
            named(&m.mlm.transform.weight);
            assert_eq!(m.nsp.is_some(), heads == Heads::PreTraining);
            let mut next = 0;
            for span in std::iter::once(&m.embeddings.span)
                .chain(m.layers.iter().map(|l| &l.span))
                .chain(std::iter::once(&m.heads_span))
            {
                assert_eq!(span.start, next);
                next = span.end;
            }
            assert_eq!(next, layout.total_len());
            assert_eq!(m.layers[0].span.start, m.layers[0].query.weight.offset);
            assert_eq!(
                m.layers[0].span.end,
                m.layers[0].output_layer_norm.bias.range().end
            );
        }
    }
}
