//! Thrift's compact protocol, read into a generic value tree: the encoding of Parquet's footer
//! and page headers. Fields are kept by their ids; [`Fields`] picks the ones a reader needs.

use anyhow::{bail, Result};

/// One decoded Thrift value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Bool(bool),
    /// Every integer width (byte, i16, i32, i64).
    Int(i64),
    Double(f64),
    Binary(Vec<u8>),
    List(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Struct(Fields),
}

/// A struct's fields, by id, in the order they came.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fields(pub Vec<(i16, Value)>);

impl Fields {
    pub fn get(&self, id: i16) -> Option<&Value> {
        self.0.iter().find(|(i, _)| *i == id).map(|(_, v)| v)
    }

    /// Integer field `id`, if present.
    pub fn int(&self, id: i16) -> Option<i64> {
        match self.get(id) {
            Some(Value::Int(i)) => Some(*i),
            _ => None,
        }
    }

    pub fn bool(&self, id: i16) -> Option<bool> {
        match self.get(id) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// String field `id` (UTF-8, lossy), if present.
    pub fn string(&self, id: i16) -> Option<String> {
        match self.get(id) {
            Some(Value::Binary(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    pub fn strukt(&self, id: i16) -> Option<&Fields> {
        match self.get(id) {
            Some(Value::Struct(f)) => Some(f),
            _ => None,
        }
    }

    /// List field `id` (empty if absent).
    pub fn list(&self, id: i16) -> &[Value] {
        match self.get(id) {
            Some(Value::List(l)) => l,
            _ => &[],
        }
    }
}

/// Element types of the compact protocol.
mod kind {
    pub const TRUE: u8 = 1;
    pub const FALSE: u8 = 2;
    pub const BYTE: u8 = 3;
    pub const I16: u8 = 4;
    pub const I32: u8 = 5;
    pub const I64: u8 = 6;
    pub const DOUBLE: u8 = 7;
    pub const BINARY: u8 = 8;
    pub const LIST: u8 = 9;
    pub const SET: u8 = 10;
    pub const MAP: u8 = 11;
    pub const STRUCT: u8 = 12;
}

/// Nesting deeper than this is refused (Parquet's metadata nests a few levels).
const MAX_DEPTH: usize = 64;

/// A reader over `bytes`; `pos` says how far it read.
pub struct Reader<'a> {
    bytes: &'a [u8],
    pub pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    fn byte(&mut self) -> Result<u8> {
        let Some(&b) = self.bytes.get(self.pos) else {
            bail!("Thrift data ends early (at byte {})", self.pos);
        };
        self.pos += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64> {
        let mut out = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                bail!("Thrift varint over 64 bits at byte {}", self.pos);
            }
            out |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(out);
            }
        }
        bail!("Thrift varint over 64 bits at byte {}", self.pos)
    }

    fn zigzag(&mut self) -> Result<i64> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn binary(&mut self) -> Result<Vec<u8>> {
        let len = self.varint()? as usize;
        let end = self.pos.checked_add(len).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            bail!(
                "Thrift binary of {len} bytes at byte {} runs past the data",
                self.pos
            );
        };
        let out = self.bytes[self.pos..end].to_vec();
        self.pos = end;
        Ok(out)
    }

    /// A struct (fields up to its stop byte).
    pub fn read_struct(&mut self) -> Result<Fields> {
        self.strukt(0)
    }

    fn strukt(&mut self, depth: usize) -> Result<Fields> {
        if depth > MAX_DEPTH {
            bail!("Thrift structs nested over {MAX_DEPTH} deep");
        }
        let mut fields = Vec::new();
        let mut last = 0i16;
        loop {
            let head = self.byte()?;
            if head == 0 {
                return Ok(Fields(fields));
            }
            let delta = head >> 4;
            let id = if delta == 0 {
                self.zigzag()? as i16
            } else {
                last + i16::from(delta)
            };
            last = id;
            let value = match head & 0x0f {
                kind::TRUE => Value::Bool(true),
                kind::FALSE => Value::Bool(false),
                k => self.value(k, depth)?,
            };
            fields.push((id, value));
        }
    }

    fn value(&mut self, k: u8, depth: usize) -> Result<Value> {
        Ok(match k {
            kind::TRUE | kind::FALSE => Value::Bool(self.byte()? == kind::TRUE),
            kind::BYTE => Value::Int(i64::from(self.byte()? as i8)),
            kind::I16 | kind::I32 | kind::I64 => Value::Int(self.zigzag()?),
            kind::DOUBLE => {
                let mut b = [0u8; 8];
                for x in &mut b {
                    *x = self.byte()?;
                }
                Value::Double(f64::from_le_bytes(b))
            }
            kind::BINARY => Value::Binary(self.binary()?),
            kind::LIST | kind::SET => {
                let head = self.byte()?;
                let n = match head >> 4 {
                    15 => self.varint()? as usize,
                    n => n as usize,
                };
                self.check_count(n)?;
                let k = head & 0x0f;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(k, depth + 1)?);
                }
                Value::List(items)
            }
            kind::MAP => {
                let n = self.varint()? as usize;
                self.check_count(n)?;
                let mut items = Vec::with_capacity(n);
                if n > 0 {
                    let kinds = self.byte()?;
                    for _ in 0..n {
                        let key = self.value(kinds >> 4, depth + 1)?;
                        items.push((key, self.value(kinds & 0x0f, depth + 1)?));
                    }
                }
                Value::Map(items)
            }
            kind::STRUCT => Value::Struct(self.strukt(depth + 1)?),
            other => bail!(
                "unknown Thrift type {other} at byte {} (damaged metadata?)",
                self.pos
            ),
        })
    }

    /// Every element takes at least one byte: a count beyond the bytes left is damage.
    fn check_count(&self, n: usize) -> Result<()> {
        if n > self.bytes.len() - self.pos {
            bail!(
                "Thrift collection of {n} elements at byte {} in {} bytes (damaged metadata?)",
                self.pos,
                self.bytes.len()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fields with short and long id deltas, every scalar, a list, a nested struct.
    #[test]
    fn reads_the_compact_protocol() {
        let bytes = [
            0x15, 0x04, // field 1, i32: zigzag(2) = 4
            0x18, 0x02, b'h', b'i', // field 2, binary "hi"
            0x11, // field 3, bool true
            0x19, 0x25, 0x01, 0x05, // field 4, list of 2 i32: -1, -3 -> zigzag 1, 5
            0x0c, 0x28, // field 20 (long form: zigzag(20) = 40), struct
            0x16, 0x80, 0x01, // field 1, i64: zigzag 128 = 64
            0x00, // end of the inner struct
            0x00, // end of the outer struct
        ];
        let mut r = Reader::new(&bytes);
        let f = r.read_struct().unwrap();
        assert_eq!(r.pos, bytes.len());
        assert_eq!(f.int(1), Some(2));
        assert_eq!(f.string(2).as_deref(), Some("hi"));
        assert_eq!(f.bool(3), Some(true));
        assert_eq!(f.list(4), &[Value::Int(-1), Value::Int(-3)]);
        assert_eq!(f.strukt(20).unwrap().int(1), Some(64));
        assert!(Reader::new(&bytes[..7]).read_struct().is_err());
    }
}
