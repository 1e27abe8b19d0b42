//! Every scenario in bench/scenarios/ parses and validates (schema, link specs, schedules).

use std::path::PathBuf;

use mpquic_lab::scenario::{Scenario, TRACES};

#[test]
fn catalogue_is_valid() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/scenarios");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml") {
            // Recordings of real links live outside the repository; where they are absent a
            // scenario that replays them cannot be read (its error says which file).
            let text = std::fs::read_to_string(&p).unwrap();
            if text.contains(TRACES) && !Scenario::traces_dir(&p).exists() {
                eprintln!("{}: recordings absent, not checked", p.display());
                continue;
            }
            let s = Scenario::load(&p).unwrap_or_else(|e| panic!("{e:#}"));
            assert!(!s.systems().is_empty(), "{}", p.display());
            n += 1;
        }
    }
    assert!(n >= 8, "catalogue has {n} scenarios");
}

#[test]
fn unknown_keys_are_located() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(&p, "name: x\npaths: [\"delay=1ms\"]\ntrafic: []\n").unwrap();
    let e = Scenario::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("bad.yaml:3:1") && e.contains("unknown field `trafic`"),
        "{e}"
    );
}
