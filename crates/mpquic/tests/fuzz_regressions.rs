//! The binary's fuzz targets (`mpquic::harness`) outside the fuzzer: every input a target ever
//! crashed on (`fuzz/regressions/<target>/`) replayed, and the starting inputs checked to reach
//! past the parsers (a fuzzer that starts from inputs the parser rejects explores little).

use std::path::Path;

use mpquic::harness;

#[test]
fn every_kept_fuzz_finding_runs_clean() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions");
    for (target, run) in harness::ALL.iter() {
        let Ok(entries) = std::fs::read_dir(root.join(target)) else {
            continue;
        };
        for e in entries {
            let path = e.unwrap().path();
            println!("{target}: {}", path.display());
            run(&std::fs::read(&path).unwrap());
        }
    }
}

#[test]
fn harnesses_take_edge_inputs() {
    let inputs: [&[u8]; 5] = [
        &[],
        &[0],
        &[0xff; 64],
        b"GET / HTTP/1.1\r\n\r\n",
        &[4, 0, 2, b'{', b'}'],
    ];
    for (_, run) in harness::ALL.iter() {
        for input in inputs {
            run(input);
        }
    }
}

/// The seeds reach what they are for: configurations that load, requests that are answered
/// (200 with the token, 401 without it); with FUZZ_SEEDS_DIR set (`bench/fuzz.sh`) they are
/// written there, one directory per target.
#[test]
fn seeds_run_clean_and_are_written_on_request() {
    let seeds = harness::seeds();
    for (target, input) in &seeds {
        match *target {
            "config_file" => {
                let text = std::str::from_utf8(input).unwrap();
                let r = mpquic::config::Config::parse(text, Path::new("seed.yaml"));
                assert!(r.is_ok(), "{r:?}");
            }
            "control_http" => {
                let answer = String::from_utf8_lossy(&harness::control_answer(input)).to_string();
                let want = match input.starts_with(b"POST /reload") {
                    true => "HTTP/1.1 409",
                    false => "HTTP/1.1 200",
                };
                assert!(
                    answer.starts_with(want),
                    "{:?}: {answer}",
                    String::from_utf8_lossy(input)
                );
            }
            "dashboard_http" => {
                let answer = String::from_utf8_lossy(&harness::dashboard_answer(input)).to_string();
                let want = match input.windows(5).any(|w| w == b"wrong") {
                    true => "HTTP/1.1 401",
                    false => "HTTP/1.1 200",
                };
                assert!(
                    answer.starts_with(want),
                    "{:?}: {answer}",
                    String::from_utf8_lossy(input)
                );
            }
            _ => {}
        }
        let (_, run) = harness::ALL.iter().find(|(t, _)| t == target).unwrap();
        run(input);
    }
    mpquic_core::harness::write_seeds(&seeds);
}
