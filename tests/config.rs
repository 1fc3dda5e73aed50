//! Config parsing: defaults, overrides, and errors that name the key.

use trainer::config::{Config, DEFAULT_TOML};

fn err(text: &str, sets: &[&str]) -> String {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    format!(
        "{:#}",
        Config::from_toml_str(text, &sets, "test.toml").unwrap_err()
    )
}

#[test]
fn builtin_default_matches_the_struct_defaults() {
    // configs/default.toml spells out every key; it must equal the defaults of the structs, so a
    // config that leaves a key out gets what the default file documents.
    assert_eq!(Config::builtin(), Config::default());
    let empty = Config::from_toml_str("", &[], "empty").unwrap();
    assert_eq!(empty, Config::default());
}

#[test]
fn shipped_configs_parse() {
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        }
    }
}

#[test]
fn resolved_config_round_trips() {
    let cfg = Config::from_toml_str(
        DEFAULT_TOML,
        &["model.mlp=gelu".into(), "training.steps=7".into()],
        "x",
    )
    .unwrap();
    let again = Config::from_toml_str(&cfg.to_toml(), &[], "resolved").unwrap();
    assert_eq!(cfg, again);
    assert_eq!(again.training.steps, 7);
    assert_eq!(again.model.mlp, model::MlpKind::Gelu);
}

#[test]
fn gelu_tanh_is_an_mlp_kind() {
    let cfg = Config::from_toml_str(DEFAULT_TOML, &["model.mlp=gelu_tanh".into()], "x").unwrap();
    assert_eq!(cfg.model.mlp, model::MlpKind::GeluTanh);
    let again = Config::from_toml_str(&cfg.to_toml(), &[], "resolved").unwrap();
    assert_eq!(again.model.mlp, model::MlpKind::GeluTanh);
}

#[test]
fn overrides_take_toml_values_and_bare_strings() {
    let cfg = Config::from_toml_str(
        "",
        &[
            "optimizer.lr=1e-4".into(),
            "schedule.min_lr=1e-5".into(),
            "device=wgpu".into(),
            "model.bias=true".into(),
        ],
        "x",
    )
    .unwrap();
    assert_eq!(cfg.optimizer.lr, 1e-4);
    assert_eq!(cfg.device, trainer::config::DeviceKind::Wgpu);
    assert!(cfg.model.bias);
}

#[test]
fn unknown_key_is_named() {
    let e = err("[model]\nn_layers = 4\n", &[]);
    assert!(e.contains("n_layers") && e.contains("n_layer"), "{e}");
    let e = err("", &["trainig.steps=3"]);
    assert!(e.contains("trainig"), "{e}");
}

#[test]
fn wrong_type_is_named() {
    let e = err("[training]\nsteps = \"many\"\n", &[]);
    assert!(e.contains("training.steps"), "{e}");
    let e = err("", &["model.mlp=relu"]);
    assert!(e.contains("model.mlp") && e.contains("swiglu"), "{e}");
}

#[test]
fn impossible_values_are_explained() {
    let e = err("[model]\nd_model = 100\nn_head = 3\n", &[]);
    assert!(
        e.contains("model.n_head") && e.contains("model.d_model"),
        "{e}"
    );
    let e = err("", &["training.batch_size=0"]);
    assert!(e.contains("training.batch_size"), "{e}");
    let e = err("", &["data.source=file"]);
    assert!(e.contains("data.path"), "{e}");
    let e = err("", &["data.source=shards"]);
    assert!(e.contains("data.path") && e.contains("shards"), "{e}");
    let e = err("", &["data.source=shards", "data.path=\"x/*.bin\""]);
    assert!(e.contains("data.val_path"), "{e}");
    let e = err(
        "",
        &[
            "data.source=shards",
            "data.path=\"x/*.bin\"",
            "data.val_path=\"y.bin\"",
        ],
    );
    assert!(e.contains("data.tokenizer_path"), "{e}");
    let e = err("", &["schedule.min_lr=1.0"]);
    assert!(e.contains("schedule.min_lr"), "{e}");
    let e = err("", &["data.val_fraction=0.9"]);
    assert!(e.contains("data.val_fraction"), "{e}");
    let e = err("", &["nonsense"]);
    assert!(e.contains("key=value"), "{e}");
    let e = err(
        "",
        &[
            "model.recompute=\"selective\"",
            "model.kernels=\"reference\"",
        ],
    );
    assert!(
        e.contains("model.recompute = \"selective\"") && e.contains("model.kernels"),
        "{e}"
    );
}

#[test]
fn training_devices_takes_a_count_all_or_indices() {
    use trainer::config::Devices;
    let parse = |v: &str| {
        Config::from_toml_str("", &[format!("training.devices={v}")], "x")
            .unwrap()
            .training
            .devices
    };
    assert_eq!(parse("1"), Devices::Count(1));
    assert_eq!(parse("2"), Devices::Count(2));
    assert_eq!(parse("all"), Devices::All);
    assert_eq!(parse("[0, 2]"), Devices::List(vec![0, 2]));
    // Written back as it was given.
    for v in ["2", "\"all\"", "[1, 3]"] {
        let cfg = Config::from_toml_str("", &[format!("training.devices={v}")], "x").unwrap();
        let again = Config::from_toml_str(&cfg.to_toml(), &[], "again").unwrap();
        assert_eq!(cfg.training.devices, again.training.devices);
    }
    // Tokens per step count every GPU.
    let two = Config::from_toml_str("", &["training.devices=2".into()], "x").unwrap();
    assert_eq!(two.tokens_per_step(), 2 * two.tokens_per_step_per_device());
    for (bad, want) in [
        ("0", "at least 1"),
        ("[]", "at least one GPU index"),
        ("[0, 1, 0]", "GPU 0 twice"),
        ("some", "\"all\""),
        ("-1", "got -1"),
        ("1.5", "a number of GPUs"),
    ] {
        let e = err("", &[&format!("training.devices={bad}")]);
        assert!(
            e.contains("training.devices") && e.contains(want),
            "{bad}: {e}"
        );
    }
    // The GPU list against the machine's.
    assert_eq!(Devices::All.indices(3).unwrap(), vec![0, 1, 2]);
    assert_eq!(Devices::Count(2).indices(3).unwrap(), vec![0, 1]);
    let e = Devices::Count(4).indices(2).unwrap_err();
    assert!(
        e.contains("training.devices = 4") && e.contains("2 CUDA GPUs"),
        "{e}"
    );
    let e = Devices::List(vec![0, 5]).indices(2).unwrap_err();
    assert!(e.contains("GPU 5") && e.contains("0 to 1"), "{e}");
    assert!(Devices::All.indices(0).unwrap_err().contains("no CUDA GPU"));
}

#[test]
fn training_zero_is_0_to_3_and_fits_the_runs_world() {
    let parse = |sets: &[&str]| {
        Config::from_toml_str(
            "",
            &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            "x",
        )
    };
    assert_eq!(parse(&[]).unwrap().training.zero, 0);
    let two = parse(&["training.devices=2", "training.zero=1", "precision=fp32"]).unwrap();
    assert_eq!(two.training.zero, 1);
    for precision in ["auto", "bf16", "fp16", "fp8"] {
        let p = format!("precision={precision}");
        let z = parse(&["training.devices=2", "training.zero=1", &p]);
        assert_eq!(z.map(|c| c.training.zero).ok(), Some(1), "{precision}");
    }
    let again = Config::from_toml_str(&two.to_toml(), &[], "again").unwrap();
    assert_eq!(again.training.zero, 1);
    let e = err("", &["training.devices=2", "training.zero=4"]);
    assert!(
        e.contains("training.zero") && e.contains("got 4") && e.contains("3 (ZeRO-3"),
        "{e}"
    );
    // The world decides the rest, once the run knows it.
    let zero = |z: &str| parse(&[&format!("training.zero={z}")]).unwrap();
    assert!(zero("1").check_zero(2, false).is_ok());
    assert!(zero("1").check_zero(4, true).is_ok());
    assert!(zero("2").check_zero(2, true).is_ok());
    assert!(zero("3").check_zero(3, true).is_ok());
    assert!(zero("0").check_zero(1, false).is_ok());
    for (z, world, processes, want) in [
        ("1", 1, false, "trains on one GPU"),
        ("2", 1, true, "trains on one GPU"),
        ("2", 2, false, "--nproc-per-node 2"),
        ("3", 1, true, "trains on one GPU"),
        ("3", 4, false, "--nproc-per-node 4"),
    ] {
        let e = zero(z).check_zero(world, processes).unwrap_err();
        assert!(
            e.contains(&format!("training.zero = {z}")) && e.contains(want),
            "zero {z}, world {world}, processes {processes}: {e}"
        );
    }
}

#[test]
fn several_devices_need_cuda() {
    use trainer::device::Selected;
    for v in ["2", "\"all\"", "[0]"] {
        let cfg = Config::from_toml_str(
            "precision = \"fp32\"\n",
            &[format!("training.devices={v}")],
            "x",
        )
        .unwrap();
        for device in [Selected::Wgpu, Selected::Cpu] {
            let e = format!("{:#}", cfg.resolve(&device).unwrap_err());
            assert!(
                e.contains("training.devices")
                    && e.contains("CUDA")
                    && e.contains("training.devices = 1"),
                "{v} on {device:?}: {e}"
            );
        }
    }
}

#[test]
fn auto_settings_resolve_per_device() {
    use model::{AttentionKind, GemmKind, KernelsKind};
    use trainer::config::PrecisionKind;
    use trainer::device::Selected;
    let cfg = Config::builtin();
    assert_eq!(cfg.precision, PrecisionKind::Auto);
    assert_eq!(cfg.model.kernels, KernelsKind::Auto);
    assert_eq!(cfg.model.attention, AttentionKind::Auto);
    assert_eq!(cfg.model.gemm, GemmKind::Auto);
    let cuda = Selected::Cuda {
        index: 0,
        name: "test".into(),
    };
    let table = [
        (
            &cuda,
            0.0,
            PrecisionKind::Bf16,
            KernelsKind::Fused,
            AttentionKind::Flash,
        ),
        (
            &cuda,
            0.2,
            PrecisionKind::Bf16,
            KernelsKind::Fused,
            AttentionKind::Flash,
        ),
        (
            &Selected::Wgpu,
            0.0,
            PrecisionKind::Fp32,
            KernelsKind::Fused,
            AttentionKind::Flash,
        ),
        (
            &Selected::Wgpu,
            0.1,
            PrecisionKind::Fp32,
            KernelsKind::Fused,
            AttentionKind::Flash,
        ),
        (
            &Selected::Cpu,
            0.0,
            PrecisionKind::Fp32,
            KernelsKind::Reference,
            AttentionKind::Plain,
        ),
    ];
    for (device, dropout, precision, kernels, attention) in table {
        let mut c = cfg.clone();
        c.model.dropout = dropout;
        let r = c.for_device(device);
        assert_eq!(
            (r.precision, r.model.kernels, r.model.attention),
            (precision, kernels, attention),
            "{} with dropout {dropout}",
            device.describe()
        );
        // gemm = "auto" is resolved per tensor by kernels::gemm, not here.
        assert_eq!(r.model.gemm, GemmKind::Auto);
    }
    // Explicit settings are kept on every device.
    let mut c = cfg.clone();
    c.precision = PrecisionKind::Fp16;
    c.model.kernels = KernelsKind::Reference;
    c.model.attention = AttentionKind::Plain;
    let r = c.for_device(&cuda);
    assert_eq!(
        (r.precision, r.model.kernels, r.model.attention),
        (
            PrecisionKind::Fp16,
            KernelsKind::Reference,
            AttentionKind::Plain
        )
    );
    // The model resolves its own config the same way (fused; flash, with dropout too).
    let mut m = cfg.model.clone();
    m.dropout = 0.2;
    assert_eq!(
        (m.resolved().kernels, m.resolved().attention),
        (KernelsKind::Fused, AttentionKind::Flash)
    );
}

#[test]
fn auto_precision_is_validated_as_bf16() {
    // Before the device is known, "auto" must accept what bf16 accepts (a fixed loss scale).
    let mut cfg = Config::builtin();
    cfg.loss_scale.mode = trainer::config::LossScaleMode::Static;
    cfg.validate()
        .expect("auto precision with a fixed loss scale validates as bf16 would");
}

#[test]
fn llama_presets_have_the_published_shapes() {
    // Parameter counts of the Hugging Face checkpoints of the shapes (embedding and head of
    // 128256 rows; Llama 3.2's heads are tied to the embedding, Llama 3 8B's is not); the small
    // preset has 32000 rows and an untied head.
    for (file, params) in [
        ("llama_125m", 124_668_672usize),
        ("llama_1b", 1_235_814_400),
        ("llama_3b", 3_212_749_824),
        ("llama_8b", 8_030_261_248),
    ] {
        let path = format!("{}/configs/{file}.toml", env!("CARGO_MANIFEST_DIR"));
        let cfg = Config::load(std::path::Path::new(&path), &[]).unwrap();
        assert_eq!(cfg.model.num_params(cfg.model.vocab_size), params, "{file}");
        assert!(
            cfg.model.kv_heads() < cfg.model.n_head,
            "{file}: grouped-query"
        );
    }
}

#[test]
fn grouped_query_heads_must_divide_the_query_heads() {
    let e = err("[model]\nn_head = 6\nd_model = 48\nn_kv_head = 4\n", &[]);
    assert!(
        e.contains("model.n_kv_head = 4") && e.contains("model.n_head = 6"),
        "{e}"
    );
    let cfg = Config::from_toml_str(
        "[model]\nn_head = 6\nd_model = 48\nn_kv_head = 2\n",
        &[],
        "x",
    )
    .unwrap();
    assert_eq!(cfg.model.qkv_width(), (6 + 2 * 2) * 8);
}

/// Full recomputation runs a block again and needs its dropout masks again, which only the
/// kernels' seeded masks give; selective recomputation runs nothing twice.
#[test]
fn recomputation_with_dropout_needs_seeded_masks_only_when_full() {
    use trainer::device::Selected;
    let with = |mode: &str| {
        Config::from_toml_str(
            "precision = \"fp32\"\n",
            &[
                format!("model.recompute=\"{mode}\""),
                "model.dropout=0.1".into(),
                "model.attention=\"plain\"".into(),
            ],
            "x",
        )
        .unwrap()
    };
    let e = format!("{:#}", with("full").resolve(&Selected::Wgpu).unwrap_err());
    assert!(
        e.contains("model.recompute = \"full\"") && e.contains("model.dropout"),
        "{e}"
    );
    with("selective").resolve(&Selected::Wgpu).unwrap();
}
