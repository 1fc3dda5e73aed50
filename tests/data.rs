//! Tokenizers, the train/validation split and the data windows.

use trainer::config::{Config, TokenizerKind};
use trainer::data::{split_point, window_starts, Dataset};
use trainer::rng::SplitMix64;
use trainer::{corpus, tokenizer};

fn shakespeare() -> Option<String> {
    let dir = std::env::var("SHARED_DATA").unwrap_or_else(|_| "../shared/data".into());
    let p = std::path::Path::new(&dir).join("tinyshakespeare.txt");
    let alt =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt");
    std::fs::read_to_string(&p)
        .or_else(|_| std::fs::read_to_string(alt))
        .ok()
}

#[test]
fn char_tokenizer_round_trips() {
    let text = "Hello, world!\n\n  Tabs\tand ünïcödé — fine.\n";
    let tok = tokenizer::char_level(text).unwrap();
    let ids = tokenizer::encode_corpus(&tok, text).unwrap();
    assert_eq!(ids.len(), text.chars().count());
    assert_eq!(tokenizer::decode(&tok, &ids).unwrap(), text);
    // Unseen characters map to <unk> (id 0) rather than failing.
    let unk = tokenizer::encode_corpus(&tok, "Z").unwrap();
    assert_eq!(unk, vec![0]);
}

#[test]
fn bpe_tokenizer_trains_and_round_trips() {
    let text = corpus::generate(1, 60_000);
    let tok = tokenizer::train_bpe(&text, 400).unwrap();
    assert!(tok.get_vocab_size(true) <= 400 && tok.get_vocab_size(true) > 256);
    let sample = &text[..5000];
    let ids = tokenizer::encode_corpus(&tok, sample).unwrap();
    assert!(
        ids.len() < sample.len() / 2,
        "BPE should compress: {} ids for {} bytes",
        ids.len(),
        sample.len()
    );
    assert_eq!(tokenizer::decode(&tok, &ids).unwrap(), sample);
    // Byte-level: text it never saw still round-trips.
    let other = "Völlig neue Wörter — 日本語 ✓\n";
    let ids = tokenizer::encode_corpus(&tok, other).unwrap();
    assert_eq!(tokenizer::decode(&tok, &ids).unwrap(), other);
}

#[test]
fn chunked_encoding_equals_whole_encoding() {
    let text = corpus::generate(3, 200_000);
    for tok in [
        tokenizer::char_level(&text).unwrap(),
        tokenizer::train_bpe(&text, 300).unwrap(),
    ] {
        let whole = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(tokenizer::encode_corpus(&tok, &text).unwrap(), whole);
    }
}

#[test]
fn saved_tokenizer_loads_back() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tok_save");
    std::fs::create_dir_all(&dir).unwrap();
    let text = corpus::generate(2, 20_000);
    let tok = tokenizer::char_level(&text).unwrap();
    let p = dir.join("tokenizer.json");
    tokenizer::save(&tok, &p).unwrap();
    let back = tokenizer::load(&p).unwrap();
    assert_eq!(
        tokenizer::encode_corpus(&back, &text).unwrap(),
        tokenizer::encode_corpus(&tok, &text).unwrap()
    );
}

#[test]
fn embedded_corpus_has_structure_below_unigram_entropy() {
    let text = corpus::generate(trainer::data::EMBEDDED_CORPUS_SEED, 100_000);
    let mut counts = std::collections::HashMap::new();
    for c in text.chars() {
        *counts.entry(c).or_insert(0usize) += 1;
    }
    let n = text.chars().count() as f64;
    let h: f64 = counts
        .values()
        .map(|&k| -(k as f64 / n) * (k as f64 / n).ln())
        .sum();
    assert!(h > 2.5 && h < 3.5, "unigram entropy {h} nats");
    // Repeated words: the 16 subjects occur over and over.
    let n = text.to_lowercase().matches("the old king").count();
    assert!(n > 50, "\"the old king\" occurs {n} times");
}

#[test]
fn split_is_90_10_and_windows_stay_inside() {
    let mut cfg = Config::default();
    cfg.data.embedded_chars = 50_000;
    cfg.model.context = 32;
    let ds = Dataset::build(&cfg, None).unwrap();
    let total = (ds.train.len() + ds.val.len()) as f64;
    assert!((ds.val.len() as f64 / total - 0.1).abs() < 0.01);
    // Windows: in range, deterministic per index, different between indices.
    let a = window_starts(SplitMix64::for_stream(5, 1, 10), ds.train.len(), 64, 32);
    let b = window_starts(SplitMix64::for_stream(5, 1, 10), ds.train.len(), 64, 32);
    let c = window_starts(SplitMix64::for_stream(5, 1, 11), ds.train.len(), 64, 32);
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.iter().all(|&s| s + 32 < ds.train.len()));
    // At the edge: a stream of exactly context + 1 tokens has one window, starting at 0; one token
    // more allows starts 0 and 1, and both occur.
    assert!(window_starts(SplitMix64::new(1), 33, 1000, 32)
        .iter()
        .all(|&s| s == 0));
    let two = window_starts(SplitMix64::new(2), 34, 1000, 32);
    assert!(two.iter().all(|&s| s <= 1) && two.contains(&0) && two.contains(&1));
    // Targets are the inputs shifted by one token.
    let dev = burn::backend::ndarray::NdArrayDevice::Cpu;
    let (x, y) = ds.train_batch::<burn::backend::NdArray>(5, 0, 4, 32, &dev);
    let x: Vec<i64> = x.into_data().convert::<i64>().into_vec().unwrap();
    let y: Vec<i64> = y.into_data().convert::<i64>().into_vec().unwrap();
    for row in 0..4 {
        assert_eq!(
            &x[row * 32 + 1..(row + 1) * 32],
            &y[row * 32..(row + 1) * 32 - 1]
        );
    }
    assert_eq!(split_point("abcdefghij", 0.1), 9);
}

#[test]
fn char_vocabulary_is_the_distinct_characters_plus_unk() {
    // The 65 characters of tinyshakespeare (nanoGPT's shakespeare_char vocabulary), each used.
    const CHARS: &str = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    assert_eq!(CHARS.chars().count(), 65);
    let text: String = CHARS.repeat(40);
    check_char_dataset(&text, 66);
    // The real file too, where it is available (SHARED_DATA): the same 65 characters.
    if let Some(text) = shakespeare() {
        check_char_dataset(&text, 66);
    }
}

/// A file with `text`, read with the char tokenizer: `vocab` entries (the distinct characters plus
/// <unk>), and every character in the train or the validation split.
fn check_char_dataset(text: &str, vocab: usize) {
    let tok = tokenizer::char_level(text).unwrap();
    assert_eq!(tok.get_vocab_size(true), vocab);
    let path = std::env::temp_dir().join(format!(
        "burnmix-chars-{}-{}.txt",
        std::process::id(),
        text.len()
    ));
    std::fs::write(&path, text).unwrap();
    let mut cfg = Config::default();
    cfg.data.source = trainer::config::TextSource::File;
    cfg.data.tokenizer = TokenizerKind::Char;
    cfg.data.path = path.to_string_lossy().into_owned();
    let ds = Dataset::build(&cfg, None).unwrap();
    assert_eq!(ds.train.len() + ds.val.len(), text.chars().count());
    let _ = std::fs::remove_file(&path);
}

#[test]
fn ranks_read_disjoint_rows_that_make_up_the_doubled_batch() {
    let mut cfg = Config::default();
    cfg.data.embedded_chars = 20_000;
    cfg.model.context = 16;
    let ds = Dataset::build(&cfg, None).unwrap();
    let dev = burn::backend::ndarray::NdArrayDevice::Cpu;
    type Cpu = burn::backend::NdArray;
    let ints = |t: burn::tensor::Tensor<Cpu, 2, burn::tensor::Int>| -> Vec<i64> {
        t.into_data().convert::<i64>().into_vec().unwrap()
    };
    for (ranks, batch) in [(2, 3), (3, 1), (4, 5)] {
        for index in [0, 7] {
            // One GPU with the whole batch...
            let (x, y) = ds.train_batch::<Cpu>(9, index, ranks * batch, 16, &dev);
            let (x, y) = (ints(x), ints(y));
            // ...reads what the ranks read together, rank 0's rows first.
            let (mut xs, mut ys) = (Vec::new(), Vec::new());
            for r in 0..ranks {
                let rows = trainer::parallel::rows(r, batch);
                assert_eq!(rows.len(), batch);
                let (xr, yr) = ds.train_batch_rows::<Cpu>(9, index, ranks * batch, rows, 16, &dev);
                assert_eq!(xr.dims(), [batch, 16]);
                xs.extend(ints(xr));
                ys.extend(ints(yr));
            }
            assert_eq!(xs, x, "{ranks} ranks of {batch}, micro-batch {index}");
            assert_eq!(ys, y);
        }
    }
    // The ranks' rows are disjoint and cover the global batch.
    let all: Vec<usize> = (0..4).flat_map(|r| trainer::parallel::rows(r, 5)).collect();
    assert_eq!(all, (0..20).collect::<Vec<_>>());
}

#[test]
fn zero_partition_balances_the_ranks_and_depends_only_on_the_sizes() {
    use trainer::parallel::zero::partition;
    // GPT-2 small's shapes: the embedding, then per layer qkv, out, up, down and two gains.
    let mut sizes = vec![50304 * 768];
    for _ in 0..12 {
        sizes.extend([768 * 2304, 768 * 768, 768 * 3072, 3072 * 768, 768, 768]);
    }
    sizes.push(768);
    let total: usize = sizes.iter().sum();
    for ranks in 1..=8 {
        let owner = partition(&sizes, ranks);
        assert_eq!(owner, partition(&sizes, ranks), "the same on every call");
        assert!(owner.iter().all(|r| *r < ranks));
        let mut load = vec![0usize; ranks];
        for (i, r) in owner.iter().enumerate() {
            load[*r] += sizes[i];
        }
        // Greedy largest-first: no rank exceeds the even share by more than the largest
        // parameter (the embedding, alone on its rank when there are several).
        let even = total / ranks;
        let largest = *sizes.iter().max().unwrap();
        assert!(
            load.iter().all(|l| *l <= even + largest),
            "{ranks}: {load:?}"
        );
        if ranks == 2 {
            let (lo, hi) = (load[0].min(load[1]), load[0].max(load[1]));
            assert!(((hi - lo) as f64) < 0.01 * total as f64, "{load:?}");
        }
    }
    // Every rank owns something when there are enough parameters.
    let owner = partition(&[5, 4, 3, 2, 1], 3);
    assert_eq!(owner, vec![0, 1, 2, 2, 1]);
    assert!(partition(&[], 4).is_empty());
}
