//! Tokenizers, all through the Hugging Face `tokenizers` crate so that every run saves a standard
//! `tokenizer.json` beside it: character-level, byte-level BPE trained offline on the corpus, or a
//! given file.

use std::collections::BTreeSet;
use std::path::Path;
use std::str::FromStr;

use anyhow::{anyhow, Context, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{Tokenizer, TokenizerBuilder};

/// Unknown-character token of the character-level tokenizer (id 0).
pub const UNK: &str = "<unk>";

/// A character-level tokenizer over the characters of `text` (sorted, after `<unk>`).
pub fn char_level(text: &str) -> Result<Tokenizer> {
    let chars: BTreeSet<char> = text.chars().collect();
    let mut vocab = serde_json::Map::new();
    vocab.insert(UNK.to_string(), 0.into());
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), (i + 1).into());
    }
    // Each character is its own pre-token; the WordLevel model maps it to its id; Fuse joins the
    // decoded characters without separators.
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    });
    Tokenizer::from_str(&json.to_string())
        .map_err(|e| anyhow!("building the character tokenizer: {e}"))
}

/// A byte-level BPE with `vocab_size` tokens trained on `text` (GPT-2's byte-to-unicode alphabet,
/// so any text round-trips).
pub fn train_bpe(text: &str, vocab_size: usize) -> Result<Tokenizer> {
    let alphabet = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(alphabet)
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tok = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(byte_level))
    .with_decoder(Some(byte_level))
    .build()
    .map_err(|e| anyhow!("building the BPE tokenizer: {e}"))?;
    tok.train(&mut trainer, text.split_inclusive('\n'))
        .map_err(|e| anyhow!("training the BPE tokenizer: {e}"))?;
    let json = tok
        .to_string(false)
        .map_err(|e| anyhow!("serialising the BPE tokenizer: {e}"))?;
    Tokenizer::from_str(&json).map_err(|e| anyhow!("reloading the BPE tokenizer: {e}"))
}

/// Loads a `tokenizer.json`.
pub fn load(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))
}

/// The SHA-256 of the tokenizer's JSON, as token shards record it: the same tokenizer (loaded
/// from any copy of its file) gives the same hash.
pub fn hash(tok: &Tokenizer) -> Result<[u8; 32]> {
    use sha2::Digest;
    let json = tok
        .to_string(false)
        .map_err(|e| anyhow!("serialising the tokenizer: {e}"))?;
    Ok(sha2::Sha256::digest(json.as_bytes()).into())
}

/// Saves a tokenizer as JSON.
pub fn save(tok: &Tokenizer, path: &Path) -> Result<()> {
    tok.save(path, false)
        .map_err(|e| anyhow!("cannot write {}: {e}", path.display()))
}

/// Encodes a whole corpus. The text is cut at line ends into pieces of about 64 KiB, which for
/// these tokenizers (per-character, or byte-level with whitespace pre-splitting) gives the same ids
/// as one call on the whole text, without the memory of one huge encoding.
pub fn encode_corpus(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = Vec::with_capacity(text.len());
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + 65536).min(text.len());
        if end < text.len() {
            end = match text[end..].find('\n') {
                Some(off) => end + off + 1,
                None => text.len(),
            };
        }
        let enc = tok
            .encode(&text[start..end], false)
            .map_err(|e| anyhow!("tokenizing bytes {start}..{end} of the corpus: {e}"))?;
        ids.extend_from_slice(enc.get_ids());
        start = end;
    }
    Ok(ids)
}

/// Decodes ids back to text.
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, false)
        .map_err(|e| anyhow!("decoding: {e}"))
        .context("tokenizer decode")
}
