//! Every input a fuzz target ever crashed on (`fuzz/regressions/<target>/`), replayed through
//! the same harness (`mpquic_core::harness`) in the normal test suite, so a fixed crash stays
//! fixed without a nightly toolchain.

use std::path::Path;

#[test]
fn every_kept_fuzz_finding_runs_clean() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    let mut replayed = 0;
    for (target, harness) in mpquic_core::harness::ALL {
        let dir = root.join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            let input = std::fs::read(&path).unwrap();
            println!("{target}: {}", path.display());
            harness(&input);
            replayed += 1;
        }
    }
    assert!(
        replayed >= 1,
        "no regression inputs found under {}",
        root.display()
    );
}

/// The harnesses take any bytes, including none and a few records of each kind.
#[test]
fn harnesses_take_edge_inputs() {
    let inputs: [&[u8]; 4] = [
        &[],
        &[0],
        &[0xff; 64],
        &[0x02, 0x00, 0x05, 1, 2, 3, 4, 5, 0x06, 0x00, 0x00],
    ];
    for (_, harness) in mpquic_core::harness::ALL {
        for input in inputs {
            harness(input);
        }
    }
}

/// The fuzzers' starting inputs run clean too; with FUZZ_SEEDS_DIR set (`bench/fuzz.sh`),
/// they are written there, one directory per target.
#[test]
fn seeds_run_clean_and_are_written_on_request() {
    let seeds = mpquic_core::harness::seeds();
    for (target, input) in &seeds {
        let (_, harness) = (mpquic_core::harness::ALL.iter())
            .find(|(t, _)| t == target)
            .expect("a seed for a known target");
        harness(input);
    }
    mpquic_core::harness::write_seeds(&seeds);
}
