//! Running the binaries as a user would, for the command-line tests: with a time bound (a hang
//! is a failure, not a stuck test run), bytes on stdin, and temporary model directories.
#![allow(dead_code)]

use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub struct Run {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Killed at the time limit.
    pub timed_out: bool,
    pub elapsed: Duration,
}

impl Run {
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The signal that ended the process, if one did.
    pub fn signal(&self) -> Option<i32> {
        std::os::unix::process::ExitStatusExt::signal(&self.status)
    }
}

/// Runs `exe` with `args`, `stdin` as its input (empty when `None`), killing it after `limit`.
pub fn run(exe: &str, args: &[OsString], stdin: Option<&[u8]>, limit: Duration) -> Run {
    run_with(
        Command::new(exe)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        stdin,
        limit,
    )
}

/// [`run`] for a prepared command: what it sends to pipes is captured.
pub fn run_with(cmd: &mut Command, stdin: Option<&[u8]>, limit: Duration) -> Run {
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let input = stdin.unwrap_or_default().to_vec();
    let mut child_in = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = child_in.write_all(&input);
    });
    let reader = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = reader(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = reader(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = writer.join();
    Run {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        timed_out,
        elapsed: t0.elapsed(),
    }
}

/// `args` as OS strings.
pub fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("kiln-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies the files of fixture directory `name` into `dest` (created).
pub fn copy_fixture(name: &str, dest: &Path) {
    std::fs::create_dir_all(dest).unwrap();
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dest.join(e.file_name())).unwrap();
        }
    }
}

/// Rewrites one top-level field of the JSON file at `path`.
pub fn set_json_field(path: &Path, key: &str, value: serde_json::Value) {
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// The byte offset of the value of metadata key `key` in GGUF `bytes`, and its type code
/// (GGUF v2/v3: magic, version, tensor count, metadata count, then key/type/value records).
pub fn gguf_value_offset(bytes: &[u8], key: &str) -> Option<(usize, u32)> {
    let u32_at = |p: usize| u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(bytes[p..p + 8].try_into().unwrap()) as usize;
    assert_eq!(&bytes[..4], b"GGUF");
    let count = u64_at(16);
    let mut p = 24;
    // Size of a value of `ty` at `p`.
    fn size(bytes: &[u8], ty: u32, p: usize) -> usize {
        let u32_at = |p: usize| u32::from_le_bytes(bytes[p..p + 4].try_into().unwrap());
        let u64_at = |p: usize| u64::from_le_bytes(bytes[p..p + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => 8 + u64_at(p),
            9 => {
                let (elem, n) = (u32_at(p), u64_at(p + 4));
                let mut q = p + 12;
                for _ in 0..n {
                    q += size(bytes, elem, q);
                }
                q - p
            }
            t => panic!("GGUF value type {t}"),
        }
    }
    for _ in 0..count {
        let len = u64_at(p);
        let name = &bytes[p + 8..p + 8 + len];
        p += 8 + len;
        let ty = u32_at(p);
        p += 4;
        if name == key.as_bytes() {
            return Some((p, ty));
        }
        p += size(bytes, ty, p);
    }
    None
}
