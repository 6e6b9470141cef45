//! WordPiece vocabulary training that gives the same vocabulary every time: the algorithm of HF
//! `tokenizers`' `WordPieceTrainer` (its BPE trainer with `##` continuation pieces), with every
//! token numbered in an order fixed by the words themselves rather than by hash-map order.
//!
//! Why not the library's trainer: `tokenizers` 0.23 numbers the `##c` continuation pieces in the
//! order it meets them while iterating its word counts, an `AHashMap` seeded at random once per
//! process, and breaks ties between pairs of equal count by those numbers
//! (huggingface/tokenizers#1794). Pairs of equal count are everywhere in a real corpus (every
//! pair seen twice ties with every other seen twice), so the same corpus gave a different
//! `vocab.txt` from run to run: the `##c` pieces in another order, and from there on some other
//! tokens (7 of 8,000 between two runs on the King James Bible). No setting of the library
//! orders them, and feeding it cannot: `Trainer::feed` counts into a map of its own. (Its
//! `limit_alphabet` cut and the order of queued merges of equal rank depend on hash order too.)
//!
//! # Algorithm
//! 1. `feed` counts the words the tokenizer's normalizer and pre-tokenizer cut each text into
//!    (in parallel, on the `tokenizers` crate's rayon pool, as the library does).
//! 2. The vocabulary starts with the special tokens, then the alphabet: every character of the
//!    words, in code-point order. With `limit_alphabet`, only the most frequent characters
//!    (weighted by word count) are kept, a tie going to the smaller code point; the others are
//!    dropped from the words, as the library drops them.
//! 3. Each word becomes its characters, all but the first as a continuation piece `##c`; the
//!    pieces follow the alphabet in the vocabulary, in code-point order.
//! 4. Until the vocabulary has `vocab_size` tokens: merge the adjacent pair with the highest
//!    count (the sum, over the words it occurs in, of the word's count times its occurrences),
//!    **a tie going to the pair whose left token, then right token, has the smaller id**, that
//!    is, joined the vocabulary first (the library's own rule, here on ids that steps 2-3 and
//!    the merge order fix); stop when that count is below `min_frequency` or no pair is left.
//!    The merged token is the left token followed by the right one without its `##`; it joins
//!    the vocabulary unless it is there already. Every occurrence in every word is merged, left
//!    to right.
//!
//! So the vocabulary is a function of the word counts and the settings alone, whatever the
//! hash seeds, the order of the texts or the number of threads. It is what the library gives
//! when it happens to meet the `##c` pieces in code-point order; on the King James Bible at
//! 8,000 tokens it shares 7,993 and 7,995 tokens with two of the library's runs, which share
//! 7,993 with each other. Without ties it is the library's vocabulary but for the order of the `##c`
//! pieces (`matches_the_library_when_no_pair_ties`).
//!
//! # Layout
//! - [`DeterministicWordPieceTrainer`]: the `tokenizers::Trainer` that `KeelTokenizer::train`
//!   hands to the library's `Tokenizer::train`.
//! - `train_vocabulary`: steps 2-4 on counted words, a pure function.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use tokenizers::models::wordpiece::WordPiece;
use tokenizers::parallelism::MaybeParallelBridge;
use tokenizers::{AddedToken, Trainer};

/// The prefix of a continuation piece (a piece that is not the start of a word).
const CONTINUING_PREFIX: &str = "##";

/// Vocabulary training settings, as the library's `WordPieceTrainer` takes them.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// Stop merging when the vocabulary has this many tokens (special tokens included).
    pub vocab_size: usize,
    /// Stop merging when the best pair occurs fewer times than this.
    pub min_frequency: u64,
    /// Keep at most this many characters (the most frequent); `None` keeps all.
    pub limit_alphabet: Option<usize>,
    /// The first tokens of the vocabulary, in this order.
    pub special_tokens: Vec<String>,
}

/// A `tokenizers::Trainer` for a `WordPiece` model that trains as HF's `WordPieceTrainer` does
/// but deterministically (see the module doc).
pub(crate) struct DeterministicWordPieceTrainer {
    /// What to train.
    settings: Settings,
    /// Each distinct word of the fed texts and how often it occurs.
    words: HashMap<String, u64>,
}

impl DeterministicWordPieceTrainer {
    /// A trainer with these settings and no words yet.
    pub(crate) fn new(settings: Settings) -> Self {
        Self {
            settings,
            words: HashMap::new(),
        }
    }
}

impl Trainer for DeterministicWordPieceTrainer {
    type Model = WordPiece;

    fn should_show_progress(&self) -> bool {
        false
    }

    /// Replaces `model`'s vocabulary with the trained one (keeping its unknown token and
    /// longest word) and returns the special tokens for the tokenizer to add.
    fn train(&self, model: &mut WordPiece) -> tokenizers::Result<Vec<AddedToken>> {
        let vocab = train_vocabulary(&self.words, &self.settings);
        // The model takes its vocabulary as the library's own map type; the way to one
        // without naming `ahash` is the vocab.txt reader (one token a line, id = line; no
        // token holds a line break or ends in white space: the pre-tokenizer cuts there).
        let mut text = String::with_capacity(vocab.len() * 8);
        for token in &vocab {
            text.push_str(token);
            text.push('\n');
        }
        *model = WordPiece::builder()
            .vocab(WordPiece::read_bytes(text.as_bytes())?)
            .unk_token(model.unk_token.clone())
            .continuing_subword_prefix(CONTINUING_PREFIX.to_string())
            .max_input_chars_per_word(model.max_input_chars_per_word)
            .build()?;
        Ok(self
            .settings
            .special_tokens
            .iter()
            .map(|t| AddedToken::from(t.clone(), true))
            .collect())
    }

    fn feed<I, S, F>(&mut self, iterator: I, process: F) -> tokenizers::Result<()>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
        F: Fn(&str) -> tokenizers::Result<Vec<String>> + Sync,
    {
        // Sums are the same in any order, so the parallel reduction is deterministic.
        let words = iterator
            .maybe_par_bridge()
            .map(|text| {
                let mut counts: HashMap<String, u64> = HashMap::new();
                for word in process(text.as_ref())? {
                    *counts.entry(word).or_default() += 1;
                }
                Ok(counts)
            })
            .reduce(
                || Ok(HashMap::new()),
                |a: tokenizers::Result<HashMap<String, u64>>, b| {
                    let (mut a, b) = (a?, b?);
                    let (into, from) = if a.len() >= b.len() {
                        (&mut a, b)
                    } else {
                        let small = std::mem::replace(&mut a, b);
                        (&mut a, small)
                    };
                    for (word, n) in from {
                        *into.entry(word).or_default() += n;
                    }
                    Ok(a)
                },
            )?;
        for (word, n) in words {
            *self.words.entry(word).or_default() += n;
        }
        Ok(())
    }
}

/// A token id.
type Id = u32;
/// Two adjacent tokens of a word.
type Pair = (Id, Id);

/// The vocabulary being built: tokens in id order and the id of each.
#[derive(Default)]
struct Vocab {
    /// Token strings, index = id.
    tokens: Vec<String>,
    /// Token string to id.
    ids: HashMap<String, Id>,
}

impl Vocab {
    /// The id of `token`, appending it first when new.
    fn add(&mut self, token: String) -> Id {
        if let Some(&id) = self.ids.get(&token) {
            return id;
        }
        let id = self.tokens.len() as Id;
        self.ids.insert(token.clone(), id);
        self.tokens.push(token);
        id
    }
}

/// A candidate merge in the queue. The queue is a max-heap on (count, then the pair's ids in
/// reverse): its top is the pair with the highest count, and among equal counts the one whose
/// left, then right, token has the smaller id. An entry may be stale (the pair's count has
/// changed since); it is checked when it reaches the top.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    /// The pair's count when queued.
    count: u64,
    /// The pair, reversed so that the smaller ids rank higher.
    pair: Reverse<Pair>,
}

/// Steps 2-4 of the module doc: the vocabulary (tokens in id order) trained on `words` (each
/// distinct word and its count). A function of its arguments' values only: no iteration
/// order of a hash map reaches the result.
pub(crate) fn train_vocabulary(words: &HashMap<String, u64>, settings: &Settings) -> Vec<String> {
    let mut words: Vec<(&str, u64)> = words.iter().map(|(w, &n)| (w.as_str(), n)).collect();
    words.sort_unstable();

    let mut vocab = Vocab::default();
    for token in &settings.special_tokens {
        vocab.add(token.clone());
    }

    // 2. The alphabet, limited to the most frequent characters if asked.
    let mut char_counts: HashMap<char, u64> = HashMap::new();
    for &(word, n) in &words {
        for c in word.chars() {
            *char_counts.entry(c).or_default() += n;
        }
    }
    let mut alphabet: Vec<(char, u64)> = char_counts.into_iter().collect();
    if let Some(limit) = settings.limit_alphabet
        && alphabet.len() > limit
    {
        alphabet.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        alphabet.truncate(limit);
    }
    alphabet.sort_unstable();
    let kept: HashMap<char, Id> = alphabet
        .iter()
        .map(|&(c, _)| (c, vocab.add(c.to_string())))
        .collect();

    // 3. The words as pieces; the continuation pieces join the vocabulary in code-point order.
    let mut continuing: Vec<char> = words
        .iter()
        .flat_map(|&(word, _)| word.chars().skip(1))
        .filter(|c| kept.contains_key(c))
        .collect();
    continuing.sort_unstable();
    continuing.dedup();
    let continuing: HashMap<char, Id> = continuing
        .into_iter()
        .map(|c| (c, vocab.add(format!("{CONTINUING_PREFIX}{c}"))))
        .collect();
    let counts: Vec<u64> = words.iter().map(|&(_, n)| n).collect();
    let mut pieces: Vec<Vec<Id>> = words
        .iter()
        .map(|&(word, _)| {
            word.chars()
                .enumerate()
                .filter(|(_, c)| kept.contains_key(c))
                .map(|(i, c)| if i == 0 { kept[&c] } else { continuing[&c] })
                .collect()
        })
        .collect();

    // 4. Merges. `pair_counts` is exact at all times; `positions` lists, for each pair, the
    // words it was seen in (possibly some it has left since: a merge checks).
    let mut pair_counts: HashMap<Pair, u64> = HashMap::new();
    let mut positions: HashMap<Pair, Vec<usize>> = HashMap::new();
    for (w, word) in pieces.iter().enumerate() {
        for p in word.windows(2) {
            let pair = (p[0], p[1]);
            *pair_counts.entry(pair).or_default() += counts[w];
            let seen = positions.entry(pair).or_default();
            if seen.last() != Some(&w) {
                seen.push(w);
            }
        }
    }
    let mut queue: BinaryHeap<Candidate> = pair_counts
        .iter()
        .map(|(&pair, &count)| Candidate {
            count,
            pair: Reverse(pair),
        })
        .collect();
    let mut delta: HashMap<Pair, i64> = HashMap::new();
    while vocab.tokens.len() < settings.vocab_size {
        let Some(top) = queue.pop() else { break };
        let Reverse(pair) = top.pair;
        let count = pair_counts.get(&pair).copied().unwrap_or(0);
        if count == 0 {
            continue; // merged already, or gone from every word
        }
        if count != top.count {
            queue.push(Candidate { count, ..top });
            continue;
        }
        if count < settings.min_frequency {
            break;
        }
        let (left, right) = pair;
        let right_str = &vocab.tokens[right as usize];
        let merged = format!(
            "{}{}",
            vocab.tokens[left as usize],
            right_str
                .strip_prefix(CONTINUING_PREFIX)
                .unwrap_or(right_str)
        );
        let new = vocab.add(merged);

        let mut words_with = positions.remove(&pair).unwrap_or_default();
        words_with.sort_unstable();
        words_with.dedup();
        delta.clear();
        for w in words_with {
            let word = &mut pieces[w];
            let n = counts[w] as i64;
            if !word.windows(2).any(|p| (p[0], p[1]) == pair) {
                continue;
            }
            for p in word.windows(2) {
                *delta.entry((p[0], p[1])).or_default() -= n;
            }
            merge_pair(word, pair, new);
            for p in word.windows(2) {
                let pair = (p[0], p[1]);
                *delta.entry(pair).or_default() += n;
                // A merge makes new neighbours only next to the merged token.
                if pair.0 == new || pair.1 == new {
                    let seen = positions.entry(pair).or_default();
                    if seen.last() != Some(&w) {
                        seen.push(w);
                    }
                }
            }
        }
        for (&changed, &d) in &delta {
            if d == 0 {
                continue;
            }
            let c = pair_counts.entry(changed).or_default();
            *c = c
                .checked_add_signed(d)
                .expect("a pair count never goes below zero");
            // A count that fell is corrected when its stale entry reaches the top; one that
            // rose needs an entry at its new count.
            if d > 0 {
                queue.push(Candidate {
                    count: *c,
                    pair: Reverse(changed),
                });
            }
        }
    }
    vocab.tokens
}

/// Replaces each occurrence of `pair` in `word`, left to right, by `new` (in `a a a`, the
/// pair `(a, a)` becomes `aa a`).
fn merge_pair(word: &mut Vec<Id>, pair: Pair, new: Id) {
    let mut out = Vec::with_capacity(word.len());
    let mut i = 0;
    while i < word.len() {
        if i + 1 < word.len() && (word[i], word[i + 1]) == pair {
            out.push(new);
            i += 2;
        } else {
            out.push(word[i]);
            i += 1;
        }
    }
    *word = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain reference: every step counts every pair of every word again and takes the
    /// best by (count, then smaller ids), merging one pair at a time. Returns the vocabulary and
    /// how many merges were chosen among pairs of equal count.
    fn reference(words: &HashMap<String, u64>, settings: &Settings) -> (Vec<String>, usize) {
        // Steps 2-3 are shared: training with no merges allowed gives the start vocabulary.
        let start = train_vocabulary(
            words,
            &Settings {
                vocab_size: 0,
                ..settings.clone()
            },
        );
        let mut vocab = Vocab::default();
        for t in start {
            vocab.add(t);
        }
        let kept: Vec<char> = vocab
            .tokens
            .iter()
            .filter(|t| t.chars().count() == 1)
            .map(|t| t.chars().next().unwrap())
            .collect();
        let mut pieces: Vec<(Vec<Id>, u64)> = words
            .iter()
            .map(|(w, &n)| {
                let ids = w
                    .chars()
                    .enumerate()
                    .filter(|(_, c)| kept.contains(c))
                    .map(|(i, c)| {
                        let t = if i == 0 {
                            c.to_string()
                        } else {
                            format!("##{c}")
                        };
                        vocab.ids[&t]
                    })
                    .collect();
                (ids, n)
            })
            .collect();
        let mut ties = 0;
        while vocab.tokens.len() < settings.vocab_size {
            let mut counts: HashMap<Pair, u64> = HashMap::new();
            for (word, n) in &pieces {
                for p in word.windows(2) {
                    *counts.entry((p[0], p[1])).or_default() += n;
                }
            }
            let mut all: Vec<(Pair, u64)> = counts.into_iter().collect();
            all.sort_by_key(|&(pair, n)| Reverse((n, Reverse(pair))));
            let Some(&(pair, n)) = all.first() else { break };
            if n < settings.min_frequency {
                break;
            }
            if all.get(1).is_some_and(|&(_, m)| m == n) {
                ties += 1;
            }
            let right = vocab.tokens[pair.1 as usize].clone();
            let merged = format!(
                "{}{}",
                vocab.tokens[pair.0 as usize],
                right.strip_prefix("##").unwrap_or(&right)
            );
            let new = vocab.add(merged);
            for (word, _) in &mut pieces {
                merge_pair(word, pair, new);
            }
        }
        (vocab.tokens, ties)
    }

    fn settings(vocab_size: usize) -> Settings {
        Settings {
            vocab_size,
            min_frequency: 2,
            limit_alphabet: None,
            special_tokens: ["[PAD]", "[UNK]"].map(String::from).to_vec(),
        }
    }

    /// The words of a corpus file's first `max_bytes` bytes: lowercased, cut at whitespace and
    /// ASCII punctuation (close enough to BERT's pre-tokenizer for these tests).
    fn corpus_words(rel: &str, max_bytes: usize) -> HashMap<String, u64> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../corpora")
            .join(rel);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/corpora.sh)", path.display()));
        let mut words = HashMap::new();
        let mut end = max_bytes.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        for w in text[..end]
            .to_lowercase()
            .split(|c: char| c.is_whitespace() || c.is_ascii_punctuation())
            .filter(|w| !w.is_empty())
        {
            *words.entry(w.to_string()).or_default() += 1;
        }
        words
    }

    #[test]
    fn merge_pair_merges_left_to_right_without_overlap() {
        let mut w = vec![1, 1, 1];
        merge_pair(&mut w, (1, 1), 9);
        assert_eq!(w, [9, 1]);
        let mut w = vec![1, 2, 1, 2, 3, 1];
        merge_pair(&mut w, (1, 2), 9);
        assert_eq!(w, [9, 9, 3, 1]);
        let mut w = vec![2, 1];
        merge_pair(&mut w, (1, 2), 9);
        assert_eq!(w, [2, 1]);
    }

    #[test]
    fn equals_the_plain_reference_on_real_text() {
        let words = corpus_words("en-fortunes/fortunes.txt", 120_000);
        let s = settings(900);
        let (expected, ties) = reference(&words, &s);
        assert!(
            ties > 10,
            "a real text has ties ({ties}): they are what is tested"
        );
        assert_eq!(train_vocabulary(&words, &s), expected);
        // A limited alphabet, on text with thousands of characters.
        let words = corpus_words("zh-poetry/poetry.txt", 60_000);
        let s = Settings {
            limit_alphabet: Some(300),
            ..settings(700)
        };
        let (expected, _) = reference(&words, &s);
        let got = train_vocabulary(&words, &s);
        assert_eq!(got, expected);
        assert_eq!(got.iter().filter(|t| t.chars().count() == 1).count(), 300);
    }

    #[test]
    fn the_order_of_the_words_does_not_matter() {
        let words = corpus_words("en-fortunes/fortunes.txt", 60_000);
        let s = settings(700);
        let a = train_vocabulary(&words, &s);
        // A map built in another order, with another hasher seed.
        let mut sorted: Vec<(&String, &u64)> = words.iter().collect();
        sorted.sort();
        let reversed: HashMap<String, u64> = sorted
            .into_iter()
            .rev()
            .map(|(w, &n)| (w.clone(), n))
            .collect();
        assert_eq!(train_vocabulary(&reversed, &s), a);
    }

    #[test]
    fn matches_the_library_when_no_pair_ties() {
        // Words of a small alphabet with distinct, large counts: pairs of equal count would
        // need to occur in exactly the same words. The first such corpus (of a fixed sequence)
        // where the reference sees no tie among the merges made is the test.
        let corpus = |seed: u64| {
            let mut state = seed;
            let mut next = move || {
                // xorshift64
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut words: HashMap<String, u64> = HashMap::new();
            while words.len() < 200 {
                let len = 2 + (next() % 5) as usize;
                let w: String = (0..len)
                    .map(|_| (b'a' + (next() % 6) as u8) as char)
                    .collect();
                let n = 2 + next() % 10_000;
                if !words.values().any(|&m| m == n) {
                    words.insert(w, n);
                }
            }
            words
        };
        let s = settings(45);
        let (words, expected) = (1..=64)
            .map(|seed| corpus(0x2545_f491_4f6c_dd1d ^ seed))
            .find_map(|words| {
                let (expected, ties) = reference(&words, &s);
                (ties == 0).then_some((words, expected))
            })
            .expect("a corpus without ties among the first 64");
        let ours = train_vocabulary(&words, &s);
        assert_eq!(ours, expected);

        let mut library = tokenizers::models::wordpiece::WordPieceTrainer::builder()
            .vocab_size(s.vocab_size)
            .min_frequency(s.min_frequency)
            .show_progress(false)
            .special_tokens(
                s.special_tokens
                    .iter()
                    .map(|t| AddedToken::from(t.clone(), true))
                    .collect(),
            )
            .build();
        let fed = words
            .iter()
            .flat_map(|(w, &n)| std::iter::repeat_n(w.as_str(), n as usize));
        library.feed(fed, |w| Ok(vec![w.to_string()])).unwrap();
        let mut model = WordPiece::default();
        library.train(&mut model).unwrap();
        let mut theirs: Vec<(u32, String)> = tokenizers::Model::get_vocab(&model)
            .into_iter()
            .map(|(t, id)| (id, t))
            .collect();
        theirs.sort();
        let theirs: Vec<String> = theirs.into_iter().map(|(_, t)| t).collect();
        // The same tokens; the same order but for the `##c` pieces, which the library numbers
        // as it meets them.
        let start = train_vocabulary(
            &words,
            &Settings {
                vocab_size: 0,
                ..s.clone()
            },
        )
        .len();
        let mut a = ours.clone();
        let mut b = theirs.clone();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        assert_eq!(ours[start..], theirs[start..]);
        assert!(
            ours.len() - start > 20,
            "few merges: {}",
            ours.len() - start
        );
    }
}
