//! The binary's command line, without root: check-config on the seed-style files, and pki.

use std::path::PathBuf;
use std::process::Command;

fn mpquic() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mpquic"))
}

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/seed")
        .join(name)
}

fn check(path: &std::path::Path) -> (bool, String) {
    let out = mpquic().arg("check-config").arg(path).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn seed_files_pass_check_config() {
    for f in ["client.yaml", "client-failover.yaml", "server.yaml"] {
        let (ok, text) = check(&example(f));
        assert!(ok, "{f}: {text}");
        assert!(text.contains(": ok"), "{text}");
    }
}

#[test]
fn seed_stripe_files_pass_check_config_with_their_remarks() {
    // The client's `transport_mode: reliable` does not apply to stripe paths, and the server's
    // `stripe_parity_shards` has no effect (each client's FEC applies): both are said.
    for (f, remark) in [
        ("client-stripe.yaml", "datagram mode"),
        ("server-stripe.yaml", "stripe_parity_shards"),
    ] {
        let (ok, text) = check(&example(f));
        assert!(ok, "{f}: {text}");
        assert!(
            text.contains(": ok") && text.contains(remark),
            "{f}: {text}"
        );
    }
}

#[test]
fn misspelt_key_fails_with_line_and_hint() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example("client.yaml"))
        .unwrap()
        .replace("multipath_policy:", "multipath_polcy:");
    let path = dir.path().join("typo.yaml");
    std::fs::write(&path, text).unwrap();
    let (ok, out) = check(&path);
    assert!(!ok);
    assert!(
        out.contains("typo.yaml:5:1: unknown field `multipath_polcy`"),
        "{out}"
    );
    assert!(
        out.contains("hint: did you mean `multipath_policy`?"),
        "{out}"
    );
}

#[test]
fn pki_writes_ca_server_and_client_with_private_keys() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let run = |args: &[&str]| {
        let out = mpquic().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["pki", "init", "--dir", d]);
    run(&[
        "pki",
        "server",
        "--dir",
        d,
        "--name",
        "srv",
        "--san",
        "192.0.2.1",
        "--san",
        "vpn.example.net",
    ]);
    run(&["pki", "client", "--dir", d, "--name", "site1"]);
    for f in ["ca", "srv", "site1"] {
        assert!(dir.path().join(format!("{f}.crt")).exists());
        let mode = std::fs::metadata(dir.path().join(format!("{f}.key")))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}.key");
    }
    // A second init must not silently replace the CA; names cannot escape the directory.
    assert!(!mpquic()
        .args(["pki", "init", "--dir", d])
        .status()
        .unwrap()
        .success());
    assert!(!mpquic()
        .args(["pki", "client", "--dir", d, "--name", "../evil"])
        .status()
        .unwrap()
        .success());
}
