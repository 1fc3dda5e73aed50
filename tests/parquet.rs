//! Parquet inputs of `prepare` (`trainer::parquet`), on files that pyarrow (the writer behind the
//! datasets on the Hugging Face Hub) wrote: `tests/data/parquet`, made by
//! `tools/peers/parquet_fixtures.py` with every codec pyarrow offers but LZ4 and Brotli
//! (none, snappy, gzip, zstd), dictionary and plain encodings, data pages of versions 1 and 2,
//! row groups of 120 rows in pages of 512 bytes, null and empty texts and a second column.
//! Each reads back to the texts it holds; `prepare` makes of it the tokens the same texts make
//! as JSON Lines; bad files and columns are refused with errors naming the file.

mod common;

use std::path::{Path, PathBuf};

use common::scratch;
use trainer::parquet::TextColumn;
use trainer::prepare::{prepare, Plan};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/parquet")
}

fn files() -> Vec<PathBuf> {
    let mut all: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    all.sort();
    all
}

/// The `text` column the files hold, row by row (`None`: null).
fn expected() -> Vec<Option<String>> {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
        .unwrap()
}

fn read_all(path: &Path, column: &str) -> anyhow::Result<Vec<Option<String>>> {
    let c = TextColumn::open(path, column)?;
    let mut rows = Vec::new();
    for g in 0..c.row_groups() {
        rows.extend(c.read(g)?);
    }
    Ok(rows)
}

#[test]
fn every_layout_pyarrow_writes_reads_back() {
    let want = expected();
    assert!(want.iter().any(Option::is_none) && want.iter().any(|t| t.as_deref() == Some("")));
    let all = files();
    assert_eq!(all.len(), 16, "the fixture set: {all:?}");
    for f in &all {
        let c = TextColumn::open(f, "text").unwrap();
        assert_eq!(c.row_groups(), 3, "{}", f.display());
        assert_eq!(read_all(f, "text").unwrap(), want, "{}", f.display());
    }
}

/// `prepare`'s settings, with chunks small enough that each row group makes a shard.
fn plan(inputs: Vec<String>, out: &Path) -> Plan {
    Plan {
        chunk_bytes: 1_000,
        ..common::prepare_plan(inputs, out)
    }
}

fn tokens(dir: &Path, split: &str) -> Vec<i64> {
    common::shard_tokens(&common::shard_files(dir, split))
}

/// Null rows are no documents; every other row is one, as the same texts in a JSON Lines file.
#[test]
fn prepare_reads_a_parquet_file_as_the_same_json_lines() {
    let dir = scratch("parquet_prepare");
    let texts: Vec<String> = expected().into_iter().flatten().collect();
    let lines: Vec<String> = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }).to_string())
        .collect();
    let jsonl = dir.join("same.jsonl");
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let tok = common::bpe_with_eot(&texts.join("\n"));
    let from_json = prepare(
        &plan(vec![jsonl.to_str().unwrap().into()], &dir.join("json")),
        &tok,
    )
    .unwrap();
    let parquet = fixtures().join("snappy_dict_v1.parquet");
    let from_parquet = prepare(
        &plan(vec![parquet.to_str().unwrap().into()], &dir.join("parquet")),
        &tok,
    )
    .unwrap();
    assert_eq!(from_parquet.documents, texts.len());
    assert_eq!(
        (from_parquet.train_tokens, from_parquet.val_tokens),
        (from_json.train_tokens, from_json.val_tokens)
    );
    // Three row groups of about 1.6 kB compressed, above the chunk size: a shard each.
    assert_eq!(from_parquet.written, 3, "{from_parquet:?}");
    for split in ["train", "val"] {
        assert_eq!(
            tokens(&dir.join("parquet"), split),
            tokens(&dir.join("json"), split),
            "{split}"
        );
    }
}

fn assert_mentions(e: anyhow::Error, parts: &[&str]) {
    let text = format!("{e:#}");
    for p in parts {
        assert!(text.contains(p), "{p:?} not in: {text}");
    }
}

#[test]
fn bad_parquet_is_refused_naming_the_file() {
    let dir = scratch("parquet_bad");
    let good = fixtures().join("none_plain_v1.parquet");
    let bytes = std::fs::read(&good).unwrap();
    // No such column (the error lists the file's); a column that is not text.
    assert_mentions(
        TextColumn::open(&good, "body").unwrap_err(),
        &["none_plain_v1.parquet", "no column \"body\"", "id, text"],
    );
    assert_mentions(
        TextColumn::open(&good, "id").unwrap_err(),
        &["none_plain_v1.parquet", "64-bit integers"],
    );
    // Cut short: its footer is gone.
    let cut = dir.join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    assert_mentions(
        TextColumn::open(&cut, "text").unwrap_err(),
        &["cut.parquet", "PAR1"],
    );
    // Every byte between the magic and the footer overwritten: the pages do not decode.
    let footer = u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let mut damaged = bytes.clone();
    let end = bytes.len() - 8 - footer as usize;
    damaged[4..end].fill(0xff);
    let path = dir.join("damaged.parquet");
    std::fs::write(&path, &damaged).unwrap();
    assert_mentions(
        read_all(&path, "text").unwrap_err(),
        &["damaged.parquet", "row group 0", "\"text\""],
    );
    // prepare names the file too.
    let e = prepare(
        &plan(vec![path.to_str().unwrap().into()], &dir.join("out")),
        &common::bpe_with_eot("some text\nmore"),
    )
    .unwrap_err();
    assert_mentions(e, &["damaged.parquet"]);
}
