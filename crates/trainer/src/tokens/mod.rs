//! Token streams a run draws its windows from: in memory (text tokenized at start), or token
//! shard files ([`ShardSet`]) read a window at a time, never loaded whole. Both read as one
//! stream, the shards one after another in name order, so windows stay a pure function of
//! (seed, step, rank) whichever the source.
//!
//! - `format.rs`: the shard files (ours, llm.c's, nanoGPT's) and writing ours.

pub mod format;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;

use format::{Kind, Layout};

/// A stream of tokens.
pub enum Tokens {
    Memory(Vec<u32>),
    Mapped(ShardSet),
}

impl Tokens {
    /// Tokens in the stream.
    pub fn len(&self) -> usize {
        match self {
            Tokens::Memory(t) => t.len(),
            Tokens::Mapped(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends tokens `start .. start + n` to `out`.
    ///
    /// # Panics
    /// If the range runs past the stream's end.
    pub fn extend_window(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        match self {
            Tokens::Memory(t) => out.extend(t[start..start + n].iter().map(|&x| x as i64)),
            Tokens::Mapped(s) => s.extend_window(start, n, out),
        }
    }

    /// The largest token id plus one: from the shards' headers where they record it, else by
    /// reading every token once (on every core).
    pub fn max_id_bound(&self) -> usize {
        match self {
            Tokens::Memory(t) => t.iter().max().map_or(0, |&m| m as usize + 1),
            Tokens::Mapped(s) => s.max_id_bound(),
        }
    }
}

/// One shard: its file, open for positioned reads, and a memory map of it, from which its header
/// and layout are read.
///
/// Windows are read from the file, not through the map: every page a read through the map
/// touches stays mapped into the process, where it counts toward its resident memory until the
/// kernel reclaims it, and the kernel maps whole folios of the page cache (megabytes) around
/// each touched page. Over a 10 GB set that was 2 GiB after 60 steps of `gpt2_small`; positioned
/// reads (as llm.c's loader does) go through the page cache and leave nothing mapped.
struct Shard {
    path: PathBuf,
    file: std::fs::File,
    map: Mmap,
    layout: Layout,
}

impl Shard {
    fn token(&self, i: usize) -> u32 {
        let at = self.layout.offset + i * self.layout.width;
        decode(&self.map[at..at + self.layout.width], self.layout.width)
    }

    /// Appends tokens `i .. i + n` of this shard to `out`, read from the file in one read.
    fn extend(&self, i: usize, n: usize, buf: &mut Vec<u8>, out: &mut Vec<i64>) {
        let width = self.layout.width;
        buf.resize(n * width, 0);
        let at = (self.layout.offset + i * width) as u64;
        if let Err(e) = read_at(&self.file, buf, at) {
            // The shard was checked against its header at start: only a file changed or
            // removed during the run, or a failing disk, gets here.
            panic!(
                "{}: cannot read tokens {i}..{} of the shard: {e} (was it changed or removed during the run?)",
                self.path.display(),
                i + n
            );
        }
        out.extend(buf.chunks_exact(width).map(|b| decode(b, width) as i64));
    }
}

fn decode(b: &[u8], width: usize) -> u32 {
    match width {
        2 => u16::from_le_bytes([b[0], b[1]]) as u32,
        _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

#[cfg(unix)]
fn read_at(file: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, at)
}

#[cfg(windows)]
fn read_at(file: &std::fs::File, mut buf: &mut [u8], mut at: u64) -> std::io::Result<()> {
    while !buf.is_empty() {
        match std::os::windows::fs::FileExt::seek_read(file, buf, at)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                at += n as u64;
            }
        }
    }
    Ok(())
}

/// The largest token id plus one of shard `s`, read from its file in blocks on every core.
fn scan_bound(s: &Shard) -> std::io::Result<usize> {
    use std::io::{Read, Seek, SeekFrom};
    const BLOCK: usize = 8 << 20;
    let (width, bytes) = (s.layout.width, s.layout.count * s.layout.width);
    let block_max = |b: usize| -> std::io::Result<u32> {
        let (start, len) = (b * BLOCK, BLOCK.min(bytes - b * BLOCK));
        let mut file = std::fs::File::open(&s.path)?;
        file.seek(SeekFrom::Start((s.layout.offset + start) as u64))?;
        let mut buf = vec![0u8; len];
        file.read_exact(&mut buf)?;
        Ok(match width {
            2 => buf
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .max(),
            _ => buf
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .max(),
        }
        .unwrap_or(0))
    };
    let max = (0..bytes.div_ceil(BLOCK))
        .into_par_iter()
        .map(block_max)
        .try_reduce(|| 0, |a, b| Ok(a.max(b)))?;
    Ok(if bytes == 0 { 0 } else { max as usize + 1 })
}

/// Token shard files read a window at a time (positioned reads; headers through memory maps), as
/// one stream in the order given.
pub struct ShardSet {
    shards: Vec<Shard>,
    /// The stream offset of each shard's first token, and the total at the end.
    starts: Vec<usize>,
    /// Each shard's largest token id plus one, once found.
    bounds: std::sync::OnceLock<Vec<usize>>,
}

impl ShardSet {
    /// Maps `paths` (in this order) and checks each file's header and size.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut starts = vec![0];
        for path in paths {
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot open the token shard {}", path.display()))?;
            // SAFETY: the file is only read; a shard changed while a run reads it is the
            // user's to avoid, as with any memory-mapped dataset.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map the token shard {}", path.display()))?;
            let layout = format::layout(&map, path)?;
            if layout.count == 0 {
                bail!("{}: the shard holds no tokens", path.display());
            }
            starts.push(starts.last().expect("a start") + layout.count);
            shards.push(Shard {
                path: path.clone(),
                file,
                map,
                layout,
            });
        }
        Ok(Self {
            shards,
            starts,
            bounds: Default::default(),
        })
    }

    pub fn len(&self) -> usize {
        *self.starts.last().expect("a start")
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards' paths, in stream order.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Which format the shards are in, and the tokenizer hash every one of ours records (the
    /// first shard whose hash differs from the first's is an error naming both files).
    pub fn kind_and_hash(&self) -> Result<(Kind, Option<[u8; 32]>)> {
        let first = &self.shards[0];
        for s in &self.shards[1..] {
            if s.layout.kind != first.layout.kind {
                bail!(
                    "{} is a {} but {} is a {}: one run reads shards of one kind",
                    first.path.display(),
                    first.layout.kind,
                    s.path.display(),
                    s.layout.kind
                );
            }
            if s.layout.tokenizer_hash != first.layout.tokenizer_hash {
                bail!(
                    "{} and {} were made with different tokenizers (their tokenizer hashes differ)",
                    first.path.display(),
                    s.path.display()
                );
            }
        }
        Ok((first.layout.kind, first.layout.tokenizer_hash))
    }

    fn max_id_bound(&self) -> usize {
        self.bounds().into_iter().max().unwrap_or(0)
    }

    /// Each shard's largest token id plus one: from its header (ours), else by reading it once.
    fn bounds(&self) -> Vec<usize> {
        self.bounds.get_or_init(|| self.find_bounds()).clone()
    }

    fn find_bounds(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| match s.layout.max_id_bound {
                Some(m) => m as usize,
                // Through reads, so that a scan of many gigabytes leaves no page mapped into
                // the process (through the map it would count them all toward its resident
                // memory); through the map if a read fails.
                None => scan_bound(s).unwrap_or_else(|_| {
                    (0..s.layout.count)
                        .into_par_iter()
                        .map(|i| s.token(i))
                        .max()
                        .map_or(0, |m| m as usize + 1)
                }),
            })
            .collect()
    }

    /// An error naming the first shard holding a token id not below `vocab` (the tokenizer's
    /// vocabulary): its tokens were made with another tokenizer.
    pub fn check_ids_below(&self, vocab: usize, tokenizer: &Path) -> Result<()> {
        for (s, bound) in self.shards.iter().zip(self.bounds()) {
            if bound > vocab {
                bail!(
                    "{} holds token id {} but the tokenizer {} has {vocab} tokens: the shard was made with another tokenizer",
                    s.path.display(),
                    bound - 1,
                    tokenizer.display()
                );
            }
        }
        Ok(())
    }

    /// The shard holding stream token `i`, and `i` within it.
    fn find(&self, i: usize) -> (usize, usize) {
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        (k, i - self.starts[k])
    }

    fn extend_window(&self, start: usize, n: usize, out: &mut Vec<i64>) {
        assert!(start + n <= self.len(), "a window past the stream's end");
        let (mut k, mut i) = self.find(start);
        let mut left = n;
        let mut buf = Vec::new();
        while left > 0 {
            while i == self.shards[k].layout.count {
                k += 1;
                i = 0;
            }
            let take = left.min(self.shards[k].layout.count - i);
            self.shards[k].extend(i, take, &mut buf, out);
            i += take;
            left -= take;
        }
    }
}

/// The files `spec` names, sorted by path: a file; a directory's files whose names contain
/// `within_dir` (`"train"` or `"val"`) and end in `.bin`; or a glob pattern. An error when none
/// match, naming the `key` it came from.
pub fn resolve(spec: &str, within_dir: &str, key: &str) -> Result<Vec<PathBuf>> {
    let path = Path::new(spec);
    let mut files: Vec<PathBuf> = if path.is_file() {
        vec![path.to_path_buf()]
    } else if path.is_dir() {
        std::fs::read_dir(path)
            .with_context(|| format!("{key} = {spec:?}: cannot list the directory"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.extension().is_some_and(|e| e == "bin")
                    && p.file_name()
                        .is_some_and(|n| n.to_string_lossy().contains(within_dir))
            })
            .collect()
    } else {
        glob_files(spec, &format!("{key} = {spec:?}"))?
    };
    files.sort();
    if files.is_empty() {
        let what = if path.is_dir() {
            format!("the directory has no .bin file whose name contains \"{within_dir}\"")
        } else {
            "no file matches".to_string()
        };
        bail!("{key} = {spec:?}: {what}; `prepare` writes train_*.bin and val_*.bin shards");
    }
    Ok(files)
}

/// The files (not directories) the glob pattern `spec` matches, in the pattern's order; an
/// invalid pattern is an error that starts with `named` (where the pattern came from).
pub(crate) fn glob_files(spec: &str, named: &str) -> Result<Vec<PathBuf>> {
    Ok(glob::glob(spec)
        .with_context(|| format!("{named}: not a file, a directory or a valid glob pattern"))?
        .filter_map(|p| p.ok())
        .filter(|p| p.is_file())
        .collect())
}
