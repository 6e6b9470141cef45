//! Checks of the model's inputs before any computation: buffer lengths `[P]`, token ids and
//! shapes `[b, t]`, masked positions `[m]`, sample ids and NSP labels `[b]`. A batch that
//! fails a check is refused with a [`ModelError`] naming the field, never a panic.

use ndarray::Array2;

use super::{Bert, Tokens};
use crate::batch::Batch;
use crate::{Element, ModelError};

impl<A: Element> Bert<A> {
    /// Checks that a flat buffer named `buffer` has `len = P` elements.
    ///
    /// Errors: [`ModelError::BufferLength`].
    pub(super) fn check_buffer(&self, buffer: &'static str, len: usize) -> Result<(), ModelError> {
        if len != self.layout.total_len() {
            return Err(ModelError::BufferLength {
                buffer,
                expected: self.layout.total_len(),
                got: len,
            });
        }
        Ok(())
    }

    /// Checks ids and shapes of token inputs (`[b, t]` each, flat).
    ///
    /// Errors: [`ModelError::SequenceTooLong`], [`ModelError::ShapeMismatch`],
    /// [`ModelError::OutOfRange`] for an id beyond its vocabulary.
    pub(super) fn check_tokens(
        &self,
        ids: &[u32],
        types: &[u32],
        mask: &[u8],
        b: usize,
        t: usize,
    ) -> Result<(), ModelError> {
        if t > self.config.max_position_embeddings {
            return Err(ModelError::SequenceTooLong {
                seq_len: t,
                max: self.config.max_position_embeddings,
            });
        }
        for (field, len) in [
            ("token_type_ids", types.len()),
            ("attention_mask", mask.len()),
        ] {
            if len != b * t {
                return Err(ModelError::ShapeMismatch {
                    field,
                    expected: vec![b, t],
                    got: vec![len],
                });
            }
        }
        check_ids("input_ids", ids, self.config.vocab_size)?;
        check_ids("token_type_ids", types, self.config.type_vocab_size)?;
        Ok(())
    }

    /// Checks a batch's shapes, masked positions and labels (and sample ids when dropout
    /// needs them, NSP labels with the PreTraining heads).
    ///
    /// Errors: [`ModelError`] naming the field.
    pub(super) fn check_batch(
        &self,
        batch: &Batch,
        need_sample_ids: bool,
    ) -> Result<(), ModelError> {
        let (b, t) = (batch.batch_size(), batch.seq_len());
        for (field, dim) in [
            ("token_type_ids", batch.token_type_ids.dim()),
            ("attention_mask", batch.attention_mask.dim()),
        ] {
            if dim != (b, t) {
                return Err(ModelError::ShapeMismatch {
                    field,
                    expected: vec![b, t],
                    got: vec![dim.0, dim.1],
                });
            }
        }
        if batch.masked_labels.len() != batch.masked_positions.len() {
            return Err(ModelError::ShapeMismatch {
                field: "masked_labels",
                expected: vec![batch.masked_positions.len()],
                got: vec![batch.masked_labels.len()],
            });
        }
        for (index, &p) in batch.masked_positions.iter().enumerate() {
            if p >= b * t {
                return Err(ModelError::OutOfRange {
                    field: "masked_positions",
                    index,
                    value: p,
                    limit: b * t,
                });
            }
        }
        check_ids(
            "masked_labels",
            &batch.masked_labels,
            self.config.vocab_size,
        )?;
        if need_sample_ids && batch.sample_ids.len() != b {
            return Err(ModelError::ShapeMismatch {
                field: "sample_ids",
                expected: vec![b],
                got: vec![batch.sample_ids.len()],
            });
        }
        if self.nsp.is_some() {
            let labels = batch
                .next_sentence_labels
                .as_ref()
                .ok_or(ModelError::MissingNextSentenceLabels)?;
            if labels.len() != b {
                return Err(ModelError::ShapeMismatch {
                    field: "next_sentence_labels",
                    expected: vec![b],
                    got: vec![labels.len()],
                });
            }
            check_ids("next_sentence_labels", labels, 2)?;
        }
        Ok(())
    }

    /// The batch's token inputs as checked flat slices.
    ///
    /// Errors: [`ModelError::NotContiguous`] and those of `check_tokens`.
    pub(super) fn tokens<'a>(&self, batch: &'a Batch) -> Result<Tokens<'a>, ModelError> {
        let (b, t) = (batch.batch_size(), batch.seq_len());
        let tokens = Tokens {
            ids: as_flat("input_ids", &batch.input_ids)?,
            types: as_flat("token_type_ids", &batch.token_type_ids)?,
            mask: as_flat("attention_mask", &batch.attention_mask)?,
            b,
            t,
        };
        self.check_tokens(tokens.ids, tokens.types, tokens.mask, b, t)?;
        Ok(tokens)
    }
}

fn check_ids(field: &'static str, ids: &[u32], limit: usize) -> Result<(), ModelError> {
    match ids.iter().position(|&id| id as usize >= limit) {
        Some(index) => Err(ModelError::OutOfRange {
            field,
            index,
            value: ids[index] as usize,
            limit,
        }),
        None => Ok(()),
    }
}

/// The row-major elements of a batch field.
fn as_flat<'a, T>(field: &'static str, a: &'a Array2<T>) -> Result<&'a [T], ModelError> {
    a.as_slice().ok_or(ModelError::NotContiguous { field })
}
