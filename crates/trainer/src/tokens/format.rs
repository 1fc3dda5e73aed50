//! The token shard files a run reads: this engine's own (written by `prepare`), llm.c's and
//! nanoGPT's. What is in a file's first bytes decides its kind:
//!
//! - **Ours** (`BMXTOKS1`): a 72-byte header (magic; format version, bytes per token as `u32`;
//!   token count, document count as `u64`; largest token id plus one as `u32`; four bytes kept
//!   zero; the SHA-256 of the tokenizer's JSON), the tokens (little-endian `u16` or `u32`), then
//!   each document's first token as a `u64`. Everything little-endian.
//! - **llm.c** (`dev/data/*.py`): 256 little-endian `i32`s (magic 20240520 with version 1 for
//!   `u16` tokens, GPT-2's; magic 20240801 with version 7 for `u32` tokens, Llama 3's; then the
//!   token count), then the tokens.
//! - **nanoGPT** (`prepare.py`'s `train.bin` / `val.bin`): `u16` tokens and nothing else.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// The first eight bytes of one of our shards.
pub const MAGIC: &[u8; 8] = b"BMXTOKS1";
/// The format version our shards are written in.
pub const VERSION: u32 = 1;
/// Bytes of our header.
pub const HEADER_BYTES: usize = 72;
/// llm.c's header: 256 `i32`s.
const LLMC_HEADER_BYTES: usize = 256 * 4;
const LLMC_GPT2: (i32, i32) = (20240520, 1);
const LLMC_LLAMA3: (i32, i32) = (20240801, 7);

/// Where a file's tokens are and what the file says about them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Which tool wrote it, for messages.
    pub kind: Kind,
    /// Byte offset of the first token.
    pub offset: usize,
    /// Bytes per token: 2 or 4.
    pub width: usize,
    /// Tokens in the file.
    pub count: usize,
    /// Largest token id plus one, where the header records it (ours).
    pub max_id_bound: Option<u32>,
    /// SHA-256 of the tokenizer's JSON, where the header records it (ours).
    pub tokenizer_hash: Option<[u8; 32]>,
}

/// Which tool's format a shard is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Ours,
    LlmC,
    NanoGpt,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Ours => "burnmix shard",
            Kind::LlmC => "llm.c shard",
            Kind::NanoGpt => "nanoGPT token file",
        })
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The layout of the shard whose bytes are `bytes`, or an error naming `path` and what is wrong
/// (a damaged or truncated header, a size that does not match it). A file that is neither ours
/// nor llm.c's is read as nanoGPT's raw `u16` tokens if its name ends in `.bin` and its size is
/// even.
pub fn layout(bytes: &[u8], path: &Path) -> Result<Layout> {
    let name = path.display();
    if bytes.len() >= 8 && &bytes[..8] == MAGIC {
        if bytes.len() < HEADER_BYTES {
            bail!(
                "{name}: a burnmix shard cut short inside its header ({} of {HEADER_BYTES} bytes); prepare it again",
                bytes.len()
            );
        }
        let version = u32_at(bytes, 8);
        if version != VERSION {
            bail!("{name}: a burnmix shard of format version {version}; this build reads version {VERSION}");
        }
        let width = u32_at(bytes, 12) as usize;
        if width != 2 && width != 4 {
            bail!("{name}: a burnmix shard with {width} bytes per token in its header (2 or 4 are valid): the file is damaged");
        }
        let count = u64_at(bytes, 16) as usize;
        let docs = u64_at(bytes, 24) as usize;
        let max_id_bound = u32_at(bytes, 32);
        let tokenizer_hash: [u8; 32] = bytes[40..72].try_into().expect("32 bytes");
        let want = count
            .checked_mul(width)
            .zip(docs.checked_mul(8))
            .and_then(|(t, d)| t.checked_add(d))
            .and_then(|n| n.checked_add(HEADER_BYTES));
        let Some(want) = want else {
            bail!("{name}: the header's counts ({count} tokens, {docs} documents) are impossible: the file is damaged");
        };
        if bytes.len() != want {
            bail!(
                "{name}: the header promises {count} tokens and {docs} documents ({want} bytes) but the file has {} bytes: it is truncated or damaged; prepare it again",
                bytes.len()
            );
        }
        return Ok(Layout {
            kind: Kind::Ours,
            offset: HEADER_BYTES,
            width,
            count,
            max_id_bound: Some(max_id_bound),
            tokenizer_hash: Some(tokenizer_hash),
        });
    }
    if bytes.len() >= 12 {
        let (magic, version) = (u32_at(bytes, 0) as i32, u32_at(bytes, 4) as i32);
        let width = match (magic, version) {
            LLMC_GPT2 => Some(2),
            LLMC_LLAMA3 => Some(4),
            (20240520 | 20240801, v) => bail!(
                "{name}: an llm.c shard of version {v}, which this build does not read (version 1 with u16 tokens, or 7 with u32)"
            ),
            _ => None,
        };
        if let Some(width) = width {
            if bytes.len() < LLMC_HEADER_BYTES {
                bail!("{name}: an llm.c shard cut short inside its 1024-byte header");
            }
            let count = u32_at(bytes, 8) as usize;
            let want = LLMC_HEADER_BYTES + count * width;
            if bytes.len() != want {
                bail!(
                    "{name}: the llm.c header promises {count} tokens ({want} bytes) but the file has {} bytes: it is truncated or damaged",
                    bytes.len()
                );
            }
            return Ok(Layout {
                kind: Kind::LlmC,
                offset: LLMC_HEADER_BYTES,
                width,
                count,
                max_id_bound: None,
                tokenizer_hash: None,
            });
        }
    }
    let is_bin = path.extension().is_some_and(|e| e == "bin");
    if !is_bin {
        bail!(
            "{name}: not a token shard (no burnmix or llm.c header, and not a nanoGPT .bin file); `prepare` makes shards from text"
        );
    }
    if !bytes.len().is_multiple_of(2) {
        bail!(
            "{name}: read as nanoGPT's raw u16 tokens (no header), but its size ({} bytes) is odd: it is truncated or not a token file",
            bytes.len()
        );
    }
    Ok(Layout {
        kind: Kind::NanoGpt,
        offset: 0,
        width: 2,
        count: bytes.len() / 2,
        max_id_bound: None,
        tokenizer_hash: None,
    })
}

/// What one of our shards holds besides its tokens.
pub struct ShardInfo<'a> {
    /// Each document's first token.
    pub doc_starts: &'a [u64],
    /// SHA-256 of the tokenizer's JSON.
    pub tokenizer_hash: [u8; 32],
}

/// The bytes per token a vocabulary of `vocab` ids needs: 2 when every id fits a `u16`.
pub fn width_for(vocab: usize) -> usize {
    if vocab <= 1 << 16 {
        2
    } else {
        4
    }
}

/// Writes `tokens` as one of our shards at `path`, `width` bytes per token: first to a file
/// beside it, flushed to the disk, then renamed into place, so that a shard at `path` is always
/// complete (an interrupted or failed write, a full disk among them, leaves no file there).
pub fn write(path: &Path, tokens: &[u32], width: usize, info: &ShardInfo<'_>) -> Result<()> {
    assert!(width == 2 || width == 4, "2 or 4 bytes per token");
    let max_id_bound = tokens.iter().max().map_or(0, |m| m + 1);
    if width == 2 && max_id_bound > 1 << 16 {
        bail!(
            "{}: token id {} does not fit 2 bytes per token",
            path.display(),
            max_id_bound - 1
        );
    }
    let mut bytes =
        Vec::with_capacity(HEADER_BYTES + tokens.len() * width + info.doc_starts.len() * 8);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&(width as u32).to_le_bytes());
    bytes.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&(info.doc_starts.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&max_id_bound.to_le_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes.extend_from_slice(&info.tokenizer_hash);
    debug_assert_eq!(bytes.len(), HEADER_BYTES);
    for &t in tokens {
        match width {
            2 => bytes.extend_from_slice(&(t as u16).to_le_bytes()),
            _ => bytes.extend_from_slice(&t.to_le_bytes()),
        }
    }
    for &d in info.doc_starts {
        bytes.extend_from_slice(&d.to_le_bytes());
    }
    let tmp = path.with_extension("partial");
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {} (is the disk full?)", tmp.display()));
    }
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}
