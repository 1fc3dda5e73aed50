//! Reading one text column of a Parquet file (the format datasets on the Hugging Face Hub ship
//! in), row group by row group, for `prepare`.
//!
//! A Parquet file is `PAR1`, column chunks grouped in row groups, a footer of metadata (Thrift's
//! compact protocol, [`thrift`]), its length (4 bytes) and `PAR1` again. [`TextColumn::open`]
//! reads the footer and finds the named column; [`TextColumn::read`] reads one row group's chunk
//! of it and decodes its pages ([`pages`]).
//!
//! Supported: a top-level string (or binary) column, required or optional (null rows give
//! `None`); data pages of versions 1 and 2; PLAIN and dictionary encodings; uncompressed,
//! snappy, gzip and zstd chunks: what pyarrow writes by default. Nested columns, other
//! encodings and codecs are refused with an error that names the file and what it holds.

mod pages;
mod snappy;
mod thrift;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

use pages::Codec;
use thrift::{Fields, Reader, Value};

const MAGIC: &[u8; 4] = b"PAR1";
/// Physical type `BYTE_ARRAY` (`Type`).
const BYTE_ARRAY: i64 = 6;
/// Repetition types (`FieldRepetitionType`).
const OPTIONAL: i64 = 1;
const REPEATED: i64 = 2;
/// Footers larger than this are refused as damage.
const MAX_FOOTER: u64 = 1 << 30;

/// One column chunk: where it lies and how it is compressed.
#[derive(Debug, Clone)]
struct Chunk {
    start: u64,
    bytes: u64,
    codec: Codec,
    rows: u64,
}

/// A string column of a Parquet file, ready to be read row group by row group.
#[derive(Debug, Clone)]
pub struct TextColumn {
    path: PathBuf,
    column: String,
    optional: bool,
    /// Per row group, the column's chunk.
    chunks: Vec<Chunk>,
}

impl TextColumn {
    /// Reads `path`'s footer and finds column `column`; errors name the file and, for a missing
    /// column, the columns it has.
    pub fn open(path: &Path, column: &str) -> Result<Self> {
        let at = || path.display().to_string();
        let meta =
            footer(path).with_context(|| format!("{}: not a readable Parquet file", at()))?;
        let schema = meta.list(2);
        // The root (element 0) and its direct children; a child with children is a group.
        let mut names = Vec::new();
        let (mut found, mut leaf) = (None, 0usize);
        let mut i = 1;
        while i < schema.len() {
            let Value::Struct(el) = &schema[i] else {
                bail!("{}: a schema element that is not a struct", at());
            };
            let name = el.string(4).unwrap_or_default();
            if name == column {
                found = Some((el.clone(), el.int(5).unwrap_or(0), leaf));
            }
            names.push(name);
            let end =
                i + 1 + descendants(schema, i).with_context(|| format!("{}: its schema", at()))?;
            leaf += leaves(&schema[i..end]);
            i = end;
        }
        let Some((el, children, index)) = found else {
            bail!(
                "{}: no column {column:?}; its columns are {} (choose one with --field)",
                at(),
                names.join(", ")
            );
        };
        if children > 0 || el.int(3) == Some(REPEATED) {
            bail!("{}: column {column:?} is nested or repeated; a text column is a flat string column", at());
        }
        if el.int(1) != Some(BYTE_ARRAY) {
            bail!(
                "{}: column {column:?} holds {}, not text",
                at(),
                type_name(el.int(1))
            );
        }
        let mut chunks = Vec::new();
        for (g, group) in meta.list(4).iter().enumerate() {
            let Value::Struct(group) = group else {
                bail!("{}: row group {g} is not a struct", at());
            };
            let chunk = match group.list(1).get(index) {
                Some(Value::Struct(c)) => c,
                _ => bail!("{}: row group {g} has no chunk for column {column:?}", at()),
            };
            if chunk.string(1).is_some() {
                bail!("{}: column {column:?} lies in another file (external column chunks are not supported)", at());
            }
            let m = chunk
                .strukt(3)
                .ok_or_else(|| anyhow!("{}: row group {g}'s chunk has no metadata", at()))?;
            let data = m.int(9).unwrap_or(0);
            let start = m.int(11).filter(|&d| d > 0 && d < data).unwrap_or(data);
            let bytes = m.int(7).unwrap_or(0);
            if start < 4 || bytes < 0 {
                bail!("{}: row group {g}'s chunk lies at byte {start}", at());
            }
            chunks.push(Chunk {
                start: start as u64,
                bytes: bytes as u64,
                codec: Codec::from_id(m.int(4).unwrap_or(0))
                    .with_context(|| format!("{}: column {column:?}", at()))?,
                rows: group.int(3).unwrap_or(0).max(0) as u64,
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            column: column.to_string(),
            optional: el.int(3) == Some(OPTIONAL),
            chunks,
        })
    }

    /// Row groups in the file.
    pub fn row_groups(&self) -> usize {
        self.chunks.len()
    }

    /// Compressed bytes of row group `g`'s chunk of the column.
    pub fn chunk_bytes(&self, g: usize) -> u64 {
        self.chunks[g].bytes
    }

    /// The rows of row group `g`: the text of each (invalid UTF-8 is an error naming the row),
    /// `None` for a null.
    pub fn read(&self, g: usize) -> Result<Vec<Option<String>>> {
        let c = &self.chunks[g];
        let at = || {
            format!(
                "{}: row group {g}, column {:?}",
                self.path.display(),
                self.column
            )
        };
        let mut bytes = vec![0u8; c.bytes as usize];
        let mut f = std::fs::File::open(&self.path)
            .with_context(|| format!("cannot open {}", self.path.display()))?;
        f.seek(SeekFrom::Start(c.start))
            .and_then(|_| f.read_exact(&mut bytes))
            .with_context(|| format!("{}: cannot read its {} bytes", at(), c.bytes))?;
        let values = pages::read_chunk(&bytes, c.codec, self.optional).with_context(at)?;
        if values.len() as u64 != c.rows {
            bail!("{}: {} values for {} rows", at(), values.len(), c.rows);
        }
        let first_row: u64 = self.chunks[..g].iter().map(|c| c.rows).sum();
        values
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                v.map(|b| {
                    String::from_utf8(b).map_err(|_| {
                        anyhow!("{}: row {} is not UTF-8 text", at(), first_row + i as u64)
                    })
                })
                .transpose()
            })
            .collect()
    }
}

/// The file's footer metadata (`FileMetaData`).
fn footer(path: &Path) -> Result<Fields> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len < 12 {
        bail!("{len} bytes is too short for a Parquet file");
    }
    let mut head = [0u8; 4];
    f.read_exact(&mut head)?;
    let mut tail = [0u8; 8];
    f.seek(SeekFrom::Start(len - 8))?;
    f.read_exact(&mut tail)?;
    if &head != MAGIC || &tail[4..] != MAGIC {
        bail!("no PAR1 magic at its start and end");
    }
    let size = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if size > MAX_FOOTER || size + 12 > len {
        bail!("a footer of {size} bytes in a file of {len}");
    }
    let mut meta = vec![0u8; size as usize];
    f.seek(SeekFrom::Start(len - 8 - size))?;
    f.read_exact(&mut meta)?;
    Reader::new(&meta).read_struct().context("its footer")
}

/// Elements below schema element `i` (its children, theirs, ...).
fn descendants(schema: &[Value], i: usize) -> Result<usize> {
    let children = match &schema[i] {
        Value::Struct(el) => el.int(5).unwrap_or(0).max(0) as usize,
        _ => bail!("a schema element that is not a struct"),
    };
    let mut n = 0;
    for _ in 0..children {
        let next = i + 1 + n;
        if next >= schema.len() {
            bail!("the schema ends inside a group");
        }
        n += 1 + descendants(schema, next)?;
    }
    Ok(n)
}

/// Leaf columns (elements without children) among `elements`.
fn leaves(elements: &[Value]) -> usize {
    elements
        .iter()
        .filter(|v| matches!(v, Value::Struct(el) if el.int(5).unwrap_or(0) == 0))
        .count()
}

fn type_name(t: Option<i64>) -> &'static str {
    match t {
        Some(0) => "booleans",
        Some(1) => "32-bit integers",
        Some(2) => "64-bit integers",
        Some(3) => "96-bit integers",
        Some(4) => "floats",
        Some(5) => "doubles",
        Some(7) => "fixed-length byte arrays",
        _ => "a group",
    }
}
