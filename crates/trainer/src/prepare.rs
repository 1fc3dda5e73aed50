//! `prepare`: text files and JSON Lines to token shards (`crate::tokens::format`), which
//! `data.source = "shards"` reads a window at a time.
//!
//! - **Documents**: a text file's blank-line-separated paragraphs; a JSON Lines file's lines
//!   (the text in a named field); a Parquet file's rows (the text in a named column, row group
//!   by row group; null rows are skipped, `crate::parquet`). Inputs are files, directories
//!   (every file under them) and glob patterns, read in path order; documents are numbered in
//!   that order.
//! - **Split by document**: every `val_every`-th document (the last of each run of
//!   `val_every`) goes to validation, the rest to training.
//! - **End of text**: the tokenizer's end-of-text token follows every document.
//! - **Shards**: the inputs are cut into chunks of at least `chunk_bytes` of text: whole files,
//!   and pieces of larger files cut at document boundaries found near each multiple of
//!   `chunk_bytes` (a Parquet file's row groups, counted by their compressed size), from the
//!   files alone; chunk `k` becomes `train_{k:05}.bin` and, if it
//!   holds validation documents, `val_{k:05}.bin`. Each is complete once renamed into place, the
//!   training shard last, so a run that is stopped and started again skips the chunks whose
//!   training shard exists, and the same inputs give the same shards. `prepare.json` records
//!   what decides the shards (inputs and sizes, chunk size, split, field, end-of-text token,
//!   tokenizer); a run with other settings into the same directory is refused.
//! - Documents are tokenized on every core; a progress bar shows MB/s and tokens/s.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use tokenizers::Tokenizer;

use crate::tokenizer;
use crate::tokens::format::{self, ShardInfo};

/// What to prepare, and how.
#[derive(Debug, Clone)]
pub struct Plan {
    pub inputs: Vec<String>,
    pub out: PathBuf,
    /// The JSON field holding a JSON Lines document's text, or the column of a Parquet file's.
    pub field: String,
    /// Every `val_every`-th document goes to validation.
    pub val_every: usize,
    /// About this many bytes of text per shard.
    pub chunk_bytes: u64,
    /// The end-of-text token's text (it must be in the tokenizer's vocabulary).
    pub eot: String,
    /// Show a progress bar.
    pub progress: bool,
}

/// What a finished `prepare` made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    pub documents: usize,
    pub train_tokens: usize,
    pub val_tokens: usize,
    /// Chunks written by this call, and chunks found complete from an earlier one.
    pub written: usize,
    pub skipped: usize,
    pub text_bytes: u64,
}

/// One input file, or a piece of one (bytes `start .. start + bytes`; of a Parquet file, row
/// group `start`, of `bytes` compressed bytes), and how its documents are cut.
#[derive(Debug, Clone)]
struct Input {
    path: PathBuf,
    kind: Kind,
    start: u64,
    bytes: u64,
    /// A Parquet file's text column, once its footer is read (its row groups share it).
    column: Option<std::sync::Arc<crate::parquet::TextColumn>>,
}

/// How an input file holds its documents (by its extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Paragraphs of text.
    Text,
    /// `.jsonl` / `.json`: a JSON object per line.
    Jsonl,
    /// `.parquet`: a row per document.
    Parquet,
}

impl Input {
    /// This input cut into pieces of at least `piece` bytes at document boundaries (after a
    /// blank line in text, after a line end in JSON Lines), so that a file of many gigabytes
    /// makes many shards; the cuts depend on the file alone.
    fn pieces(self, piece: u64, field: &str) -> Result<Vec<Input>> {
        if self.kind == Kind::Parquet {
            let column = std::sync::Arc::new(crate::parquet::TextColumn::open(&self.path, field)?);
            return Ok((0..column.row_groups())
                .map(|g| Input {
                    start: g as u64,
                    bytes: column.chunk_bytes(g),
                    column: Some(column.clone()),
                    ..self.clone()
                })
                .collect());
        }
        if self.bytes <= piece {
            return Ok(vec![self]);
        }
        let mut file = std::fs::File::open(&self.path)
            .with_context(|| format!("cannot open {}", self.path.display()))?;
        let seps: &[&[u8]] = if self.kind == Kind::Jsonl {
            &[b"\n"]
        } else {
            &[b"\n\n", b"\n\r\n"]
        };
        let mut cuts = vec![0u64];
        let mut at = piece;
        while at < self.bytes {
            match find_after(&mut file, at, seps)
                .with_context(|| format!("reading {}", self.path.display()))?
            {
                Some(cut) if cut < self.bytes => cuts.push(cut),
                _ => break,
            }
            at = cuts.last().expect("a cut") + piece;
        }
        cuts.push(self.bytes);
        Ok(cuts
            .windows(2)
            .map(|w| Input {
                path: self.path.clone(),
                kind: self.kind,
                start: w[0],
                bytes: w[1] - w[0],
                column: None,
            })
            .collect())
    }
}

/// The offset just past the first of `seps` (the earliest found) at or after byte `from` of
/// `file`, if any.
fn find_after(file: &mut std::fs::File, from: u64, seps: &[&[u8]]) -> std::io::Result<Option<u64>> {
    use std::io::{Read, Seek, SeekFrom};
    let longest = seps.iter().map(|s| s.len()).max().unwrap_or(1);
    let mut buf = vec![0u8; 1 << 16];
    let mut base = from;
    file.seek(SeekFrom::Start(from))?;
    // The last `longest - 1` bytes of a window are kept for a separator across two windows.
    let mut kept = 0;
    loop {
        let n = file.read(&mut buf[kept..])?;
        if n == 0 {
            return Ok(None);
        }
        let have = kept + n;
        let found = seps
            .iter()
            .filter_map(|sep| {
                let at = buf[..have].windows(sep.len()).position(|w| w == *sep)?;
                Some(at + sep.len())
            })
            .min();
        if let Some(end) = found {
            return Ok(Some(base + end as u64));
        }
        let keep = (longest - 1).min(have);
        buf.copy_within(have - keep..have, 0);
        base += (have - keep) as u64;
        kept = keep;
    }
}

/// The files `specs` name, in path order (each spec's files sorted, specs in the order given).
fn input_files(specs: &[String]) -> Result<Vec<Input>> {
    let mut files = Vec::new();
    for spec in specs {
        let path = Path::new(spec);
        let mut found: Vec<PathBuf> = if path.is_file() {
            vec![path.to_path_buf()]
        } else if path.is_dir() {
            let mut all = Vec::new();
            walk(path, &mut all)?;
            all
        } else {
            crate::tokens::glob_files(spec, &format!("input {spec:?}"))?
        };
        if found.is_empty() {
            bail!("input {spec:?}: no such file, or no file under it or matching it");
        }
        found.sort();
        for p in found {
            let bytes = std::fs::metadata(&p)
                .with_context(|| format!("{}: cannot read its size", p.display()))?
                .len();
            let kind = match p.extension().and_then(|e| e.to_str()) {
                Some("jsonl" | "json") => Kind::Jsonl,
                Some("parquet") => Kind::Parquet,
                _ => Kind::Text,
            };
            files.push(Input {
                path: p,
                kind,
                start: 0,
                bytes,
                column: None,
            });
        }
    }
    if files.iter().all(|f| f.bytes == 0) {
        bail!("the inputs hold no text (every file is empty)");
    }
    Ok(files)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = entry?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else if p.is_file() {
            out.push(p);
        }
    }
    Ok(())
}

/// The documents of `input`, in order: paragraphs of a text file, the `field` of each line of a
/// JSON Lines file (an error names the file and line), or column `field` of a Parquet row group.
fn documents(input: &Input, field: &str) -> Result<Vec<String>> {
    use std::io::{Read, Seek, SeekFrom};
    if input.kind == Kind::Parquet {
        let column = input
            .column
            .as_ref()
            .expect("a Parquet file is read through its row groups (Input::pieces)");
        return Ok(column
            .read(input.start as usize)?
            .into_iter()
            .flatten()
            .collect());
    }
    let read = || -> std::io::Result<Vec<u8>> {
        let mut file = std::fs::File::open(&input.path)?;
        file.seek(SeekFrom::Start(input.start))?;
        let mut bytes = Vec::with_capacity(input.bytes as usize);
        file.take(input.bytes).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    let bytes = read().with_context(|| format!("cannot read {}", input.path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            input.path.display(),
            input.start as usize + e.utf8_error().valid_up_to()
        )
    })?;
    if input.kind == Kind::Text {
        return Ok(paragraphs(&text));
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", input.path.display(), line_number(input, i));
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not a JSON line", at()))?;
        let doc = value
            .get(field)
            .with_context(|| format!("{}: no field {field:?} (choose it with --field)", at()))?
            .as_str()
            .with_context(|| format!("{}: field {field:?} is not a string", at()))?;
        docs.push(doc.to_string());
    }
    Ok(docs)
}

/// The file's line number (from 1) of line `i` of `input`'s piece: the lines before the piece
/// are counted (only when an error names a line).
fn line_number(input: &Input, i: usize) -> usize {
    use std::io::Read;
    let mut before = 0;
    if let Ok(file) = std::fs::File::open(&input.path) {
        let mut head = file.take(input.start);
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = head.read(&mut buf) {
            if n == 0 {
                break;
            }
            before += buf[..n].iter().filter(|&&c| c == b'\n').count();
        }
    }
    before + i + 1
}

/// A text's blank-line-separated paragraphs, without the blank lines.
pub fn paragraphs(text: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut current = String::new();
    for line in text.split_inclusive('\n') {
        if line.trim().is_empty() {
            if !current.is_empty() {
                docs.push(std::mem::take(&mut current));
            }
        } else {
            current.push_str(line);
        }
    }
    if !current.is_empty() {
        docs.push(current);
    }
    docs
}

/// The inputs cut into chunks of at least `chunk_bytes` of text (the last may hold less): whole
/// files, and pieces of files larger than that cut at document boundaries.
fn chunks(inputs: Vec<Input>, chunk_bytes: u64, field: &str) -> Result<Vec<Vec<Input>>> {
    let mut out: Vec<Vec<Input>> = Vec::new();
    let mut size = 0;
    let mut pieces = Vec::new();
    for input in inputs {
        pieces.extend(input.pieces(chunk_bytes, field)?);
    }
    for input in pieces {
        if out.is_empty() || size >= chunk_bytes {
            out.push(Vec::new());
            size = 0;
        }
        size += input.bytes;
        out.last_mut().expect("a chunk").push(input);
    }
    Ok(out)
}

/// The first `mb` MB of the inputs' documents, joined by newlines: what a BPE is trained on.
pub fn sample_text(specs: &[String], field: &str, mb: usize) -> Result<String> {
    let limit = mb.max(1) * 1_000_000;
    let mut sample = String::new();
    for input in input_files(specs)? {
        // Read piece by piece: a file of many gigabytes is not read whole for a sample.
        for piece in input.pieces(limit as u64, field)? {
            for doc in documents(&piece, field)? {
                sample.push_str(&doc);
                sample.push('\n');
                if sample.len() >= limit {
                    return Ok(sample);
                }
            }
        }
    }
    Ok(sample)
}

/// The end-of-text token's id: `eot` in the tokenizer's vocabulary.
pub fn eot_id(tok: &Tokenizer, eot: &str) -> Result<u32> {
    tok.token_to_id(eot).with_context(|| {
        format!("the tokenizer has no token {eot:?} to end documents with; name its end-of-text token with --eot")
    })
}

/// Prepares the shards `plan` describes with `tok`, writing `tokenizer.json` beside them.
pub fn prepare(plan: &Plan, tok: &Tokenizer) -> Result<Prepared> {
    if plan.val_every < 2 {
        bail!(
            "--val-every must be at least 2 (one document in N goes to validation), got {}",
            plan.val_every
        );
    }
    let eot = eot_id(tok, &plan.eot)?;
    let width = format::width_for(tok.get_vocab_size(true));
    let hash = tokenizer::hash(tok)?;
    let inputs = input_files(&plan.inputs)?;
    std::fs::create_dir_all(&plan.out)
        .with_context(|| format!("cannot create {}", plan.out.display()))?;
    check_or_write_manifest(plan, &inputs, hash)?;
    tokenizer::save(tok, &plan.out.join("tokenizer.json"))?;
    let chunks = chunks(inputs, plan.chunk_bytes.max(1), &plan.field)?;
    let total: u64 = chunks.iter().flatten().map(|i| i.bytes).sum();
    let bar = progress_bar(plan.progress, total);
    let started = Instant::now();
    let mut done = Prepared::default();
    let mut doc_index = 0usize;
    for (k, chunk) in chunks.into_iter().enumerate() {
        let train_path = plan.out.join(format!("train_{k:05}.bin"));
        let val_path = plan.out.join(format!("val_{k:05}.bin"));
        let bytes: u64 = chunk.iter().map(|i| i.bytes).sum();
        let mut docs = Vec::new();
        for input in &chunk {
            docs.extend(documents(input, &plan.field)?);
        }
        let first = doc_index;
        doc_index += docs.len();
        done.documents += docs.len();
        done.text_bytes += bytes;
        if train_path.exists() {
            done.skipped += 1;
            bar.inc(bytes);
            continue;
        }
        let encoded: Vec<Vec<u32>> = docs
            .par_iter()
            .map(|d| tok.encode(d.as_str(), false).map(|e| e.get_ids().to_vec()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow!("tokenizing chunk {k}: {e}"))?;
        let (mut train, mut val) = (Split::default(), Split::default());
        for (i, ids) in encoded.into_iter().enumerate() {
            let to_val = (first + i) % plan.val_every == plan.val_every - 1;
            let split = if to_val { &mut val } else { &mut train };
            split.doc_starts.push(split.tokens.len() as u64);
            split.tokens.extend(ids);
            split.tokens.push(eot);
        }
        if !val.tokens.is_empty() {
            val.write(&val_path, width, hash)?;
        }
        if !train.tokens.is_empty() {
            train.write(&train_path, width, hash)?;
        }
        done.train_tokens += train.tokens.len();
        done.val_tokens += val.tokens.len();
        done.written += 1;
        bar.inc(bytes);
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{:.0} tokens/s",
            (done.train_tokens + done.val_tokens) as f64 / secs
        ));
    }
    bar.finish_and_clear();
    if done.val_tokens == 0 && done.written > 0 && done.skipped == 0 {
        bail!(
            "the inputs hold {} documents, fewer than --val-every = {}: no document went to validation; lower --val-every",
            done.documents,
            plan.val_every
        );
    }
    Ok(done)
}

/// What decides a prepare's shards, kept as `prepare.json` beside them: the inputs (paths and
/// sizes), the chunk size, the split, the JSON field, the end-of-text token and the tokenizer.
fn manifest(plan: &Plan, inputs: &[Input], hash: [u8; 32]) -> serde_json::Value {
    let files: Vec<serde_json::Value> = inputs
        .iter()
        .map(|i| serde_json::json!([i.path.display().to_string(), i.bytes]))
        .collect();
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    serde_json::json!({
        "format": format::VERSION,
        "inputs": files,
        "chunk_bytes": plan.chunk_bytes,
        "val_every": plan.val_every,
        "field": plan.field,
        "eot": plan.eot,
        "tokenizer_sha256": hex,
    })
}

/// Shards already in `plan.out` are kept only if they were made the same way: an error names
/// the first setting that differs (or says that no `prepare.json` records them). Otherwise
/// records how the shards are made.
fn check_or_write_manifest(plan: &Plan, inputs: &[Input], hash: [u8; 32]) -> Result<()> {
    let path = plan.out.join("prepare.json");
    let want = manifest(plan, inputs, hash);
    let advice = "give another --out, or remove its shards to make them anew";
    if path.exists() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let had: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        let keys = want.as_object().expect("an object").keys();
        if let Some(key) = keys
            .into_iter()
            .find(|k| had[k.as_str()] != want[k.as_str()])
        {
            bail!(
                "{} holds shards made with another {key} ({} there, {} now): {advice}",
                plan.out.display(),
                had[key.as_str()],
                want[key.as_str()]
            );
        }
        return Ok(());
    }
    let existing = std::fs::read_dir(&plan.out)
        .with_context(|| format!("cannot list {}", plan.out.display()))?
        .filter_map(|e| e.ok())
        .any(|e| e.path().extension().is_some_and(|x| x == "bin"));
    if existing {
        bail!(
            "{} already holds .bin files that no prepare.json describes: {advice}",
            plan.out.display()
        );
    }
    let text = serde_json::to_string_pretty(&want).expect("JSON serialises");
    crate::fsutil::write_atomic(&path, text.as_bytes())
}

/// One split's tokens and document starts in a chunk.
#[derive(Default)]
struct Split {
    tokens: Vec<u32>,
    doc_starts: Vec<u64>,
}

impl Split {
    fn write(&self, path: &Path, width: usize, tokenizer_hash: [u8; 32]) -> Result<()> {
        let info = ShardInfo {
            doc_starts: &self.doc_starts,
            tokenizer_hash,
        };
        format::write(path, &self.tokens, width, &info)
    }
}

fn progress_bar(show: bool, total: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg} (eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}
