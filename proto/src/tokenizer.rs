//! The BERT WordPiece tokenizer: training a vocabulary, loading one, encoding text, and saving
//! it in the folder layout Hugging Face's `AutoTokenizer.from_pretrained(dir)` loads.
//!
//! The work is done by HF's `tokenizers` crate (the same code behind `BertTokenizerFast`), set up
//! as `BertWordPieceTokenizer` is: `BertNormalizer` (clean text, put spaces around CJK characters
//! so each is its own token, lowercase + strip accents when uncased), `BertPreTokenizer`
//! (split on whitespace and punctuation), a `WordPiece` model with `##` continuation pieces and
//! `[UNK]` for words longer than 100 characters or with no piece decomposition, and the
//! `[CLS] A [SEP] B [SEP]` post-processor.
//!
//! All but the vocabulary's merges: training is deterministic (the same texts and
//! [`TrainOptions`] give the same `vocab.txt`, byte for byte, in any process), and the library's
//! `WordPieceTrainer` is not (it breaks ties between pairs of equal count by ids handed out in
//! hash-map order, seeded at random per process). So the library normalizes and cuts the words
//! and `wordpiece_trainer.rs` merges them: the library's algorithm, a tie going to the pair of
//! the tokens that joined the vocabulary first, with ids in an order fixed by the words.
//!
//! # Layout
//! - [`KeelTokenizer`]: train / load / save / encode / decode, special ids, the vocabulary hash.
//! - [`TrainOptions`]: vocabulary training settings.
//! - [`SpecialIds`]: ids of `[PAD] [UNK] [CLS] [SEP] [MASK]`.
//! - [`TokenizerError`]: everything that can fail here.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use crate::wordpiece_trainer::{DeterministicWordPieceTrainer, Settings};

/// The special tokens, in the order training places them (ids 0..4).
pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// Words longer than this many characters become one `[UNK]` (BERT's `max_input_chars_per_word`).
pub const MAX_INPUT_CHARS_PER_WORD: usize = 100;

/// Errors of the tokenizer module.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Reading or writing a tokenizer file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file could not be read within Keel's bounds (not a regular file, too large).
    #[error(transparent)]
    Limit(#[from] crate::limits::LimitError),
    /// The `tokenizers` crate refused a file or an operation.
    #[error("{context}: {message}")]
    Tokenizers {
        /// What was being done (file name or operation).
        context: String,
        /// The library's message.
        message: String,
    },
    /// A loaded vocabulary lacks one of the special tokens BERT needs.
    #[error("{path}: vocabulary has no {token} token (BERT needs [PAD] [UNK] [CLS] [SEP] [MASK])")]
    MissingSpecialToken {
        /// The vocabulary file.
        path: PathBuf,
        /// The missing token.
        token: String,
    },
    /// A loaded `tokenizer.json` does not hold a WordPiece model.
    #[error("{path}: expected a WordPiece model (BERT), found another model type")]
    NotWordPiece {
        /// The file.
        path: PathBuf,
    },
    /// The vocabulary is larger than the model's embedding table.
    #[error(
        "vocabulary of {vocab_size} tokens does not fit the model's vocab_size {model_vocab_size}: \
         lower --vocab-size or raise the model's vocab_size"
    )]
    VocabTooLarge {
        /// Tokens in the vocabulary (or requested).
        vocab_size: usize,
        /// The model config's `vocab_size`.
        model_vocab_size: usize,
    },
    /// Training settings that cannot work.
    #[error("invalid training setting {field}: {reason}")]
    InvalidSetting {
        /// The setting.
        field: &'static str,
        /// What was expected.
        reason: String,
    },
}

fn lib_err(context: impl Into<String>, e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizers {
        context: context.into(),
        message: e.to_string(),
    }
}

/// Ids of the special tokens (after training: 0, 1, 2, 3, 4; in bert-base-uncased's vocab:
/// 0, 100, 101, 102, 103).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecialIds {
    /// `[PAD]`: padding, never attended to, never masked.
    pub pad: u32,
    /// `[UNK]`: unknown word.
    pub unk: u32,
    /// `[CLS]`: first token of every sequence (its output feeds NSP).
    pub cls: u32,
    /// `[SEP]`: ends each segment.
    pub sep: u32,
    /// `[MASK]`: replaces 80% of the tokens chosen for prediction.
    pub mask: u32,
}

impl SpecialIds {
    /// The five ids as an array in `[PAD] [UNK] [CLS] [SEP] [MASK]` order.
    pub fn all(&self) -> [u32; 5] {
        [self.pad, self.unk, self.cls, self.sep, self.mask]
    }
}

/// Settings for training a WordPiece vocabulary (HF `BertWordPieceTokenizer.train`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainOptions {
    /// Target vocabulary size in tokens, special tokens included. The trainer stops merging
    /// there; the result can exceed it only when the corpus's alphabet alone is larger.
    pub vocab_size: usize,
    /// Lowercase and strip accents (BERT "uncased"); `false` keeps case and accents.
    pub lowercase: bool,
    /// Words must occur this many times to yield merges (HF default 2).
    pub min_frequency: u64,
    /// Keep at most this many distinct characters (HF's default is 1000, which would turn most
    /// Chinese characters into `[UNK]`; `None` keeps every character of the corpus).
    pub limit_alphabet: Option<usize>,
}

impl TrainOptions {
    /// Defaults for a vocabulary of `vocab_size` tokens: uncased, min_frequency 2, full alphabet.
    pub fn new(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            lowercase: true,
            min_frequency: 2,
            limit_alphabet: None,
        }
    }
}

/// A BERT WordPiece tokenizer (HF `BertTokenizerFast`).
#[derive(Clone)]
pub struct KeelTokenizer {
    /// The HF tokenizer doing the work.
    inner: Tokenizer,
    /// Whether text is lowercased and accent-stripped (HF `do_lower_case`).
    lowercase: bool,
    /// Special token ids, looked up once.
    special: SpecialIds,
    /// The vocabulary in id order (index = id).
    vocab: Vec<String>,
}

impl std::fmt::Debug for KeelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeelTokenizer")
            .field("vocab_size", &self.vocab.len())
            .field("lowercase", &self.lowercase)
            .field("special", &self.special)
            .finish()
    }
}

type BertImpl = tokenizers::TokenizerImpl<
    WordPiece,
    BertNormalizer,
    BertPreTokenizer,
    BertProcessing,
    WordPieceDecoder,
>;

impl KeelTokenizer {
    /// Trains a WordPiece vocabulary on `texts` (each item a line or a document of raw text).
    /// The special tokens get ids 0..4 (`[PAD] [UNK] [CLS] [SEP] [MASK]`), then come the
    /// characters, the `##` continuation characters (each in code-point order) and the merged
    /// tokens in the order they were made.
    ///
    /// Deterministic: the vocabulary depends only on the words of `texts`, their counts and
    /// `options`, not on the order of `texts` or on any hash seed. HF's merge algorithm, with
    /// a tie between pairs of equal count going to the pair whose left, then right, token has
    /// the smaller id, i.e. joined the vocabulary first (`wordpiece_trainer.rs`).
    ///
    /// Errors: `InvalidSetting` for `vocab_size` < 6, `Tokenizers` if training fails.
    /// Words are counted on the `tokenizers` crate's rayon pool; the counts are held in memory.
    pub fn train<I, S>(options: &TrainOptions, texts: I) -> Result<Self, TokenizerError>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
    {
        if options.vocab_size < SPECIAL_TOKENS.len() + 1 {
            return Err(TokenizerError::InvalidSetting {
                field: "vocab_size",
                reason: format!(
                    "{} is too small (at least {} tokens)",
                    options.vocab_size,
                    SPECIAL_TOKENS.len() + 1
                ),
            });
        }
        let model = WordPiece::builder()
            .unk_token("[UNK]".to_string())
            .continuing_subword_prefix("##".to_string())
            .max_input_chars_per_word(MAX_INPUT_CHARS_PER_WORD)
            .build()
            .map_err(|e| lib_err("building the WordPiece model", e))?;
        let mut tokenizer: BertImpl = TokenizerBuilder::new()
            .with_model(model)
            .with_normalizer(Some(bert_normalizer(options.lowercase)))
            .with_pre_tokenizer(Some(BertPreTokenizer))
            .with_post_processor(None)
            .with_decoder(Some(WordPieceDecoder::new("##".to_string(), true)))
            .build()
            .map_err(|e| lib_err("building the tokenizer", e))?;
        let mut trainer = DeterministicWordPieceTrainer::new(Settings {
            vocab_size: options.vocab_size,
            min_frequency: options.min_frequency,
            limit_alphabet: options.limit_alphabet,
            special_tokens: SPECIAL_TOKENS.iter().map(|t| t.to_string()).collect(),
        });
        tokenizer
            .train(&mut trainer, texts)
            .map_err(|e| lib_err("training the WordPiece vocabulary", e))?;
        let mut tokenizer: Tokenizer = tokenizer.into();
        let special = lookup_special(&tokenizer, Path::new("<trained vocabulary>"))?;
        tokenizer.with_post_processor(Some(BertProcessing::new(
            ("[SEP]".to_string(), special.sep),
            ("[CLS]".to_string(), special.cls),
        )));
        Self::from_parts(tokenizer, options.lowercase, Path::new("<trained>"))
    }

    /// Loads a BERT `vocab.txt` (one token per line, id = line number), lowercasing (and
    /// stripping accents) when `lowercase` is true, as `BertTokenizerFast(vocab, do_lower_case)`.
    ///
    /// Only a regular file of at most [`crate::limits::MAX_VOCAB_BYTES`] is read.
    ///
    /// Errors: `Limit` if the file cannot be read, is not a regular file (`/dev/zero`, a FIFO)
    /// or is too large, `Tokenizers` if it is malformed, `MissingSpecialToken` if one of the
    /// five special tokens is absent.
    pub fn from_vocab_file(path: &Path, lowercase: bool) -> Result<Self, TokenizerError> {
        let text = crate::limits::read_bounded_to_string(
            path,
            crate::limits::MAX_VOCAB_BYTES,
            "a vocab.txt",
        )?;
        let mut seen: HashSet<&str> = HashSet::new();
        for (i, line) in text.lines().enumerate() {
            let token = line.trim_end_matches('\r');
            // A well-formed vocab has no duplicate line; which id would win is ambiguous, so
            // refuse rather than guess.
            if !seen.insert(token) {
                return Err(lib_err(
                    path.display().to_string(),
                    format!("line {}: token {token:?} appears twice", i + 1),
                ));
            }
        }
        if let Some(missing) = SPECIAL_TOKENS.iter().find(|t| !seen.contains(**t)) {
            return Err(TokenizerError::MissingSpecialToken {
                path: path.to_path_buf(),
                token: missing.to_string(),
            });
        }
        let model = WordPiece::builder()
            .vocab(
                WordPiece::read_bytes(text.as_bytes())
                    .map_err(|e| lib_err(path.display().to_string(), e))?,
            )
            .unk_token("[UNK]".to_string())
            .continuing_subword_prefix("##".to_string())
            .max_input_chars_per_word(MAX_INPUT_CHARS_PER_WORD)
            .build()
            .map_err(|e| lib_err(path.display().to_string(), e))?;
        let mut tokenizer = Tokenizer::new(model);
        tokenizer
            .with_normalizer(Some(bert_normalizer(lowercase)))
            .map_err(|e| lib_err(path.display().to_string(), e))?;
        tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
        tokenizer.with_decoder(Some(WordPieceDecoder::new("##".to_string(), true)));
        tokenizer
            .add_special_tokens(SPECIAL_TOKENS.iter().map(|t| AddedToken::from(*t, true)))
            .map_err(|e| lib_err(path.display().to_string(), e))?;
        let special = lookup_special(&tokenizer, path)?;
        tokenizer.with_post_processor(Some(BertProcessing::new(
            ("[SEP]".to_string(), special.sep),
            ("[CLS]".to_string(), special.cls),
        )));
        Self::from_parts(tokenizer, lowercase, path)
    }

    /// Loads a `tokenizer.json` holding a WordPiece model (as `BertTokenizerFast` saves it).
    /// Whether it lowercases is read from its `BertNormalizer`.
    ///
    /// Errors: `Tokenizers` for an unreadable file, one that is not valid JSON, or an invalid
    /// tokenizer, `NotWordPiece`, `MissingSpecialToken`.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        let bytes = crate::limits::read_bounded(
            path,
            crate::limits::MAX_TOKENIZER_JSON_BYTES,
            "a tokenizer.json",
        )?;
        // The tokenizers crate panics (an `expect` in its decoders' deserializer) on JSON that
        // breaks or ends inside the `decoder` value: check the syntax first, so that a cut or
        // corrupt file is an error naming it.
        // Into a `Value`, which checks every string (UTF-8, escapes) as the crate will;
        // `IgnoredAny` skips strings unchecked.
        serde_json::from_slice::<serde_json::Value>(&bytes).map_err(|e| {
            lib_err(
                path.display().to_string(),
                format!("not valid JSON (a tokenizer.json is one JSON object): {e}"),
            )
        })?;
        let tokenizer =
            Tokenizer::from_bytes(bytes).map_err(|e| lib_err(path.display().to_string(), e))?;
        if !matches!(
            tokenizer.get_model(),
            tokenizers::models::ModelWrapper::WordPiece(_)
        ) {
            return Err(TokenizerError::NotWordPiece {
                path: path.to_path_buf(),
            });
        }
        let lowercase = match tokenizer.get_normalizer() {
            Some(tokenizers::NormalizerWrapper::BertNormalizer(n)) => n.lowercase,
            _ => false,
        };
        Self::from_parts(tokenizer, lowercase, path)
    }

    fn from_parts(inner: Tokenizer, lowercase: bool, path: &Path) -> Result<Self, TokenizerError> {
        let special = lookup_special(&inner, path)?;
        let size = inner.get_vocab_size(true);
        let mut vocab = vec![String::new(); size];
        for (token, id) in inner.get_vocab(true) {
            let slot = vocab.get_mut(id as usize).ok_or_else(|| {
                lib_err(
                    path.display().to_string(),
                    format!("token {token:?} has id {id} outside 0..{size} (ids must be dense)"),
                )
            })?;
            *slot = token;
        }
        Ok(Self {
            inner,
            lowercase,
            special,
            vocab,
        })
    }

    /// Writes `vocab.txt`, `tokenizer.json`, `tokenizer_config.json` and
    /// `special_tokens_map.json` into `dir` (created if missing), each atomically, so that
    /// `transformers.AutoTokenizer.from_pretrained(dir)` loads a `BertTokenizerFast`.
    ///
    /// Errors: `Io` for a file that cannot be written, `Tokenizers` if serialisation fails.
    pub fn save(&self, dir: &Path) -> Result<(), TokenizerError> {
        fs::create_dir_all(dir).map_err(|source| TokenizerError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        write_atomic(&dir.join("vocab.txt"), self.vocab_txt().as_bytes())?;
        let json = self
            .inner
            .to_string(true)
            .map_err(|e| lib_err("serialising tokenizer.json", e))?;
        write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
        let config = serde_json::json!({
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self.lowercase,
            "do_basic_tokenize": true,
            "never_split": null,
            "tokenize_chinese_chars": true,
            "strip_accents": null,
            "clean_up_tokenization_spaces": true,
            "model_max_length": 512,
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",
        });
        let map = serde_json::json!({
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",
        });
        for (name, value) in [
            ("tokenizer_config.json", config),
            ("special_tokens_map.json", map),
        ] {
            let text = serde_json::to_string_pretty(&value)
                .map_err(|e| lib_err(format!("serialising {name}"), e))?;
            write_atomic(&dir.join(name), text.as_bytes())?;
        }
        Ok(())
    }

    /// Token ids of `text` without `[CLS]`/`[SEP]`. Text that normalises to nothing (blank, a
    /// lone zero-width joiner, control characters) gives an empty vector.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        // A WordPiece encode of a `&str` cannot fail (no truncation or padding is set); map a
        // failure to an empty result rather than panic.
        match self.inner.encode_fast(text, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(e) => {
                tracing::warn!(error = %e, "encode failed; line dropped");
                Vec::new()
            }
        }
    }

    /// Token ids of each of `lines`, exactly as [`Self::encode`] gives them line by line, but
    /// faster (about 1.6x): the lines are joined with `" [SEP] "` and encoded in one call, and
    /// the ids are cut at the `[SEP]` ids. `[SEP]` is a special token, matched before
    /// normalisation, so each piece is tokenised on its own as before. When the number of
    /// pieces is not the number of lines (a line holds a literal `"[SEP]"`, or a loaded
    /// tokenizer does not treat `"[SEP]"` as special), it falls back to line-by-line encoding.
    pub fn encode_lines<S: AsRef<str>>(&self, lines: &[S]) -> Vec<Vec<u32>> {
        if lines.len() <= 1 {
            return lines.iter().map(|l| self.encode(l.as_ref())).collect();
        }
        let total: usize = lines.iter().map(|l| l.as_ref().len() + 7).sum();
        let mut joined = String::with_capacity(total);
        for (i, line) in lines.iter().enumerate() {
            if i > 0 {
                joined.push_str(" [SEP] ");
            }
            joined.push_str(line.as_ref());
        }
        let ids = self.encode(&joined);
        let sep = self.special.sep;
        let pieces: Vec<Vec<u32>> = ids.split(|&id| id == sep).map(<[u32]>::to_vec).collect();
        if pieces.len() == lines.len() {
            pieces
        } else {
            lines.iter().map(|l| self.encode(l.as_ref())).collect()
        }
    }

    /// Token ids of a pair with special tokens: `[CLS] a [SEP] b [SEP]`, and their
    /// token_type_ids (0 for `[CLS] a [SEP]`, 1 for `b [SEP]`).
    pub fn encode_pair(&self, a: &str, b: &str) -> (Vec<u32>, Vec<u32>) {
        let a = self.encode(a);
        let b = self.encode(b);
        let mut ids = Vec::with_capacity(a.len() + b.len() + 3);
        ids.push(self.special.cls);
        ids.extend_from_slice(&a);
        ids.push(self.special.sep);
        let first = ids.len();
        ids.extend_from_slice(&b);
        ids.push(self.special.sep);
        let types = (0..ids.len()).map(|i| u32::from(i >= first)).collect();
        (ids, types)
    }

    /// Text of `ids` (WordPiece decoder: `##` pieces glued, special tokens skipped).
    /// Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }

    /// The token string of `id`, `None` outside the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.vocab.get(id as usize).cloned()
    }

    /// The id of `token`, `None` if it is not in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of tokens in the vocabulary (special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// Whether text is lowercased (HF `do_lower_case`).
    pub fn lowercase(&self) -> bool {
        self.lowercase
    }

    /// Ids of the special tokens.
    pub fn special(&self) -> SpecialIds {
        self.special
    }

    /// The vocabulary in id order.
    pub fn vocab(&self) -> Vec<String> {
        self.vocab.clone()
    }

    /// The vocabulary in id order, borrowed.
    pub fn vocab_slice(&self) -> &[String] {
        &self.vocab
    }

    /// SHA-256 of the `vocab.txt` bytes this tokenizer saves (each token followed by `\n`):
    /// shards record it so that data and vocabulary cannot be mixed up.
    pub fn vocab_hash(&self) -> [u8; 32] {
        Sha256::digest(self.vocab_txt().as_bytes()).into()
    }

    /// [`Self::vocab_hash`] as 64 lowercase hex digits (what `sha256sum vocab.txt` prints).
    pub fn vocab_hash_hex(&self) -> String {
        hex(&self.vocab_hash())
    }

    /// Checks that this vocabulary fits a model whose embedding table has `model_vocab_size`
    /// rows. Errors: `VocabTooLarge`.
    pub fn check_fits(&self, model_vocab_size: usize) -> Result<(), TokenizerError> {
        check_fits(self.vocab_size(), model_vocab_size)
    }

    /// The underlying HF tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    fn vocab_txt(&self) -> String {
        let mut text = String::with_capacity(self.vocab.len() * 8);
        for token in &self.vocab {
            text.push_str(token);
            text.push('\n');
        }
        text
    }
}

/// Checks before training that a requested vocabulary of `vocab_size` tokens fits a model
/// with `model_vocab_size` embedding rows. Errors: `VocabTooLarge`.
pub fn check_fits(vocab_size: usize, model_vocab_size: usize) -> Result<(), TokenizerError> {
    if vocab_size > model_vocab_size {
        return Err(TokenizerError::VocabTooLarge {
            vocab_size,
            model_vocab_size,
        });
    }
    Ok(())
}

pub use crate::checkpoint::hex;

fn bert_normalizer(lowercase: bool) -> BertNormalizer {
    // strip_accents: None follows `lowercase`, as in BERT and HF.
    BertNormalizer::new(true, true, None, lowercase)
}

fn lookup_special(tokenizer: &Tokenizer, path: &Path) -> Result<SpecialIds, TokenizerError> {
    let get = |token: &str| {
        tokenizer
            .token_to_id(token)
            .ok_or_else(|| TokenizerError::MissingSpecialToken {
                path: path.to_path_buf(),
                token: token.to_string(),
            })
    };
    Ok(SpecialIds {
        pad: get("[PAD]")?,
        unk: get("[UNK]")?,
        cls: get("[CLS]")?,
        sep: get("[SEP]")?,
        mask: get("[MASK]")?,
    })
}

/// Writes `bytes` to `path` atomically as an ordinary readable file (mode 0644), with
/// [`crate::atomic::write_atomic`].
///
/// Errors: `Io` naming `path`.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TokenizerError> {
    crate::atomic::write_atomic(path, bytes, crate::atomic::Access::Everyone).map_err(|e| {
        TokenizerError::Io {
            path: e.path,
            source: e.source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `vocab` fuzz target's input (fuzz/corpus/vocab/crash-json-cut-in-decoder) less its
    /// flag byte: a `tokenizer.json` that ends inside its `decoder` value.
    #[test]
    fn a_tokenizer_json_cut_inside_its_decoder_is_refused_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, br#"{"decoder":"#).unwrap();
        let err = KeelTokenizer::from_tokenizer_json(&path).unwrap_err();
        assert!(matches!(err, TokenizerError::Tokenizers { .. }), "{err}");
        assert!(err.to_string().contains("not valid JSON"), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    /// The `vocab` fuzz target's input (fuzz/corpus/vocab/crash-invalid-utf8-in-decoder) less
    /// its flag byte: a key of the `decoder` object that is not UTF-8.
    #[test]
    fn a_tokenizer_json_with_invalid_utf8_in_its_decoder_is_refused_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let text = b"{\"normalizer\":{ \"clean_text\": true,   \"handle_chinese_chars\": true, \
                     \"lowercase\": true\x0a},\x0a \"decoder\":{\"p\xb5\": {  }\x0a}}";
        std::fs::write(&path, text).unwrap();
        let err = KeelTokenizer::from_tokenizer_json(&path).unwrap_err();
        assert!(err.to_string().contains("not valid JSON"), "{err}");
    }
}
