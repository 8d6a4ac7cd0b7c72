//! The CloudEvents Python SDK as a real client and a real consumer: the e2e tests send events
//! the way a user's code does and read dead letters the way a user's consumer does.
//!
//! The SDK lives in the Envoy venv (`make sdk`, pinned in the Makefile); the Makefile exports
//! its Python as `FANOUT_SDK_PYTHON`. Without it a test fails with a message that says how to
//! get it: a missing SDK is a failure, never a skip.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The Python that has the CloudEvents SDK.
pub fn sdk_python() -> PathBuf {
    let python = std::env::var_os("FANOUT_SDK_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        panic!("FANOUT_SDK_PYTHON is not set: run the e2e tests through `make test-e2e` (it installs the CloudEvents SDK with `make sdk`)")
    });
    assert!(
        python.exists(),
        "FANOUT_SDK_PYTHON={} does not exist: run `make sdk`",
        python.display()
    );
    python
}

/// Runs `script` (Python source) with the SDK's Python, `args` as `sys.argv[1..]` and `stdin`
/// on its standard input. Panics, with the script's stderr, unless it exits 0; returns its
/// standard output.
pub fn run_sdk(script: &str, args: &[&str], stdin: &[u8]) -> String {
    let python = sdk_python();
    let mut child = Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin).expect("write to the SDK script");
    drop(input);
    let out = child.wait_with_output().expect("wait for the SDK script");
    assert!(
        out.status.success(),
        "the SDK script failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
