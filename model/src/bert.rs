//! The whole model over one flat parameter buffer (HF: `BertForMaskedLM`,
//! `BertForPreTraining`): embeddings, `L` encoder layers, the MLM head at the masked positions
//! and, for PreTraining, the NSP head.
//!
//! Shapes: `b` sequences, `t` tokens per sequence, `n` token rows (`b * t`, or only the real
//! tokens when training and evaluation leave padding out: `super::packing`), `c` hidden, `m`
//! masked positions, `v` vocabulary.

use keel_proto::precision::Precision;
use std::ops::Range;

use ndarray::Array2;

use keel_proto::config::BertConfig;
use keel_proto::params::{Heads, ParamLayout};

use super::attention::AttentionScratch;
use super::bf16_shared::{Flat, round_once};
use super::dropout::DropoutKey;
use super::element::grow;
use super::embeddings::{Embeddings, EmbeddingsCache, TokenInputs};
use super::encoder_layer::{EncoderLayer, LayerCache, LayerInputs, LayerScratch};
use super::gemms::Gemms;
use super::lookup_grads::LookupGrads;
use super::loss::cross_entropy;
use super::mlm_head::{MlmCache, MlmHead};
use super::nsp_head::{NspCache, NspHead};
use super::packing::Packing;
use super::{Element, LossSums, ModelError, StepOptions};
use crate::batch::Batch;

// Checks of the inputs (`impl Bert` continued; this file names nothing in them, so the two
// files make no import cycle).
#[path = "bert_inputs.rs"]
mod inputs;
// The eval forwards (`impl Bert` continued).
#[path = "bert_eval.rs"]
mod eval;

/// Token inputs after checking (`inputs`), as flat slices: ids, token types and mask `[b, t]`.
struct Tokens<'a> {
    ids: &'a [u32],
    types: &'a [u32],
    mask: &'a [u8],
    b: usize,
    t: usize,
}

/// BERT with its heads, generic over f32 (training) and f64 (exactness checks). Holds no
/// parameters, only their layout and the activation buffers it reuses from step to step
/// (they grow to the largest batch seen and never shrink).
#[derive(Debug)]
pub struct Bert<A: Element> {
    config: BertConfig,
    heads: Heads,
    layout: ParamLayout,
    embeddings: Embeddings,
    layers: Vec<EncoderLayer>,
    mlm: MlmHead,
    nsp: Option<NspHead>,
    /// Gradient ranges in the order backward finishes them (see `forward_backward`).
    ready: ReadyRanges,
    state: State<A>,
    /// How every GEMM of forward and backward runs: made from the precision (fp32 unless set)
    /// here, once, and passed to each layer call (no state of the thread decides it).
    gemms: Gemms,
    /// The parameters' bf16 copy `[total_len]`, rounded once per training step on the native
    /// bf16 route for every GEMM that reads a weight (forward and backward); empty elsewhere.
    /// Reused from step to step.
    params16: Vec<u16>,
    /// Training and evaluation leave padding rows out, the rest rounded up to a multiple of
    /// this many rows (`super::packing`); `None`: every padded row.
    unpad: Option<usize>,
}

/// The flat-buffer ranges that become final together during the backward.
#[derive(Debug, Clone)]
struct ReadyRanges {
    /// Pooler and `cls.*`: final once the heads' backward is done.
    heads: Range<usize>,
    /// Layer `l`'s parameters.
    layers: Vec<Range<usize>>,
    /// The embeddings (word embeddings too: their decoder share is added by the MLM head).
    embeddings: Range<usize>,
    /// The word embeddings alone, `[v, c]`: the start of `embeddings`.
    word: Range<usize>,
}

/// Activations and scratch, reused across steps.
#[derive(Debug, Default)]
struct State<A> {
    emb: EmbeddingsCache<A>,
    /// Hidden states `[L + 1][n, c]`: embeddings output, then each layer's output (only the
    /// last, and one buffer to spare, when `encode` keeps not all).
    hidden: Vec<Vec<A>>,
    layers: Vec<LayerCache<A>>,
    /// Backward scratch shared by the layers; in the forward, where the f32 values of the
    /// activations kept as bf16 copies alone are made (`EncoderLayer::forward`).
    scratch: LayerScratch<A>,
    /// `[n, c]` scratch.
    tmp: Vec<A>,
    /// Attention's forward scratch (`t * t` a thread, more on the batched route).
    attn: AttentionScratch<A>,
    /// Gradient w.r.t. the hidden states, `[n, c]` x 2 (ping-pong through the layers).
    dhidden: [Vec<A>; 2],
    mlm: MlmCache<A>,
    nsp: NspCache<A>,
    /// The rows of the last `encode`d batch.
    packing: Packing,
}

/// Everything the eval forward computes, for comparing with HF (eval mode, no dropout).
#[derive(Debug, Clone)]
pub struct ForwardOutputs<A> {
    /// HF's `hidden_states`: embeddings output then each layer's output, each `[n, c]`.
    pub hidden_states: Vec<Array2<A>>,
    /// MLM logits at every position `[n, v]`.
    pub logits: Array2<A>,
    /// NSP logits `[b, 2]` (PreTraining only).
    pub seq_relationship_logits: Option<Array2<A>>,
}

impl<A: Element> Bert<A> {
    /// A model for `config` (validated) with the given heads.
    ///
    /// Errors: [`ModelError::Config`] if the config is invalid.
    pub fn new(config: &BertConfig, heads: Heads) -> Result<Bert<A>, ModelError> {
        config.validate()?;
        let layout = ParamLayout::bert(config, heads);
        let modules = layout.modules();
        let layers: Vec<EncoderLayer> = (modules.layers.iter().enumerate())
            .map(|(l, params)| EncoderLayer::new(config, params, l))
            .collect();
        let word = &modules.embeddings.word;
        let ready = ReadyRanges {
            heads: modules.heads_span.clone(),
            layers: modules.layers.iter().map(|l| l.span.clone()).collect(),
            embeddings: modules.embeddings.span.clone(),
            word: word.range(),
        };
        let state = State {
            hidden: (0..=config.num_hidden_layers).map(|_| Vec::new()).collect(),
            layers: (0..config.num_hidden_layers)
                .map(|_| LayerCache::default())
                .collect(),
            ..State::default()
        };
        Ok(Bert {
            embeddings: Embeddings::new(config, &modules.embeddings),
            mlm: MlmHead::new(config, &modules.mlm, word),
            nsp: modules.nsp.as_ref().map(NspHead::new),
            config: config.clone(),
            heads,
            layout,
            layers,
            ready,
            state,
            gemms: Gemms::FP32,
            params16: Vec::new(),
            unpad: Some(super::packing::DEFAULT_ROW_MULTIPLE),
        })
    }

    /// Sets the precision of every GEMM of forward and backward (`super::bf16`): fp32, or bf16
    /// inputs with fp32 accumulation. Everything else stays fp32 (or f64) either way.
    pub fn set_precision(&mut self, precision: Precision) {
        self.gemms = Gemms::new::<A>(precision);
    }

    /// Keeps no bf16 copy between GEMMs (each rounds its operands itself): the reference the
    /// kept copies are checked against. Undone by [`Bert::set_precision`].
    #[cfg(test)]
    pub(crate) fn keep_no_bf16_copies(&mut self) {
        self.gemms = self.gemms.keeping_nothing();
    }

    /// The precision set by [`Bert::set_precision`] (fp32 by default).
    pub fn precision(&self) -> Precision {
        self.gemms.precision()
    }

    /// Whether [`Bert::forward_backward`] and [`Bert::forward_loss`] compute only the real
    /// tokens' rows, rounded up to a multiple of `Some(rows)` (the default:
    /// [`UNPAD_ROW_MULTIPLE`](super::UNPAD_ROW_MULTIPLE); batches whose rounded rows would not
    /// be fewer keep all of theirs), or every row of the padded batch (`None`: the same losses
    /// and gradients to rounding, more work; for comparisons). See `super::packing`.
    pub fn set_unpadding(&mut self, unpad: Option<usize>) {
        self.unpad = unpad;
    }

    /// Token rows the last forward computed: `b * t` of its batch, or fewer where padding was
    /// left out (see [`Bert::set_unpadding`]).
    pub fn rows_computed(&self) -> usize {
        self.state.packing.rows()
    }

    /// Bytes of the activations the last forward kept for the backward: every layer's cache
    /// (bf16 copies included; where only they are kept, the f32 values of `q`, `k`, `v`,
    /// `ctx`, `h1` and `act` are not), the hidden states `[L + 1][n, c]` (two buffers where
    /// the layers keep their inputs' bf16 copies: `encode`), the embeddings' LayerNorm and the
    /// MLM head's buffers (its logits `[m, v]`). Scratch shared by the layers is left out.
    /// Counted by capacity: what stays allocated between steps.
    pub fn saved_activation_bytes(&self) -> usize {
        use super::element::held;
        let st = &self.state;
        st.layers.iter().map(|l| l.bytes()).sum::<usize>()
            + st.hidden.iter().map(held).sum::<usize>()
            + held(&st.emb.xhat)
            + held(&st.emb.rstd)
            + st.mlm.bytes()
    }

    /// The parameter layout this model reads its flat buffers with.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The config the model was built from.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The heads on the encoder.
    pub fn heads(&self) -> Heads {
        self.heads
    }

    /// Embeddings and encoder: plans `state.packing` (padding left out, rows rounded up to a
    /// multiple of `pack`, see `super::packing`; `masked` `[m]` are the flat positions the
    /// heads will read) and fills `state.hidden[L]` `[n, c]`, and `state.hidden[0..L]` too
    /// when `all_hidden`.
    ///
    /// Without `all_hidden` a state is overwritten once the layer that reads it has run: two
    /// buffers serve all `L + 1` (the second left in a slot of its own for the next call).
    /// Only for callers that read no state but the last after this: the eval losses, and a
    /// training step whose layers keep the bf16 copies of their inputs (the backward then
    /// reads the copies, [`Gemms::keeps`]).
    fn encode(
        &mut self,
        params: Flat<'_, A>,
        tok: &Tokens<'_>,
        dropout: Option<(DropoutKey, &[u64])>,
        masked: &[usize],
        pack: Option<usize>,
        all_hidden: bool,
    ) {
        let st = &mut self.state;
        // Without `all_hidden`: the allocated buffers, handed out as the states are made.
        let mut spare: Vec<Vec<A>> = Vec::new();
        if !all_hidden {
            spare.extend(st.hidden.iter_mut().map(std::mem::take));
            spare.retain(|buf| buf.capacity() > 0);
            st.hidden[0] = spare.pop().unwrap_or_default();
        }
        st.packing.plan(tok.mask, tok.b, tok.t, masked, pack);
        let (n, c) = (st.packing.rows(), self.config.hidden_size);
        let inputs = TokenInputs {
            input_ids: tok.ids,
            token_type_ids: tok.types,
            b: tok.b,
            t: tok.t,
            dropout,
            packing: &st.packing,
        };
        let sum = grow(&mut st.tmp, n * c);
        let h0 = grow(&mut st.hidden[0], n * c);
        self.embeddings
            .forward(h0, &mut st.emb, sum, &inputs, params.f32);
        let layer_inputs = LayerInputs {
            b: tok.b,
            t: tok.t,
            mask: tok.mask,
            dropout,
            packing: &st.packing,
            gemms: self.gemms,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            if !all_hidden {
                st.hidden[l + 1] = spare.pop().unwrap_or_default();
            }
            let (before, after) = st.hidden.split_at_mut(l + 1);
            let y = grow(&mut after[0], n * c);
            layer.forward(
                y,
                &mut st.layers[l],
                &mut st.tmp,
                &mut st.scratch,
                &mut st.attn,
                &before[l],
                &layer_inputs,
                params,
            );
            if !all_hidden {
                // State `l` is read no more.
                spare.push(std::mem::take(&mut st.hidden[l]));
            }
        }
        for buf in spare {
            if let Some(slot) = st.hidden.iter_mut().find(|h| h.capacity() == 0) {
                *slot = buf;
            }
        }
    }

    /// One training (or eval-gradient) step on `batch`: accumulates (`+=`) into `grads` the
    /// gradient of `opts.mlm_scale * mlm_loss_sum + opts.nsp_scale * nsp_loss_sum`, and
    /// returns the loss sums.
    ///
    /// With `opts.report_ready`, `on_grad_ready(range, &grads[range])` is called as soon as a
    /// range of the flat gradient buffer is final, in backward order: the heads (pooler and
    /// `cls.*`), then encoder layers `L-1` down to `0`, then the embeddings (last: the lookup's
    /// share of their gradient is the last thing backward computes, and the word embeddings
    /// also hold the tied decoder's share). The ranges cover `0..total_len` exactly once.
    ///
    /// Errors: [`ModelError::BufferLength`] if `params` or `grads` does not match the layout;
    /// [`ModelError::ShapeMismatch`], [`ModelError::OutOfRange`],
    /// [`ModelError::SequenceTooLong`], [`ModelError::MissingNextSentenceLabels`] for a bad batch.
    pub fn forward_backward(
        &mut self,
        params: &[A],
        grads: &mut [A],
        batch: &Batch,
        opts: &StepOptions<A>,
        on_grad_ready: &mut dyn FnMut(Range<usize>, &[A]),
    ) -> Result<LossSums<A>, ModelError> {
        self.step(params, grads, None, batch, opts, on_grad_ready)
    }

    /// As [`Bert::forward_backward`], but the word embeddings' lookup share of the gradient
    /// goes into `lookup` (`+=`, rows `[u, c]`, see [`LookupGrads`]) instead of `grads`, so the
    /// word-embedding range of `grads` holds only the tied decoder's share. That range is then
    /// final right after the heads' backward, and `on_grad_ready` reports it there: the heads,
    /// the word embeddings, layers `L-1` to `0`, then the rest of the embeddings (position,
    /// token type, LayerNorm). The full gradient is `grads` plus `lookup` added in with
    /// [`LookupGrads::add_into`].
    ///
    /// Errors: as [`Bert::forward_backward`], and [`ModelError::LookupRowMissing`] if a token
    /// of the batch has no row in `lookup`.
    pub fn forward_backward_split_lookup(
        &mut self,
        params: &[A],
        grads: &mut [A],
        lookup: &mut LookupGrads<A>,
        batch: &Batch,
        opts: &StepOptions<A>,
        on_grad_ready: &mut dyn FnMut(Range<usize>, &[A]),
    ) -> Result<LossSums<A>, ModelError> {
        self.step(params, grads, Some(lookup), batch, opts, on_grad_ready)
    }

    /// The ranges `forward_backward` (`split_lookup = false`) or
    /// `forward_backward_split_lookup` (`true`) reports, in the order it reports them; they
    /// cover `0..total_len` exactly once. Gradient buckets cut at their edges are sent as
    /// early as backward allows.
    pub fn ready_ranges(&self, split_lookup: bool) -> Vec<Range<usize>> {
        let r = &self.ready;
        let mut out = vec![r.heads.clone()];
        if split_lookup {
            out.push(r.word.clone());
        }
        out.extend(r.layers.iter().rev().cloned());
        out.push(if split_lookup {
            r.word.end..r.embeddings.end
        } else {
            r.embeddings.clone()
        });
        out
    }

    /// The word embeddings' range `[v * c]` of the flat parameter and gradient buffers
    /// (`bert.embeddings.word_embeddings.weight`).
    pub fn word_embeddings_range(&self) -> Range<usize> {
        self.ready.word.clone()
    }

    fn step(
        &mut self,
        params: &[A],
        grads: &mut [A],
        lookup: Option<&mut LookupGrads<A>>,
        batch: &Batch,
        opts: &StepOptions<A>,
        on_grad_ready: &mut dyn FnMut(Range<usize>, &[A]),
    ) -> Result<LossSums<A>, ModelError> {
        self.check_buffer("params", params.len())?;
        self.check_buffer("grads", grads.len())?;
        self.check_batch(batch, opts.dropout.is_some())?;
        let tok = self.tokens(batch)?;
        if let Some(lookup) = lookup.as_deref() {
            lookup.check(tok.ids, self.config.hidden_size)?;
        }
        // Every weight feeds a GEMM in forward and another in backward: round them once (the
        // buffer is taken out of `self` for the step, so the layers can borrow both).
        let mut params16 = std::mem::take(&mut self.params16);
        let params_both = round_once(self.gemms, params, &mut params16);
        let sums = self.step_checked(params_both, grads, lookup, batch, opts, &tok, on_grad_ready);
        self.params16 = params16;
        Ok(sums)
    }

    /// [`Bert::step`] after its checks: `params` with its bf16 copy on the native route.
    #[allow(clippy::too_many_arguments)]
    fn step_checked(
        &mut self,
        params: Flat<'_, A>,
        grads: &mut [A],
        mut lookup: Option<&mut LookupGrads<A>>,
        batch: &Batch,
        opts: &StepOptions<A>,
        tok: &Tokens<'_>,
        on_grad_ready: &mut dyn FnMut(Range<usize>, &[A]),
    ) -> LossSums<A> {
        let dropout = opts.dropout.map(|key| (key, batch.sample_ids.as_slice()));
        // The backward reads a layer's input only where no bf16 copy of it is kept.
        let all_hidden = !self.gemms.keeps();
        let masked = &batch.masked_positions;
        self.encode(params, tok, dropout, masked, self.unpad, all_hidden);
        let g = self.gemms;

        let (b, t) = (tok.b, tok.t);
        let (n, c, v) = (
            self.state.packing.rows(),
            self.config.hidden_size,
            self.config.vocab_size,
        );
        let num_layers = self.layers.len();
        let mut report = |range: Range<usize>, grads: &[A]| {
            if opts.report_ready {
                on_grad_ready(range.clone(), &grads[range]);
            }
        };
        let st = &mut self.state;
        let mut sums = LossSums::default();
        let dh = grow(&mut st.dhidden[0], n * c);
        dh.fill(A::zero());

        // MLM head at the masked positions (their rows).
        let positions = st.packing.positions();
        let m = positions.len();
        if m > 0 {
            self.mlm
                .forward(g, &mut st.mlm, &st.hidden[num_layers], positions, params);
            let ce = cross_entropy(
                &mut st.mlm.logits[..m * v],
                &batch.masked_labels,
                v,
                Some(opts.mlm_scale),
            );
            sums.mlm_loss_sum = ce.loss_sum;
            sums.mlm_count = m;
            sums.mlm_correct = ce.correct;
            self.mlm
                .backward(g, dh, &mut st.mlm, positions, params, grads);
        }
        // NSP head on [CLS].
        if let (Some(nsp), Some(labels)) = (&self.nsp, &batch.next_sentence_labels) {
            let cls = st.packing.firsts();
            nsp.forward(g, &mut st.nsp, &st.hidden[num_layers], cls, params);
            let ce = cross_entropy(&mut st.nsp.logits[..b * 2], labels, 2, Some(opts.nsp_scale));
            sums.nsp_loss_sum = ce.loss_sum;
            sums.nsp_count = b;
            sums.nsp_correct = ce.correct;
            nsp.backward(g, dh, &mut st.nsp, cls, params, grads);
        }
        report(self.ready.heads.clone(), grads);
        if lookup.is_some() {
            // Only the decoder adds into the word embeddings here: their range is final.
            report(self.ready.word.clone(), grads);
        }

        let layer_inputs = LayerInputs {
            b,
            t,
            mask: tok.mask,
            dropout,
            packing: &st.packing,
            gemms: g,
        };
        for l in (0..num_layers).rev() {
            let [dy, dx] = &mut st.dhidden;
            let dx = grow(dx, n * c);
            self.layers[l].backward(
                dx,
                dy,
                &st.layers[l],
                &mut st.scratch,
                &st.hidden[l],
                &layer_inputs,
                params,
                grads,
            );
            st.dhidden.swap(0, 1);
            report(self.ready.layers[l].clone(), grads);
        }
        let inputs = TokenInputs {
            input_ids: tok.ids,
            token_type_ids: tok.types,
            b,
            t,
            dropout,
            packing: &st.packing,
        };
        let dsum = grow(&mut st.tmp, n * c);
        self.embeddings.backward(
            &mut st.dhidden[0],
            dsum,
            &st.emb,
            &inputs,
            params.f32,
            grads,
            lookup.as_deref_mut(),
        );
        let rest = if lookup.is_some() {
            self.ready.word.end..self.ready.embeddings.end
        } else {
            self.ready.embeddings.clone()
        };
        report(rest, grads);
        sums
    }
}
