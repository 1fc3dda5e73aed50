//! A stop asked for while a run trains (what SIGINT and SIGTERM do, through `trainer::stop`): the
//! run ends at a step boundary with that step's checkpoint and every finished step logged once.
//! Its own test binary, since the request cannot be taken back.

mod common;

use std::time::{Duration, Instant};

use common::{opts, read_metrics, scratch, tiny_config};
use trainer::checkpoint;

#[test]
fn a_stop_asked_for_mid_run_ends_at_a_step_with_its_checkpoint() {
    let dir = scratch("stop_mid_run");
    let steps = 400;
    let mut cfg = tiny_config(steps);
    cfg.training.checkpoint_interval = 0;
    // Most steps are read one step late: the stop shows in a late read and is taken a step on.
    assert!(cfg.training.read_back_late);
    let metrics = dir.join("metrics.jsonl");
    let asker = std::thread::spawn(move || {
        let started = Instant::now();
        while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 5 {
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "no 5 steps in 5 minutes"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        trainer::stop::request();
    });
    let s = trainer::run(&cfg, &common::selected(), &opts(dir.clone(), false)).unwrap();
    asker.join().unwrap();
    let logged: Vec<u64> = read_metrics(&dir).iter().map(|r| r.step).collect();
    let last = s.steps;
    assert!(
        last >= 5 && last < steps as u64,
        "stopped after {last} steps"
    );
    assert!(
        s.steps_read_late >= 3,
        "{} steps read late",
        s.steps_read_late
    );
    assert_eq!(logged, (1..=last).collect::<Vec<_>>());
    let ckpt = dir.join("checkpoints").join(checkpoint::file_name(last));
    assert!(ckpt.exists(), "{} missing", ckpt.display());
    let (header, _) = checkpoint::read(&ckpt).unwrap();
    assert_eq!(header.optimizer_step, last);
}
