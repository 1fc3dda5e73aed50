//! A column chunk's pages decoded into values: page headers, decompression, definition levels
//! (the RLE / bit-packed hybrid) and the values of a byte-array column, PLAIN or
//! dictionary-encoded, in data pages of either version.

use anyhow::{anyhow, bail, Context, Result};

use super::thrift::{Fields, Reader};

/// Page types (`PageType`).
const DATA_PAGE: i64 = 0;
const DICTIONARY_PAGE: i64 = 2;
const DATA_PAGE_V2: i64 = 3;

/// Encodings (`Encoding`).
const PLAIN: i64 = 0;
const PLAIN_DICTIONARY: i64 = 2;
const RLE_DICTIONARY: i64 = 8;

/// Parquet's encoding names, for errors.
fn encoding_name(e: i64) -> String {
    let names = [
        "PLAIN",
        "GROUP_VAR_INT",
        "PLAIN_DICTIONARY",
        "RLE",
        "BIT_PACKED",
        "DELTA_BINARY_PACKED",
        "DELTA_LENGTH_BYTE_ARRAY",
        "DELTA_BYTE_ARRAY",
        "RLE_DICTIONARY",
        "BYTE_STREAM_SPLIT",
    ];
    usize::try_from(e)
        .ok()
        .and_then(|i| names.get(i))
        .map_or_else(|| format!("encoding {e}"), |n| n.to_string())
}

/// Compression codecs (`CompressionCodec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Uncompressed,
    Snappy,
    Gzip,
    Zstd,
}

impl Codec {
    pub fn from_id(id: i64) -> Result<Self> {
        Ok(match id {
            0 => Codec::Uncompressed,
            1 => Codec::Snappy,
            2 => Codec::Gzip,
            6 => Codec::Zstd,
            3 => {
                bail!("LZO compression is not supported (uncompressed, snappy, gzip and zstd are)")
            }
            4 => bail!(
                "Brotli compression is not supported (uncompressed, snappy, gzip and zstd are)"
            ),
            5 | 7 => {
                bail!("LZ4 compression is not supported (uncompressed, snappy, gzip and zstd are)")
            }
            other => bail!("unknown compression codec {other}"),
        })
    }

    fn decompress(self, data: &[u8], size: usize) -> Result<Vec<u8>> {
        use std::io::Read;
        let out = match self {
            Codec::Uncompressed => data.to_vec(),
            Codec::Snappy => super::snappy::decompress(data)?,
            Codec::Gzip => {
                let mut out = Vec::with_capacity(size);
                flate2::read::MultiGzDecoder::new(data)
                    .read_to_end(&mut out)
                    .context("gzip data")?;
                out
            }
            Codec::Zstd => zstd::stream::decode_all(data).context("zstd data")?,
        };
        if out.len() != size {
            bail!(
                "a page decompressed to {} bytes where its header says {size}",
                out.len()
            );
        }
        Ok(out)
    }
}

/// The values of one column chunk: `None` where a row has no value (null).
pub fn read_chunk(chunk: &[u8], codec: Codec, optional: bool) -> Result<Vec<Option<Vec<u8>>>> {
    let mut pos = 0;
    let mut dictionary: Option<Vec<Vec<u8>>> = None;
    let mut values = Vec::new();
    while pos < chunk.len() {
        let mut r = Reader::new(&chunk[pos..]);
        let header = r
            .read_struct()
            .with_context(|| format!("page header at byte {pos} of the column chunk"))?;
        pos += r.pos;
        let field = |id: i16, what: &str| {
            header
                .int(id)
                .ok_or_else(|| anyhow!("page header without its {what}"))
        };
        let (kind, size, stored) = (
            field(1, "type")?,
            field(2, "uncompressed size")? as usize,
            field(3, "compressed size")? as usize,
        );
        let Some(body) = chunk.get(pos..pos + stored) else {
            bail!("a page of {stored} bytes at byte {pos} runs past the column chunk");
        };
        pos += stored;
        match kind {
            DICTIONARY_PAGE => {
                let h = sub(&header, 7, "dictionary page")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let enc = h.int(2).unwrap_or(PLAIN);
                if enc != PLAIN && enc != PLAIN_DICTIONARY {
                    bail!("a dictionary page in {}", encoding_name(enc));
                }
                dictionary = Some(plain(&codec.decompress(body, size)?, n)?);
            }
            DATA_PAGE => {
                let h = sub(&header, 5, "data page")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let data = codec.decompress(body, size)?;
                let (present, rest) = if optional {
                    let len = u32_at(&data, 0)? as usize;
                    let levels = data
                        .get(4..4 + len)
                        .ok_or_else(|| anyhow!("definition levels run past their page"))?;
                    (hybrid(levels, 1, n)?, &data[4 + len..])
                } else {
                    (vec![1; n], &data[..])
                };
                decode_values(
                    &present,
                    rest,
                    h.int(2).unwrap_or(PLAIN),
                    &dictionary,
                    &mut values,
                )?;
            }
            DATA_PAGE_V2 => {
                let h = sub(&header, 8, "data page v2")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let (def_len, rep_len) = (
                    h.int(5).unwrap_or(0) as usize,
                    h.int(6).unwrap_or(0) as usize,
                );
                let levels_end = rep_len + def_len;
                if levels_end > body.len() || levels_end > size {
                    bail!("levels of {levels_end} bytes in a page of {}", body.len());
                }
                let present = if optional {
                    hybrid(&body[rep_len..levels_end], 1, n)?
                } else {
                    vec![1; n]
                };
                let compressed = h.bool(7).unwrap_or(true);
                let data = if compressed {
                    codec.decompress(&body[levels_end..], size - levels_end)?
                } else {
                    body[levels_end..].to_vec()
                };
                decode_values(
                    &present,
                    &data,
                    h.int(4).unwrap_or(PLAIN),
                    &dictionary,
                    &mut values,
                )?;
            }
            _ => {} // index pages carry no values
        }
    }
    Ok(values)
}

fn sub<'a>(header: &'a Fields, id: i16, what: &str) -> Result<&'a Fields> {
    header
        .strukt(id)
        .ok_or_else(|| anyhow!("a {what} without its header"))
}

fn u32_at(data: &[u8], at: usize) -> Result<u32> {
    let b = data
        .get(at..at + 4)
        .ok_or_else(|| anyhow!("a page ends inside a length"))?;
    Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Appends a value (or `None`) per entry of `present` (its definition levels, 1 = present).
fn decode_values(
    present: &[u32],
    data: &[u8],
    encoding: i64,
    dictionary: &Option<Vec<Vec<u8>>>,
    out: &mut Vec<Option<Vec<u8>>>,
) -> Result<()> {
    let n = present.iter().filter(|&&p| p == 1).count();
    let mut got = match encoding {
        PLAIN => plain(data, n)?.into_iter(),
        PLAIN_DICTIONARY | RLE_DICTIONARY => {
            let dict = dictionary
                .as_ref()
                .ok_or_else(|| anyhow!("dictionary-encoded values before any dictionary page"))?;
            let width = *data
                .first()
                .ok_or_else(|| anyhow!("dictionary indices without their bit width"))?;
            let ids = hybrid(&data[1..], u32::from(width), n)?;
            let mut vals = Vec::with_capacity(n);
            for id in ids {
                let v = dict.get(id as usize).ok_or_else(|| {
                    anyhow!("dictionary index {id} in a dictionary of {}", dict.len())
                })?;
                vals.push(v.clone());
            }
            vals.into_iter()
        }
        other => bail!(
            "values in {} (PLAIN and dictionary encodings are supported; rewrite the file with pyarrow's defaults)",
            encoding_name(other)
        ),
    };
    for &p in present {
        out.push(if p == 1 { got.next() } else { None });
    }
    Ok(())
}

/// `n` PLAIN byte arrays: each a 4-byte little-endian length and its bytes.
fn plain(data: &[u8], n: usize) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(n.min(data.len() / 4 + 1));
    let mut pos = 0;
    for _ in 0..n {
        let len = u32_at(data, pos)? as usize;
        let v = data
            .get(pos + 4..pos + 4 + len)
            .ok_or_else(|| anyhow!("a value of {len} bytes runs past its page"))?;
        out.push(v.to_vec());
        pos += 4 + len;
    }
    Ok(out)
}

/// `n` values of `width` bits from the RLE / bit-packed hybrid encoding: runs, each a varint
/// header (`count << 1` then a value of `ceil(width / 8)` bytes: `count` repeats; or
/// `groups << 1 | 1`: `8 * groups` values packed least significant bit first).
pub fn hybrid(data: &[u8], width: u32, n: usize) -> Result<Vec<u32>> {
    if width > 32 {
        bail!("bit width {width} over 32");
    }
    let mut out = Vec::with_capacity(n);
    let mut pos = 0;
    while out.len() < n {
        let mut header = 0u64;
        for shift in (0..35).step_by(7) {
            let b = *data
                .get(pos)
                .ok_or_else(|| anyhow!("run-length data ends after {} of {n} values", out.len()))?;
            pos += 1;
            header |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
        }
        let count = (header >> 1) as usize;
        if header & 1 == 0 {
            let bytes = width.div_ceil(8) as usize;
            let v = data
                .get(pos..pos + bytes)
                .ok_or_else(|| anyhow!("a run's value runs past its data"))?;
            pos += bytes;
            let v = v.iter().rev().fold(0u32, |a, &b| (a << 8) | u32::from(b));
            out.extend(std::iter::repeat_n(v, count.min(n - out.len())));
        } else {
            let bits = count * 8 * width as usize;
            let packed = data
                .get(pos..pos + bits.div_ceil(8))
                .ok_or_else(|| anyhow!("bit-packed values run past their data"))?;
            pos += bits.div_ceil(8);
            for i in 0..(count * 8).min(n - out.len()) {
                let mut v = 0u32;
                for b in 0..width as usize {
                    let bit = i * width as usize + b;
                    v |= u32::from((packed[bit / 8] >> (bit % 8)) & 1) << b;
                }
                out.push(v);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::hybrid;

    /// A repeated run and a bit-packed group of 3-bit values (the example of Parquet's spec).
    #[test]
    fn decodes_the_rle_bit_packed_hybrid() {
        // 5 repeats of 1 (1-bit), then 0..7 bit-packed with width 3 (spec: 10001000 11000110 11111010).
        assert_eq!(hybrid(&[10, 1], 1, 5).unwrap(), vec![1; 5]);
        let packed = [0b11, 0b1000_1000, 0b1100_0110, 0b1111_1010];
        assert_eq!(hybrid(&packed, 3, 8).unwrap(), (0..8).collect::<Vec<u32>>());
        // Fewer values wanted than a group holds; data that ends early.
        assert_eq!(hybrid(&packed, 3, 3).unwrap(), vec![0, 1, 2]);
        assert!(hybrid(&[10], 1, 5).is_err());
    }
}
