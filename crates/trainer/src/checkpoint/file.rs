//! One checkpoint file's bytes: `b"BMXCKPT1" | header length: u64 LE | header: JSON | tensors: f32 LE
//! | CRC32 of all before: u32 LE`.
//!
//! Both directions stream: [`Writer`] takes the values in pieces (the caller reads each tensor
//! from the device a piece at a time, `crate::host_copy`) and [`read`] fills the value vector
//! straight from the file, so saving holds one piece on the host at a time and loading holds the
//! values once (a model of N parameters with its AdamW moments
//! is 12 N bytes: 1.5 GB for `gpt2_small`, 96 GB for 8B parameters).

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use super::{Header, ParamEntry, FORMAT_VERSION};

const MAGIC: &[u8; 8] = b"BMXCKPT1";

/// Values converted to bytes per write.
const CHUNK_VALUES: usize = 1 << 16;

/// Bytes read per call while loading.
const READ_BYTES: usize = 8 << 20;

/// Writes one checkpoint file: the header when created, then the tensors' values in header order
/// ([`Writer::values`]), then the checksum ([`Writer::finish`]).
pub(crate) struct Writer {
    out: BufWriter<File>,
    crc: crc32fast::Hasher,
    /// f32 values the header's entries list, and those still owed to them.
    total: usize,
    owed: usize,
}

impl Writer {
    /// Creates `path` (a temporary file: the caller renames it into place once finished) and
    /// writes the signature and `header`.
    pub(crate) fn create(path: &Path, header: &Header) -> Result<Self> {
        let file =
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let header_json = serde_json::to_vec(header).expect("a header serialises");
        let total = payload_values(header);
        let mut w = Self {
            out: BufWriter::with_capacity(READ_BYTES, file),
            crc: crc32fast::Hasher::new(),
            total,
            owed: total,
        };
        w.put(MAGIC)
            .and_then(|()| w.put(&(header_json.len() as u64).to_le_bytes()))
            .and_then(|()| w.put(&header_json))
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.crc.update(bytes);
        self.out.write_all(bytes)
    }

    /// Appends values (little-endian f32) to the payload.
    pub(crate) fn values(&mut self, values: &[f32]) -> io::Result<()> {
        if values.len() > self.owed {
            return Err(io::Error::other(format!(
                "{} values written past the {} the header lists",
                values.len() - self.owed,
                self.total
            )));
        }
        self.owed -= values.len();
        let mut bytes = Vec::with_capacity(CHUNK_VALUES.min(values.len()) * 4);
        for chunk in values.chunks(CHUNK_VALUES) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            self.put(&bytes)?;
        }
        Ok(())
    }

    /// Writes the checksum and flushes; fails when fewer values were written than the header
    /// lists.
    pub(crate) fn finish(mut self) -> io::Result<()> {
        if self.owed != 0 {
            return Err(io::Error::other(format!(
                "{} of the {} values the header lists were not written",
                self.owed, self.total
            )));
        }
        let crc = self.crc.clone().finalize();
        self.out.write_all(&crc.to_le_bytes())?;
        self.out.flush()
    }
}

/// The f32 values the payload of a checkpoint with this header holds.
fn payload_values(header: &Header) -> usize {
    header.params.iter().map(ParamEntry::stored_values).sum()
}

/// Writes a checkpoint of `header` and the whole payload `values` to `path` in one go.
pub(crate) fn write(path: &Path, header: &Header, values: &[f32]) -> Result<()> {
    let mut w = Writer::create(path, header)?;
    w.values(values)
        .and_then(|()| w.finish())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Reads and verifies one checkpoint file; returns its header and tensor payload. The checksum
/// is checked before the header is interpreted, so a damaged file is reported as damaged.
pub(crate) fn read(path: &Path) -> Result<(Header, Vec<f32>)> {
    let bad = |why: &str| anyhow!("checkpoint {} is damaged: {why}", path.display());
    let cannot = |e: io::Error| anyhow!("cannot read checkpoint {}: {e}", path.display());
    let mut file = File::open(path).map_err(cannot)?;
    let len = file.metadata().map_err(cannot)?.len() as usize;
    let mut start = [0u8; 16];
    if len < 8 + 8 + 4 || file.read_exact(&mut start).is_err() || &start[..8] != MAGIC {
        return Err(bad(
            "it does not start with the checkpoint signature (not a checkpoint, or truncated)",
        ));
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(&start);
    let body_len = len - 4;
    let hlen = u64::from_le_bytes(start[8..16].try_into().expect("8 bytes")) as usize;
    // What the header length claims is only trusted once the checksum matched: until then the
    // body is read as it lies, header bytes first, then whole f32 values, then any odd bytes.
    let header_end = 16usize.saturating_add(hlen).min(body_len);
    let mut header_json = vec![0u8; header_end - 16];
    file.read_exact(&mut header_json).map_err(cannot)?;
    crc.update(&header_json);
    let payload_len = body_len - header_end;
    let mut values = vec![0f32; payload_len / 4];
    let mut buf = vec![0u8; READ_BYTES.min(payload_len.max(4))];
    let mut filled = 0;
    while filled < values.len() {
        let n = (values.len() - filled).min(buf.len() / 4);
        let bytes = &mut buf[..n * 4];
        file.read_exact(bytes).map_err(cannot)?;
        crc.update(bytes);
        for (v, c) in values[filled..filled + n]
            .iter_mut()
            .zip(bytes.chunks_exact(4))
        {
            *v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        filled += n;
    }
    let mut tail = vec![0u8; payload_len % 4 + 4];
    file.read_exact(&mut tail).map_err(cannot)?;
    let (odd, stored) = tail.split_at(payload_len % 4);
    crc.update(odd);
    let stored = u32::from_le_bytes(stored.try_into().expect("4 bytes"));
    let actual = crc.finalize();
    if stored != actual {
        return Err(bad(&format!("checksum mismatch (stored {stored:08x}, computed {actual:08x}): the file was truncated or altered")));
    }
    if 16 + hlen > body_len {
        return Err(bad("header length runs past the end of the file"));
    }
    let header: Header = serde_json::from_slice(&header_json)
        .map_err(|e| bad(&format!("unreadable header: {e}")))?;
    if header.format_version != FORMAT_VERSION {
        bail!(
            "checkpoint {} has format version {}, this build reads version {FORMAT_VERSION}",
            path.display(),
            header.format_version
        );
    }
    if !payload_len.is_multiple_of(4) {
        return Err(bad("tensor payload is not a whole number of f32 values"));
    }
    let expected = payload_values(&header);
    if expected != values.len() {
        return Err(bad(&format!(
            "header lists {expected} values but the payload holds {}",
            values.len()
        )));
    }
    Ok((header, values))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn header(shapes: &[(&[usize], bool)]) -> Header {
        let cfg = Config::default();
        Header {
            format_version: FORMAT_VERSION,
            step: 7,
            seed: cfg.seed,
            batch_size: cfg.training.batch_size,
            grad_accum: cfg.training.grad_accum,
            data: cfg.data.clone(),
            model: cfg.model.clone(),
            vocab_size: 65,
            optimizer_step: 7,
            best_val_loss: Some(1.5),
            elapsed_s: 2.0,
            precision: None,
            loss_scaler: None,
            fp8_amax_history: None,
            devices: 1,
            replica_checksums: Vec::new(),
            shard: None,
            params: shapes
                .iter()
                .enumerate()
                .map(|(i, (shape, has_moments))| ParamEntry {
                    name: format!("p{i}"),
                    shape: shape.to_vec(),
                    has_moments: *has_moments,
                    rows: None,
                })
                .collect(),
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("burnmix-ckpt-file-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("c.ckpt")
    }

    fn message(r: Result<(Header, Vec<f32>)>) -> String {
        format!("{:#}", r.expect_err("the read must fail"))
    }

    #[test]
    fn values_written_in_pieces_read_back_exactly() {
        let path = scratch("round_trip");
        // More values than one conversion chunk, in pieces of awkward sizes.
        let h = header(&[(&[300, 257], true), (&[3], false)]);
        let values: Vec<f32> = (0..payload_values(&h))
            .map(|i| (i as f32).sin() * 1e3)
            .collect();
        let mut w = Writer::create(&path, &h).unwrap();
        for piece in values.chunks(CHUNK_VALUES + 13) {
            w.values(piece).unwrap();
        }
        w.finish().unwrap();
        let (back, read_values) = read(&path).unwrap();
        assert_eq!(back.params, h.params);
        assert_eq!(back.step, 7);
        assert_eq!(read_values, values);

        // The one-go writer gives the same bytes.
        let bytes = std::fs::read(&path).unwrap();
        write(&path, &h, &values).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_writer_refuses_more_or_fewer_values_than_the_header_lists() {
        let path = scratch("count");
        let h = header(&[(&[4, 2], false)]);
        let mut w = Writer::create(&path, &h).unwrap();
        let e = w.values(&[0.0; 9]).unwrap_err().to_string();
        assert!(e.contains("1 values written past the 8"), "{e}");
        w.values(&[0.0; 5]).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("3 of the 8 values"), "{e}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn damage_anywhere_is_reported_as_damage() {
        let path = scratch("damage");
        let h = header(&[(&[64, 3], true)]);
        let values = vec![0.25f32; payload_values(&h)];
        write(&path, &h, &values).unwrap();
        let good = std::fs::read(&path).unwrap();
        let hlen = u64::from_le_bytes(good[8..16].try_into().unwrap()) as usize;

        // A flipped bit in the header, the payload or the checksum itself.
        for i in [20, 16 + hlen + 5, good.len() - 1] {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let e = message(read(&path));
            assert!(
                e.contains("damaged") && e.contains("checksum"),
                "byte {i}: {e}"
            );
        }
        // Cut short, by a whole value or by an odd number of bytes, or to the signature alone.
        for keep in [good.len() - 4, good.len() - 3, 16 + hlen + 2, 10] {
            std::fs::write(&path, &good[..keep]).unwrap();
            let e = message(read(&path));
            assert!(e.contains("damaged"), "{keep} bytes: {e}");
        }
        // A header length past the end of the file, with a checksum that matches it.
        let mut lying = good[..16 + hlen].to_vec();
        lying[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let crc = crc32fast::hash(&lying);
        lying.extend_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &lying).unwrap();
        let e = message(read(&path));
        assert!(e.contains("header length runs past the end"), "{e}");
        // Not a checkpoint at all.
        std::fs::write(&path, b"{\"step\": 1}\n plain text, long enough").unwrap();
        let e = message(read(&path));
        assert!(e.contains("checkpoint signature"), "{e}");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_payload_that_disagrees_with_the_header_is_refused() {
        let path = scratch("disagree");
        let h = header(&[(&[5], false)]);
        // A valid file whose header lists 5 values but whose payload holds 6.
        let header_json = serde_json::to_vec(&h).unwrap();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&(header_json.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&header_json);
        bytes.extend(std::iter::repeat_n(0u8, 6 * 4));
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let e = message(read(&path));
        assert!(
            e.contains("header lists 5 values but the payload holds 6"),
            "{e}"
        );
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
