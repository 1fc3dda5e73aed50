//! Token shards (`trainer::tokens`, `trainer::prepare`) on the CPU: `prepare` turns text and
//! JSON Lines into shards that decode back to the documents, split by document, the same shards
//! for the same inputs, and keeps finished shards when run again; llm.c's and nanoGPT's files
//! read as their tokens; a run on shards draws its windows from them and, stopped and resumed,
//! repeats the uninterrupted run's losses; bad input is refused with an error naming the file.

mod common;

use std::path::{Path, PathBuf};

use common::{
    bpe_with_eot as bpe, opts, prepare_plan as plan, read_metrics, scratch, shard_files,
    shard_tokens as tokens_of, tiny_config,
};
use trainer::config::{TextSource, TokenizerKind};
use trainer::prepare::{prepare, Prepared};
use trainer::tokens::{format, ShardSet};

/// Writes the generated corpus cut into `files` text files in `dir`, and returns its paragraphs.
fn corpus_files(dir: &Path, chars: usize, files: usize) -> Vec<String> {
    let text = trainer::corpus::generate(7, chars);
    let docs = trainer::prepare::paragraphs(&text);
    let per = docs.len().div_ceil(files);
    for (k, part) in docs.chunks(per).enumerate() {
        std::fs::write(dir.join(format!("part{k}.txt")), part.join("\n")).unwrap();
    }
    docs
}

fn total(files: &[PathBuf]) -> usize {
    ShardSet::open(files).unwrap().len()
}

/// The documents of a split: its tokens cut after each end-of-text token, decoded.
fn decoded_docs(tok: &tokenizers::Tokenizer, tokens: &[i64], eot: i64) -> Vec<String> {
    tokens
        .split_inclusive(|&t| t == eot)
        .map(|d| {
            assert_eq!(
                *d.last().unwrap(),
                eot,
                "every document ends with the end-of-text token"
            );
            let ids: Vec<u32> = d[..d.len() - 1].iter().map(|&t| t as u32).collect();
            tok.decode(&ids, false).unwrap()
        })
        .collect()
}

#[test]
fn prepare_round_trips_documents_and_keeps_finished_shards() {
    let dir = scratch("shards_prepare");
    // Six files, then two whose pieces of 8 kB make several shards each.
    let docs = corpus_files(&dir, 60_000, 6);
    let tok = bpe(&docs.join("\n"));
    let out = dir.join("out");
    let inputs = vec![dir.join("part*.txt").to_str().unwrap().to_string()];
    let done = prepare(&plan(inputs.clone(), &out), &tok).unwrap();
    assert_eq!(done.documents, docs.len());
    assert!(done.written >= 2, "several shards: {done:?}");
    let (train, val) = (shard_files(&out, "train"), shard_files(&out, "val"));
    assert_eq!(train.len(), done.written);

    // Every document decodes back, in its split, in order: every fifth to validation.
    let eot = trainer::prepare::eot_id(&tok, "<|endoftext|>").unwrap() as i64;
    let (train_tokens, val_tokens) = (tokens_of(&train), tokens_of(&val));
    assert_eq!(
        (train_tokens.len(), val_tokens.len()),
        (done.train_tokens, done.val_tokens)
    );
    let want_val: Vec<&String> = docs.iter().skip(4).step_by(5).collect();
    let want_train: Vec<&String> = docs
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 5 != 4)
        .map(|(_, d)| d)
        .collect();
    let got_train = decoded_docs(&tok, &train_tokens, eot);
    let got_val = decoded_docs(&tok, &val_tokens, eot);
    assert_eq!(got_train.len(), want_train.len());
    assert_eq!(got_val.len(), want_val.len());
    for (got, want) in got_train
        .iter()
        .zip(&want_train)
        .chain(got_val.iter().zip(&want_val))
    {
        assert_eq!(got.trim(), want.trim());
    }

    // The same inputs give the same shards; a run started again keeps the finished ones.
    let again = dir.join("again");
    prepare(&plan(inputs.clone(), &again), &tok).unwrap();
    for f in train.iter().chain(&val) {
        let other = again.join(f.file_name().unwrap());
        assert_eq!(
            std::fs::read(f).unwrap(),
            std::fs::read(other).unwrap(),
            "{}",
            f.display()
        );
    }
    let last = train.last().unwrap();
    let kept = std::fs::read(last).unwrap();
    std::fs::remove_file(last).unwrap();
    let resumed: Prepared = prepare(&plan(inputs, &out), &tok).unwrap();
    assert_eq!((resumed.skipped, resumed.written), (train.len() - 1, 1));
    assert_eq!(std::fs::read(last).unwrap(), kept);

    // Other settings into the same directory are refused, naming the setting; so are .bin files
    // that no prepare.json describes.
    let mut other = plan(vec![dir.join("part*.txt").to_str().unwrap().into()], &out);
    other.chunk_bytes = 30_000;
    assert_mentions(
        prepare(&other, &tok).expect_err("refused"),
        &["chunk_bytes"],
    );
    let stray = dir.join("stray");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::write(stray.join("train.bin"), [0u8; 8]).unwrap();
    let into_stray = plan(vec![dir.join("part0.txt").to_str().unwrap().into()], &stray);
    assert_mentions(
        prepare(&into_stray, &tok).expect_err("refused"),
        &["no prepare.json"],
    );

    // Two large files cut into pieces at paragraph boundaries: the same documents, in order.
    let big = scratch("shards_prepare_big");
    let docs = corpus_files(&big, 60_000, 2);
    let mut cut = plan(
        vec![big.join("part*.txt").to_str().unwrap().into()],
        &big.join("out"),
    );
    cut.chunk_bytes = 8_000;
    let done = prepare(&cut, &tok).unwrap();
    assert!(done.written >= 6, "pieces of each file: {done:?}");
    let got = decoded_docs(
        &tok,
        &tokens_of(&shard_files(&big.join("out"), "train")),
        eot,
    );
    // The same files with Windows line ends (blank lines "\r\n") are cut into pieces too.
    let crlf = scratch("shards_prepare_crlf");
    for k in 0..2 {
        let text = std::fs::read_to_string(big.join(format!("part{k}.txt"))).unwrap();
        std::fs::write(
            crlf.join(format!("part{k}.txt")),
            text.replace('\n', "\r\n"),
        )
        .unwrap();
    }
    let mut cut = plan(
        vec![crlf.join("part*.txt").to_str().unwrap().into()],
        &crlf.join("out"),
    );
    cut.chunk_bytes = 8_000;
    let done_crlf = prepare(&cut, &tok).unwrap();
    assert_eq!(done_crlf.documents, docs.len());
    assert!(done_crlf.written >= 6, "pieces of each file: {done_crlf:?}");
    let want: Vec<&String> = docs
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 5 != 4)
        .map(|(_, d)| d)
        .collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.trim(), w.trim());
    }
}

#[test]
fn json_lines_documents_come_from_their_field() {
    let dir = scratch("shards_jsonl");
    let docs: Vec<String> = (0..40)
        .map(|i| format!("document {i} says \"hi\"\nover two lines"))
        .collect();
    let lines: Vec<String> = docs
        .iter()
        .map(|d| serde_json::json!({"id": 1, "text": d}).to_string())
        .collect();
    std::fs::write(dir.join("a.jsonl"), lines.join("\n")).unwrap();
    let tok = bpe(&docs.join("\n"));
    let out = dir.join("out");
    // Pieces of 500 bytes: the file's lines over several shards.
    let mut cut = plan(vec![dir.join("a.jsonl").to_str().unwrap().into()], &out);
    cut.chunk_bytes = 500;
    let done = prepare(&cut, &tok).unwrap();
    assert_eq!(done.documents, 40);
    assert!(done.written > 2, "{done:?}");
    let eot = trainer::prepare::eot_id(&tok, "<|endoftext|>").unwrap() as i64;
    let got = decoded_docs(&tok, &tokens_of(&shard_files(&out, "val")), eot);
    assert_eq!(
        got,
        docs.iter().skip(4).step_by(5).cloned().collect::<Vec<_>>()
    );
}

/// Writes `tokens` in llm.c's format (`u32` tokens: version 7, Llama 3's; else version 1).
fn llmc(path: &Path, tokens: &[u32], wide: bool) {
    let mut header = vec![0i32; 256];
    (header[0], header[1]) = if wide { (20240801, 7) } else { (20240520, 1) };
    header[2] = tokens.len() as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    for &t in tokens {
        if wide {
            bytes.extend_from_slice(&t.to_le_bytes());
        } else {
            bytes.extend_from_slice(&(t as u16).to_le_bytes());
        }
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn llmc_and_nanogpt_files_read_as_their_tokens() {
    let dir = scratch("shards_foreign");
    let tokens: Vec<u32> = (0..5000u32).map(|i| (i * 7919) % 50257).collect();
    let wide: Vec<u32> = tokens.iter().map(|t| t + 70_000).collect();
    let cases: Vec<(PathBuf, Vec<u32>)> = vec![
        (dir.join("fineweb_train_000001.bin"), tokens.clone()),
        (dir.join("llama_train_000001.bin"), wide.clone()),
        (dir.join("train.bin"), tokens.clone()),
    ];
    llmc(&cases[0].0, &tokens, false);
    llmc(&cases[1].0, &wide, true);
    let raw: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| (t as u16).to_le_bytes())
        .collect();
    std::fs::write(&cases[2].0, raw).unwrap();
    for (path, want) in &cases {
        let set = ShardSet::open(std::slice::from_ref(path)).unwrap();
        assert_eq!(set.len(), want.len(), "{}", path.display());
        let t = trainer::tokens::Tokens::Mapped(set);
        let mut got = Vec::new();
        t.extend_window(100, 1000, &mut got);
        let bound = *want.iter().max().unwrap() as usize + 1;
        let want: Vec<i64> = want[100..1100].iter().map(|&x| x as i64).collect();
        assert_eq!(got, want, "{}", path.display());
        assert_eq!(t.max_id_bound(), bound, "{}", path.display());
    }
    // A window across two shards reads on from the first into the second.
    let both = [cases[0].0.clone(), cases[2].0.clone()];
    let t = trainer::tokens::Tokens::Mapped(ShardSet::open(&both).unwrap());
    let mut got = Vec::new();
    t.extend_window(4990, 20, &mut got);
    let want: Vec<i64> = tokens[4990..]
        .iter()
        .chain(&tokens[..10])
        .map(|&x| x as i64)
        .collect();
    assert_eq!(got, want);
}

/// `error` (an `anyhow` chain) mentions every one of `parts`.
fn assert_mentions(error: anyhow::Error, parts: &[&str]) {
    let text = format!("{error:#}");
    for p in parts {
        assert!(text.contains(p), "{p:?} not in: {text}");
    }
}

#[test]
fn bad_input_is_refused_naming_the_file() {
    let dir = scratch("shards_bad");
    let open = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        ShardSet::open(&[p]).err().expect("refused")
    };
    assert_mentions(
        open("notes.txt", b"hello"),
        &["notes.txt", "not a token shard"],
    );
    assert_mentions(open("odd.bin", &[1, 2, 3]), &["odd.bin", "odd"]);
    let mut v2 = vec![0u8; 1024];
    v2[..4].copy_from_slice(&20240520i32.to_le_bytes());
    v2[4..8].copy_from_slice(&2i32.to_le_bytes());
    assert_mentions(open("v2.bin", &v2), &["v2.bin", "version 2"]);
    let short = dir.join("short_llmc.bin");
    llmc(&short, &[1, 2, 3, 4], false);
    let mut bytes = std::fs::read(&short).unwrap();
    bytes.truncate(bytes.len() - 2);
    assert_mentions(
        open("short_llmc.bin", &bytes),
        &["short_llmc.bin", "truncated"],
    );
    // Ours, cut short.
    let ours = dir.join("ours.bin");
    let info = format::ShardInfo {
        doc_starts: &[0],
        tokenizer_hash: [3; 32],
    };
    format::write(&ours, &[5, 6, 7, 8], 2, &info).unwrap();
    let mut bytes = std::fs::read(&ours).unwrap();
    bytes.truncate(bytes.len() - 3);
    assert_mentions(open("ours_cut.bin", &bytes), &["ours_cut.bin", "truncated"]);
    assert!(!dir.join("ours.partial").exists(), "no partial file left");

    // prepare: an empty input, a bad JSON line, a missing field.
    let tok = bpe("some text to train on\nand more text");
    let prep = |name: &str, content: &str| {
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        prepare(
            &plan(
                vec![p.to_str().unwrap().into()],
                &dir.join(format!("{name}.out")),
            ),
            &tok,
        )
        .expect_err("refused")
    };
    assert_mentions(prep("empty.txt", ""), &["no text"]);
    assert_mentions(
        prep("bad.jsonl", "{\"text\": \"a\"}\n{\"text\": oops}\n"),
        &["bad.jsonl:2", "JSON"],
    );
    assert_mentions(
        prep("nofield.jsonl", "{\"body\": \"a\"}\n"),
        &["nofield.jsonl:1", "\"text\""],
    );
    // A bad line in a later piece of a file is named by its line in the file.
    let lines: Vec<String> = (0..30)
        .map(|i| match i {
            24 => "{\"text\": nope}".to_string(),
            _ => format!("{{\"text\": \"line {i}\"}}"),
        })
        .collect();
    let p = dir.join("late.jsonl");
    std::fs::write(&p, lines.join("\n")).unwrap();
    let mut cut = plan(vec![p.to_str().unwrap().into()], &dir.join("late.out"));
    cut.chunk_bytes = 100;
    let err = prepare(&cut, &tok).expect_err("refused");
    assert_mentions(err, &["late.jsonl:25"]);
}

/// A config that trains on the shards in `dir`, made with the tokenizer saved there.
fn shards_config(dir: &Path, steps: usize) -> trainer::Config {
    let mut cfg = tiny_config(steps);
    cfg.data.source = TextSource::Shards;
    cfg.data.path = dir.to_str().unwrap().into();
    cfg.data.tokenizer = TokenizerKind::File;
    cfg.data.tokenizer_path = dir.join("tokenizer.json").to_str().unwrap().into();
    cfg
}

#[test]
fn a_run_on_shards_reads_them_and_resumes_exactly() {
    let _guard = common::serial();
    let dir = scratch("shards_run");
    let docs = corpus_files(&dir, 40_000, 2);
    let tok = bpe(&docs.join("\n"));
    let out = dir.join("shards");
    prepare(
        &plan(vec![dir.join("part*.txt").to_str().unwrap().into()], &out),
        &tok,
    )
    .unwrap();

    // The batches are windows of the shards' tokens.
    let cfg = shards_config(&out, 8);
    let ds = trainer::data::Dataset::build(&cfg, None).unwrap();
    let train = shard_files(&out, "train");
    assert_eq!(ds.train.len(), total(&train));
    let all = tokens_of(&train);
    let device = burn::backend::ndarray::NdArrayDevice::Cpu;
    let (x, y) = ds.train_batch::<burn::backend::NdArray>(cfg.seed, 3, 4, 16, &device);
    let starts = trainer::data::window_starts(
        trainer::rng::SplitMix64::for_stream(cfg.seed, 1, 3),
        ds.train.len(),
        4,
        16,
    );
    let x: Vec<i64> = x.into_data().convert::<i64>().into_vec().unwrap();
    let y: Vec<i64> = y.into_data().convert::<i64>().into_vec().unwrap();
    for (r, s) in starts.iter().enumerate() {
        assert_eq!(x[r * 16..(r + 1) * 16], all[*s..s + 16]);
        assert_eq!(y[r * 16..(r + 1) * 16], all[s + 1..s + 17]);
    }

    // Shards of another tokenizer's ids (llm.c's, which record no tokenizer) are refused,
    // naming the shard and the id.
    let foreign = dir.join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    llmc(
        &foreign.join("x_train_000000.bin"),
        &[1, 2, 3, 50_000],
        false,
    );
    llmc(&foreign.join("x_val_000000.bin"), &[1, 2, 3], false);
    let mut wide = cfg.clone();
    wide.data.path = foreign.to_str().unwrap().into();
    let err = trainer::data::Dataset::build(&wide, None)
        .err()
        .expect("refused");
    assert_mentions(err, &["x_train_000000.bin", "token id 50000"]);

    // Another tokenizer is refused, naming the shard.
    let mut other = cfg.clone();
    let other_tok = dir.join("other.json");
    bpe("a different text\nfor another tokenizer")
        .save(&other_tok, false)
        .unwrap();
    other.data.tokenizer_path = other_tok.to_str().unwrap().into();
    let err = trainer::data::Dataset::build(&other, None)
        .err()
        .expect("refused");
    assert_mentions(err, &["train_00000.bin", "another tokenizer"]);

    // Stopped at step 4 and resumed: the uninterrupted run's losses.
    let full = scratch("shards_run_full");
    trainer::run(&cfg, &common::selected(), &opts(full.clone(), false)).unwrap();
    let split = scratch("shards_run_split");
    let mut first = opts(split.clone(), false);
    first.stop_at = Some(4);
    trainer::run(&cfg, &common::selected(), &first).unwrap();
    trainer::run(&cfg, &common::selected(), &opts(split.clone(), true)).unwrap();
    let (a, b) = (read_metrics(&full), read_metrics(&split));
    assert_eq!(a.len(), 8);
    assert_eq!(b.len(), 8);
    for (p, q) in a.iter().zip(&b) {
        assert_eq!(p.step, q.step);
        assert!(
            (p.loss - q.loss).abs() <= 1e-5 * p.loss.abs().max(1.0),
            "step {}: {} vs resumed {}",
            p.step,
            p.loss,
            q.loss
        );
    }
}
