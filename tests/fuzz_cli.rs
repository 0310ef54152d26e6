//! A fuzzer for the command line: `kiln`, `kiln chat`, `kiln-dump` and `kiln-bench` run with
//! argument vectors generated from a fixed seed — a valid command on the tiny `llama_tied`
//! fixture, then one to four hostile mutations: absurd, negative and malformed numbers, NaN and
//! infinity, empty and non-UTF-8 text, special files and odd paths as the model, missing values,
//! unknown, repeated and conflicting flags, hostile stdin for chat and `-f -`.
//!
//! Every run must exit 0, 1 (one error line) or 2 (a usage error) within [`LIMIT`]: never a
//! panic (101), a signal (an abort, a crash) or a hang.
//!
//! ```text
//! cargo test --release --test fuzz_cli                                   # 500 cases, seed 1
//! KILN_FUZZ_CLI_CASES=5000 KILN_FUZZ_CLI_SEED=7 cargo test --release --test fuzz_cli -- --nocapture
//! KILN_FUZZ_CLI_SHOW=1 ...   # also print every case's exit status and error line
//! ```
//!
//! The same mutator's `kiln` and `kiln chat` command lines also go, in-process and many more of
//! them, through `kiln::cli::kiln_args::parse_args` (what the binary runs before it loads a
//! model; the `cli_args` cargo-fuzz target drives it with libFuzzer's bytes).

mod cli_support;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cli_support::{fixtures, run, Run, TempDir};

const KILN: &str = env!("CARGO_BIN_EXE_kiln");
const DUMP: &str = env!("CARGO_BIN_EXE_kiln-dump");
const BENCH: &str = env!("CARGO_BIN_EXE_kiln-bench");
/// A run taking longer is a hang: every generated command is small (a 2-layer model, a few
/// tokens, one repetition) or must be refused at once.
const LIMIT: Duration = Duration::from_secs(10);

/// SplitMix64: a small, fixed generator, so a seed names its cases on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Sizes no run could use: each must be refused quickly.
const ABSURD: &[&str] = &[
    "4294967296",
    "1000000000",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999",
    "-1",
    "-9223372036854775808",
];

/// Values no number parser should take.
const MALFORMED: &[&str] = &[
    "", "NaN", "nan", "inf", "-inf", "1e3", "0x10", " 1", "1 ", "1,2", ",", "abc", "+", "--",
];

const FLOATS: &[&str] = &[
    "0", "0.5", "1", "2", "-1", "-0", "NaN", "inf", "-inf", "1e308", "1e-45", "1e39", "",
];

/// Prompt-like text: empty, long, special tokens, control characters, non-ASCII.
fn text(rng: &mut Rng) -> OsString {
    match rng.below(9) {
        0 => OsString::new(),
        1 => "x".into(),
        2 => "The 3 cats".into(),
        3 => "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n".into(),
        4 => "\x1b[2J\u{7}\t\r\n".into(),
        5 => "héllo wörld 🦀 — 猫".into(),
        6 => "word ".repeat(2000).into(),
        7 => OsString::from_vec(vec![b'h', 0xff, 0xfe, b'i']),
        _ => "{{ raise_exception('x') }}{% for %}".into(),
    }
}

/// Fixed paths and special files the model flag is given.
struct Places {
    tied: String,
    gguf: String,
    fifo: String,
    empty_dir: String,
    non_utf8: OsString,
    scratch: PathBuf,
}

fn model_path(rng: &mut Rng, p: &Places) -> OsString {
    match rng.below(12) {
        0 => "/dev/null".into(),
        1 => "/dev/zero".into(),
        2 => p.fifo.clone().into(),
        3 => p.empty_dir.clone().into(),
        4 => "/nonexistent/model".into(),
        5 => fixtures().join("README.md").into(),
        6 => "/proc/version".into(),
        7 => p.non_utf8.clone(),
        8 => OsString::new(),
        9 => "/".into(),
        10 => p.gguf.clone().into(),
        _ => p.tied.clone().into(),
    }
}

/// A value for a numeric flag: half the time one the flag takes, else absurd or malformed.
fn number(rng: &mut Rng, fine: &[&str]) -> OsString {
    match rng.below(4) {
        0 | 1 => (*rng.pick(fine)).into(),
        2 => (*rng.pick(ABSURD)).into(),
        _ => (*rng.pick(MALFORMED)).into(),
    }
}

/// One flag of `kiln` / `kiln chat` and a hostile value for it (`None`: a switch).
fn kiln_flag(rng: &mut Rng, p: &Places, chat: bool) -> (&'static str, Option<OsString>) {
    let flags: &[&str] = if chat {
        &[
            "-m",
            "-n",
            "-c",
            "--temp",
            "--top-k",
            "--top-p",
            "--min-p",
            "--repeat-penalty",
            "--seed",
            "--stop",
            "--system",
            "-t",
            "--weights",
            "--device",
            "--decode",
            "--ignore-eos",
            "--no-tools",
        ]
    } else {
        &[
            "-m",
            "-n",
            "-c",
            "--temp",
            "--top-k",
            "--top-p",
            "--min-p",
            "--repeat-penalty",
            "--seed",
            "--stop",
            "--system",
            "-t",
            "--weights",
            "--device",
            "--decode",
            "--ignore-eos",
            "--no-tools",
            "-p",
            "-f",
            "--prompt-ids",
            "--chat",
            "--samples",
            "--json",
        ]
    };
    let flag = *rng.pick(flags);
    let value: Option<OsString> = match flag {
        "-m" => Some(model_path(rng, p)),
        "-n" => Some(number(rng, &["0", "1", "2", "3", "255", "256", "257"])),
        "-c" => Some(number(
            rng,
            &["0", "1", "2", "8", "255", "256", "257", "4096"],
        )),
        "--samples" => Some(number(rng, &["0", "1", "2", "3"])),
        "-t" => Some(number(rng, &["0", "1", "2", "64", "65", "100000"])),
        "--top-k" | "--seed" => Some(number(rng, &["0", "1", "399", "400", "100000"])),
        "--temp" | "--top-p" | "--min-p" | "--repeat-penalty" => Some((*rng.pick(FLOATS)).into()),
        "--stop" | "--system" | "-p" => Some(text(rng)),
        "-f" => Some(match rng.below(5) {
            0 => "-".into(),
            1 => "/dev/null".into(),
            2 => "/dev/zero".into(),
            3 => p.empty_dir.clone().into(),
            _ => "/nonexistent/prompt.txt".into(),
        }),
        "--prompt-ids" => Some(
            (*rng.pick(&[
                "1,2,3",
                "",
                "0",
                "399",
                "400",
                "4294967295",
                "4294967296",
                "-1",
                "1,,2",
                "a",
                ",",
            ]))
            .into(),
        ),
        "--weights" => Some((*rng.pick(&["auto", "f32", "bf16", "q4", ""])).into()),
        "--device" => Some((*rng.pick(&["cpu", "auto", "cuda", "gpu", ""])).into()),
        "--decode" => Some((*rng.pick(&["auto", "per-op", "megakernel", "x"])).into()),
        _ => None,
    };
    (flag, value)
}

fn dump_flag(rng: &mut Rng, p: &Places) -> (&'static str, Option<OsString>) {
    let flag = *rng.pick(&[
        "-m",
        "--stage",
        "--format",
        "--phase",
        "--context",
        "--tokens",
        "-o",
    ]);
    let value: OsString = match flag {
        "-m" => model_path(rng, p),
        "--stage" => {
            (*rng.pick(&["all", "graph", "passes", "plan", "megakernel", "cuda", "x"])).into()
        }
        "--format" => (*rng.pick(&["text", "dot", "json", "yaml"])).into(),
        "--phase" => (*rng.pick(&["prefill", "decode", "train"])).into(),
        "--context" | "--tokens" => number(rng, &["0", "1", "512", "16777216", "16777217"]),
        _ => match rng.below(5) {
            0 => p.scratch.join(format!("out{}", rng.below(1000))).into(),
            1 => "/dev/null".into(),
            2 => "/dev/full/x".into(),
            3 => fixtures().join("README.md").into(),
            _ => "/proc/version/x".into(),
        },
    };
    (flag, Some(value))
}

fn bench_flag(rng: &mut Rng, p: &Places) -> (&'static str, Option<OsString>) {
    let flag = *rng.pick(&[
        "-m",
        "--synthetic",
        "-p",
        "-n",
        "--batch",
        "-r",
        "-t",
        "--bandwidth-gbs",
        "--bandwidth-mib",
        "-o",
        "--weights",
        "--device",
        "--decode",
        "--seed",
        "--profile",
        "--bytes-per-token",
        "--measure-gpu-bandwidth",
    ]);
    let value: Option<OsString> = match flag {
        "-m" => Some(model_path(rng, p)),
        "--synthetic" => Some(match rng.below(4) {
            0 => "tiny".into(),
            1 => "bogus".into(),
            2 => OsString::new(),
            _ => OsString::from_vec(vec![0xff]),
        }),
        "-p" => Some(number(rng, &["0", "1", "16", "256", "257", "0,1"])),
        "-n" => Some(number(rng, &["0", "1", "2", "16", "255", "256", "1,2"])),
        "--batch" => Some(number(rng, &["1", "2", "8", "0", "1,2"])),
        "-r" => Some(number(rng, &["0", "1", "2"])),
        "-t" => Some(number(rng, &["1", "2", "0", "64", "65", "1,2", "100000"])),
        "--bandwidth-gbs" => Some((*rng.pick(FLOATS)).into()),
        "--bandwidth-mib" => Some(number(rng, &["0", "1", "2"])),
        "-o" => Some((*rng.pick(&["md", "json", "csv", "xml"])).into()),
        "--weights" => Some((*rng.pick(&["auto", "f32", "bf16", "x"])).into()),
        "--device" => Some((*rng.pick(&["cpu", "cuda", "x"])).into()),
        "--decode" => Some((*rng.pick(&["megakernel", "per-op", "x"])).into()),
        "--seed" => Some(number(rng, &["0", "42"])),
        _ => None,
    };
    (flag, value)
}

/// One generated command: which binary, its arguments, its stdin.
#[derive(Debug)]
struct Case {
    exe: &'static str,
    args: Vec<OsString>,
    stdin: Vec<u8>,
}

fn os(s: &str) -> OsString {
    s.into()
}

/// Replaces `flag` and its value in `args` (or appends them). A value that starts with `-`
/// is attached (`--temp=-1`), as a user must write it for the parser to see a value.
fn set(args: &mut Vec<OsString>, flag: &str, value: Option<OsString>) {
    let pair: Vec<OsString> = match value {
        Some(v) if v.as_encoded_bytes().first() == Some(&b'-') => {
            let mut joined = OsString::from(format!("{flag}="));
            joined.push(v);
            vec![joined]
        }
        Some(v) => vec![flag.into(), v],
        None => vec![flag.into()],
    };
    let at = match args.iter().position(|a| a == flag) {
        Some(i) => {
            let has_value = args
                .get(i + 1)
                .is_some_and(|v| v.as_encoded_bytes().first() != Some(&b'-'));
            args.drain(i..if has_value { i + 2 } else { i + 1 });
            i
        }
        None => args.len(),
    };
    args.splice(at..at, pair);
}

/// Removes `flag` and its value from `args`.
fn remove(args: &mut Vec<OsString>, flag: &str) {
    if let Some(i) = args.iter().position(|a| a == flag) {
        args.drain(i..(i + 2).min(args.len()));
    }
}

fn generate(rng: &mut Rng, p: &Places) -> Case {
    let tied = p.tied.as_str();
    let which = rng.below(100);
    let (exe, mut args, chat, bench): (&str, Vec<OsString>, bool, bool) = if which < 45 {
        let base = ["-m", tied, "-p", "The 3 cats", "-n", "3"];
        (KILN, base.iter().map(|s| os(s)).collect(), false, false)
    } else if which < 60 {
        let base = ["chat", "-m", tied, "-n", "2"];
        (KILN, base.iter().map(|s| os(s)).collect(), true, false)
    } else if which < 78 {
        let base = ["-m", tied, "--stage", "graph"];
        (DUMP, base.iter().map(|s| os(s)).collect(), false, false)
    } else {
        let base = [
            "-m",
            tied,
            "-p",
            "0",
            "-n",
            "2",
            "-r",
            "1",
            "--bandwidth-gbs",
            "1",
        ];
        (BENCH, base.iter().map(|s| os(s)).collect(), false, true)
    };
    let mutations = 1 + rng.below(3);
    for _ in 0..mutations {
        match rng.below(16) {
            // A hostile value for a known flag (most mutations).
            0..=11 => {
                let (flag, value) = if exe == DUMP {
                    dump_flag(rng, p)
                } else if bench {
                    bench_flag(rng, p)
                } else {
                    kiln_flag(rng, p, chat)
                };
                // Half the time, make room for the flag instead of a certain usage error.
                if rng.below(2) == 0 {
                    match flag {
                        "-f" | "--prompt-ids" => remove(&mut args, "-p"),
                        "--system" if !chat => set(&mut args, "--chat", None),
                        _ => {}
                    }
                }
                set(&mut args, flag, value);
            }
            // A flag with its value missing, at the end.
            12 => {
                let flags: &[&str] = if exe == DUMP {
                    &["-m", "--stage", "--context", "-o"]
                } else if bench {
                    &["-m", "-n", "-p", "--batch", "-t", "-r"]
                } else {
                    &["-m", "-n", "-p", "-c", "-t", "--stop", "-f"]
                };
                args.push((*rng.pick(flags)).into());
            }
            // An unknown flag or a stray positional.
            13 => {
                args.push((*rng.pick(&["--bogus", "-Z", "--", "-", "--=", "---p", "extra"])).into())
            }
            // The same flag twice.
            14 => {
                if let Some(i) =
                    (0..args.len()).find(|&i| args[i].to_string_lossy().starts_with('-'))
                {
                    let dup: Vec<OsString> = args[i..(i + 2).min(args.len())].to_vec();
                    args.extend(dup);
                }
            }
            // Drop an argument (a flag's value may become the next flag). The bench keeps its
            // --bandwidth-gbs: without it, it measures bandwidth over a 1 GiB buffer.
            _ => {
                if args.len() > 1 {
                    let i = rng.below(args.len());
                    let keep = (bench
                        && (args[i] == "--bandwidth-gbs"
                            || (i > 0 && args[i - 1] == "--bandwidth-gbs")))
                        || (chat && i == 0);
                    if !keep {
                        // Mostly a whole flag with its value; sometimes one word alone.
                        let pair =
                            args[i].as_encoded_bytes().first() == Some(&b'-') && rng.below(4) != 0;
                        args.drain(i..if pair { (i + 2).min(args.len()) } else { i + 1 });
                    }
                }
            }
        }
    }
    let stdin = match rng.below(5) {
        0 => Vec::new(),
        1 => b"Hi\n".to_vec(),
        2 => b"\xff\xfe\nHi\n/reset\nThe 3 cats\n".to_vec(),
        3 => b"/exit\n".to_vec(),
        _ => [&b"word "[..]; 400].concat(),
    };
    Case { exe, args, stdin }
}

/// Why a run failed the contract, if it did.
fn verdict(r: &Run) -> Option<String> {
    let err = r.stderr();
    if r.timed_out {
        return Some(format!("hung: killed after {:?}", r.elapsed));
    }
    if let Some(sig) = r.signal() {
        return Some(format!("killed by signal {sig}"));
    }
    if err.contains("panicked") || err.contains("RUST_BACKTRACE") {
        return Some("panicked".into());
    }
    match r.status.code() {
        Some(0) | Some(2) => None,
        Some(1) => {
            let errors = err.lines().filter(|l| l.starts_with("error:")).count();
            (errors != 1).then(|| format!("exit 1 with {errors} error lines"))
        }
        code => Some(format!("exit status {code:?}")),
    }
}

#[test]
fn hostile_command_lines_never_crash_or_hang() {
    let cases: usize = std::env::var("KILN_FUZZ_CLI_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let seed: u64 = std::env::var("KILN_FUZZ_CLI_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let show = std::env::var_os("KILN_FUZZ_CLI_SHOW").is_some();
    let dir = TempDir::new("fuzz");
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let mut non_utf8 = dir.path().as_os_str().to_owned().into_vec();
    non_utf8.extend_from_slice(b"/m\xff");
    let non_utf8 = OsString::from_vec(non_utf8);
    std::os::unix::fs::symlink(fixtures().join("llama_tied"), &non_utf8).unwrap();
    let scratch = dir.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let places = Places {
        tied: fixtures().join("llama_tied").display().to_string(),
        gguf: fixtures()
            .join("llama_tied.q4_1.gguf")
            .display()
            .to_string(),
        fifo: fifo.display().to_string(),
        empty_dir: empty_dir.display().to_string(),
        non_utf8,
        scratch,
    };
    let mut rng = Rng(seed);
    let all: Vec<Case> = (0..cases).map(|_| generate(&mut rng, &places)).collect();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let exit_codes = Mutex::new([0usize; 3]);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(case) = all.get(i) else { break };
                let r = run(case.exe, &case.args, Some(&case.stdin), LIMIT);
                if let Some(code) = r.status.code().filter(|c| (0..3).contains(c)) {
                    exit_codes.lock().unwrap()[code as usize] += 1;
                }
                if show {
                    let first = r
                        .stderr()
                        .lines()
                        .find(|l| l.starts_with("error"))
                        .map(str::to_string);
                    eprintln!("case {i}: {:?} {:?}", r.status.code(), first);
                }
                if let Some(why) = verdict(&r) {
                    failures.lock().unwrap().push(format!(
                        "case {i}: {why}\n  {} {:?}\n  stderr: {}",
                        case.exe,
                        case.args,
                        r.stderr().chars().take(2000).collect::<String>()
                    ));
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    let codes = exit_codes.into_inner().unwrap();
    eprintln!(
        "fuzz_cli: {cases} command lines (seed {seed}) in {secs:.1} s, {:.1} runs/s; \
         exit 0: {}, 1: {}, 2: {}",
        cases as f64 / secs,
        codes[0],
        codes[1],
        codes[2]
    );
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {cases} command lines broke the contract:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The `kiln` and `kiln chat` command lines of the mutator, parsed and checked in-process as
/// the binary does before it loads a model: none may panic. Without process start-up, thousands
/// take well under a second.
#[test]
fn hostile_kiln_command_lines_parse_in_process_without_panic() {
    use kiln::cli::kiln_args::{parse_args, KilnArgsError, KilnCommand};

    let dir = TempDir::new("fuzz-parse");
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let mut non_utf8 = dir.path().as_os_str().to_owned().into_vec();
    non_utf8.extend_from_slice(b"/m\xff");
    let non_utf8 = OsString::from_vec(non_utf8);
    std::os::unix::fs::symlink(fixtures().join("llama_tied"), &non_utf8).unwrap();
    let scratch = dir.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let places = Places {
        tied: fixtures().join("llama_tied").display().to_string(),
        gguf: fixtures()
            .join("llama_tied.q4_1.gguf")
            .display()
            .to_string(),
        fifo: fifo.display().to_string(),
        empty_dir: empty_dir.display().to_string(),
        non_utf8,
        scratch,
    };
    let mut rng = Rng(1);
    // Outcomes seen: parsed, usage error (exit 2), refused by a check (exit 1).
    let mut seen = [0usize; 3];
    let mut parsed = 0;
    while parsed < 5000 {
        let case = generate(&mut rng, &places);
        if case.exe != KILN {
            continue;
        }
        parsed += 1;
        let argv = std::iter::once(OsString::from(KILN)).chain(case.args.iter().cloned());
        let outcome = std::panic::catch_unwind(|| parse_args(argv));
        match outcome {
            Ok(Ok(KilnCommand::Generate(_) | KilnCommand::Chat(_))) => seen[0] += 1,
            Ok(Ok(KilnCommand::Serve(_))) => panic!("{:?} parsed as kiln serve", case.args),
            Ok(Err(KilnArgsError::Usage(_))) => seen[1] += 1,
            Ok(Err(_)) => seen[2] += 1,
            Err(_) => panic!("parse_args panicked on {:?}", case.args),
        }
    }
    eprintln!(
        "parse_args: {parsed} command lines: {} parsed, {} usage errors, {} refused by checks",
        seen[0], seen[1], seen[2]
    );
    // The mutator reaches every outcome; if it stopped doing so, this test would test less.
    assert!(seen.iter().all(|&n| n > 0), "outcomes {seen:?}");
}
