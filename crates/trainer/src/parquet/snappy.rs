//! Snappy's raw block format, decompressed (the default codec of Parquet files written by
//! pyarrow, and so of most datasets on the Hugging Face Hub).
//!
//! A block is the uncompressed length (varint), then elements: a literal (tag `00`, its length
//! in the tag or in the 1-4 bytes after it) or a copy of earlier output (tags `01`, `10`, `11`,
//! with 1-, 2- or 4-byte offsets; a copy may overlap its own output, repeating a pattern).

use anyhow::{bail, Result};

/// The decompressed block `src`.
pub fn decompress(src: &[u8]) -> Result<Vec<u8>> {
    let mut pos = 0;
    let mut len = 0usize;
    for shift in (0..35).step_by(7) {
        let Some(&b) = src.get(pos) else {
            bail!("snappy block ends inside its length");
        };
        pos += 1;
        len |= usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
    }
    // No element yields more than 64 bytes per input byte: a larger claim is damage.
    if len > src.len().saturating_mul(64) + 64 {
        bail!("snappy block claims {len} bytes from {} bytes", src.len());
    }
    let mut out = Vec::with_capacity(len);
    while pos < src.len() {
        let tag = src[pos];
        pos += 1;
        let take = |pos: &mut usize, n: usize| -> Result<usize> {
            let Some(b) = src.get(*pos..*pos + n) else {
                bail!("snappy block ends inside an element");
            };
            *pos += n;
            Ok(b.iter()
                .rev()
                .fold(0usize, |v, &x| (v << 8) | usize::from(x)))
        };
        let (n, offset) = match tag & 3 {
            0 => {
                let n = match tag >> 2 {
                    l @ 0..=59 => usize::from(l) + 1,
                    l => take(&mut pos, usize::from(l) - 59)? + 1,
                };
                let Some(lit) = src.get(pos..pos + n) else {
                    bail!("snappy literal of {n} bytes runs past the block");
                };
                out.extend_from_slice(lit);
                pos += n;
                continue;
            }
            1 => (
                4 + usize::from((tag >> 2) & 7),
                (usize::from(tag >> 5) << 8) | take(&mut pos, 1)?,
            ),
            2 => (usize::from(tag >> 2) + 1, take(&mut pos, 2)?),
            _ => (usize::from(tag >> 2) + 1, take(&mut pos, 4)?),
        };
        if offset == 0 || offset > out.len() {
            bail!(
                "snappy copy from {offset} bytes back with {} bytes written",
                out.len()
            );
        }
        let from = out.len() - offset;
        for i in 0..n {
            out.push(out[from + i]);
        }
    }
    if out.len() != len {
        bail!(
            "snappy block gave {} bytes where its header says {len}",
            out.len()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::decompress;

    /// Literals, an overlapping copy (a repeated pattern) and each copy tag.
    #[test]
    fn decompresses_literals_and_copies() {
        // "abcabcabcabc" + "xy" + "abcab": literal "abc", copy 9 from 3 back (tag 01),
        // literal "xy", copy 5 from 14 back (tag 10).
        let block = [
            19, // length
            0b0000_1000,
            b'a',
            b'b',
            b'c', // literal of 3
            0b0001_0101,
            3, // tag 01: 4 + 5 = 9 bytes, offset 3
            0b0000_0100,
            b'x',
            b'y', // literal of 2
            0b0001_0010,
            14,
            0, // tag 10: 4 + 1 = 5 bytes, offset 14
        ];
        assert_eq!(decompress(&block).unwrap(), b"abcabcabcabcxyabcab");
        // Tag 11 (4-byte offset) and a long literal (length in the next byte).
        let mut long = vec![70, 60 << 2, 63];
        long.extend((0..64u8).map(|i| b'a' + i % 26));
        long.extend([0b0001_0111, 64, 0, 0, 0]);
        let out = decompress(&long).unwrap();
        assert_eq!(out.len(), 70);
        assert_eq!(&out[64..], &out[..6]);
        // Damage: a copy from before the start, a short block.
        assert!(decompress(&[4, 0b0000_0101, 1]).is_err());
        assert!(decompress(&[5, 0b0000_1000, b'a']).is_err());
    }
}
