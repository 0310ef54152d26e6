//! The binaries under hostile command lines and environments: absurd sizes, non-UTF-8
//! arguments, closed and full outputs, runaway chat templates, bad chat input. Each case must
//! end in a sane result or a one-line error, within a time bound, never a panic, an abort, a
//! signal other than a closed pipe's, or a hang.

mod cli_support;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use cli_support::{copy_fixture, fixtures, os, run, run_with, set_json_field, TempDir};
use serde_json::Value;

const KILN: &str = env!("CARGO_BIN_EXE_kiln");
const DUMP: &str = env!("CARGO_BIN_EXE_kiln-dump");
const BENCH: &str = env!("CARGO_BIN_EXE_kiln-bench");
const LIMIT: Duration = Duration::from_secs(60);
const SIGPIPE: i32 = 13;

fn tied() -> String {
    fixtures().join("llama_tied").display().to_string()
}

/// A one-line error: exit status 1 (or clap's 2), no panic, finished in time.
fn assert_refused(r: &cli_support::Run, code: i32, needle: &str) {
    let err = r.stderr();
    assert!(!r.timed_out, "timed out: {err}");
    assert_eq!(r.status.code(), Some(code), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "wanted {needle:?} in: {err}");
}

fn assert_ok(r: &cli_support::Run) {
    assert!(!r.timed_out, "timed out: {}", r.stderr());
    assert!(r.status.success(), "{:?}: {}", r.status, r.stderr());
}

/// llama_tied with `max_position_embeddings` replaced.
fn tied_with_context(dir: &TempDir, ctx: u64) -> String {
    let model = dir.path().join("model");
    copy_fixture("llama_tied", &model);
    set_json_field(
        &model.join("config.json"),
        "max_position_embeddings",
        ctx.into(),
    );
    model.display().to_string()
}

#[test]
fn chat_sizes_its_cache_from_need_and_memory_not_the_models_claim() {
    let dir = TempDir::new("huge-context");
    // 2^62 wrapped the cache's size to 0 (a panic); 2^31 and 2^40 aborted allocating terabytes.
    for ctx in [1u64 << 62, 1 << 40, 1 << 31] {
        let model = tied_with_context(&dir, ctx);
        let r = run(
            KILN,
            &os(&["chat", "-m", &model, "-n", "3"]),
            Some(b"Hi\n"),
            LIMIT,
        );
        assert_ok(&r);
        let err = r.stderr();
        assert!(
            err.contains(&format!("context of 4096 positions of the model's {ctx}")),
            "{err}"
        );
        assert!(err.contains("prefill:"), "{err}");
        // Asking for the whole context is refused with the sizes, not attempted.
        let r = run(
            KILN,
            &os(&["chat", "-m", &model, "-n", "3", "-c", "0"]),
            Some(b"Hi\n"),
            LIMIT,
        );
        assert_refused(&r, 1, "pass a smaller -c");
    }
}

#[test]
fn gguf_context_length_of_u32_max_is_cut_not_allocated() {
    let dir = TempDir::new("gguf-context");
    let mut bytes = std::fs::read(fixtures().join("llama_tied.q4_1.gguf")).unwrap();
    let (at, ty) = cli_support::gguf_value_offset(&bytes, "llama.context_length").unwrap();
    assert_eq!(ty, 4, "u32");
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let model = dir.path().join("huge.gguf");
    std::fs::write(&model, &bytes).unwrap();
    let model = model.display().to_string();
    let r = run(
        KILN,
        &os(&["chat", "-m", &model, "-n", "3"]),
        Some(b"Hi\n"),
        LIMIT,
    );
    assert_ok(&r);
    assert!(
        r.stderr()
            .contains("context of 4096 positions of the model's 4294967295"),
        "{}",
        r.stderr()
    );
}

#[test]
fn ctx_size_bounds_the_cache_and_cannot_exceed_the_model() {
    let r = run(
        KILN,
        &os(&[
            "-m",
            &tied(),
            "-p",
            "The 3 cats",
            "-n",
            "100",
            "-c",
            "10",
            "--ignore-eos",
            "--json",
        ]),
        None,
        LIMIT,
    );
    assert_ok(&r);
    let v: Value = serde_json::from_slice(&r.stdout).unwrap();
    let prompt = v["prompt_ids"].as_array().unwrap().len();
    assert_eq!(v["finish_reason"], "context_full");
    // The last token is sampled from the logits of the last position; it needs no slot.
    assert_eq!(
        v["generated_ids"].as_array().unwrap().len(),
        10 + 1 - prompt
    );
    let r = run(
        KILN,
        &os(&["-m", &tied(), "-p", "x", "-c", "300"]),
        None,
        LIMIT,
    );
    assert_refused(
        &r,
        1,
        "-c 300 is more than the model's context of 256 positions",
    );
}

/// The demo model's chat ran out of memory under `ulimit -v` where one-shot generation did not:
/// its cache was sized to the model's 8192 positions.
#[test]
fn demo_chat_runs_under_a_600_mb_address_space_limit() {
    let demo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !demo.exists() {
        eprintln!("skipped: the demo model is not fetched (scripts/fetch_demo_model.sh)");
        return;
    }
    let script = format!(
        "ulimit -v 600000 && exec \"$0\" chat -m '{}' -n 4 -t 2",
        demo.display()
    );
    let r = run_with(
        Command::new("sh")
            .args(["-c", &script, KILN])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        Some(b"What is the capital of France?\n"),
        Duration::from_secs(120),
    );
    assert_ok(&r);
    assert!(r.stderr().contains("decode: "), "{}", r.stderr());
}

#[test]
fn absurd_samples_tokens_and_threads_are_refused_or_saturated() {
    let m = tied();
    let r = run(
        KILN,
        &os(&["-m", &m, "-p", "x", "--samples", "18446744073709551615"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 1, "too large to count in bytes");
    let r = run(
        KILN,
        &os(&["-m", &m, "-p", "x", "--samples", "1000000000"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 1, "--samples");
    // prompt + n saturates: generation runs to the end of the context.
    let r = run(
        KILN,
        &os(&[
            "-m",
            &m,
            "-p",
            "The 3 cats",
            "-n",
            "18446744073709551615",
            "--ignore-eos",
            "--json",
        ]),
        None,
        LIMIT,
    );
    assert_ok(&r);
    let v: Value = serde_json::from_slice(&r.stdout).unwrap();
    let prompt = v["prompt_ids"].as_array().unwrap().len();
    assert_eq!(v["finish_reason"], "context_full");
    assert_eq!(
        v["generated_ids"].as_array().unwrap().len(),
        256 + 1 - prompt
    );
    let r = run(
        KILN,
        &os(&["-m", &m, "-p", "x", "-t", "100000"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 1, "-t 100000: at most");
    assert!(r.elapsed < Duration::from_secs(5), "{:?}", r.elapsed);
    for args in [
        &["--batch", "100000"][..],
        &["--batch", "18446744073709551615"],
        &["-n", "18446744073709551615"],
        &["-r", "18446744073709551615"],
        &["-t", "100000"],
        &["--bandwidth-mib", "18446744073709551615"],
    ] {
        let mut a = os(&["-m", &m, "-p", "0", "--bandwidth-gbs", "1"]);
        a.extend(os(args));
        let r = run(BENCH, &a, None, LIMIT);
        assert_refused(&r, 1, "at most");
    }
    // Within the bounds, a batch that does not fit in memory is refused with its size.
    let script = "ulimit -v 400000 && exec \"$0\" -m \"$1\" -p 0 -n 200 --batch 60000 -r 1 \
                  --bandwidth-gbs 1";
    let r = run_with(
        Command::new("sh")
            .args(["-c", script, BENCH, &m])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        None,
        LIMIT,
    );
    assert_refused(&r, 1, "tg200 at batch 60000 needs");
    assert!(r.stderr().contains("ulimit -v"), "{}", r.stderr());
}

#[test]
fn non_utf8_arguments_are_errors_naming_the_flag_or_paths() {
    let bad = OsString::from_vec(vec![b'h', 0xff, b'i']);
    let r = run(
        KILN,
        &[os(&["-m", &tied(), "-p"]), vec![bad.clone()]].concat(),
        None,
        LIMIT,
    );
    assert_refused(&r, 2, "--prompt");
    assert!(r.stderr().contains("not valid UTF-8"), "{}", r.stderr());
    let r = run(
        KILN,
        &[os(&["chat", "-m", &tied(), "--system"]), vec![bad.clone()]].concat(),
        None,
        LIMIT,
    );
    assert_refused(&r, 2, "--system");
    let r = run(
        BENCH,
        &[os(&["--synthetic"]), vec![bad.clone()]].concat(),
        None,
        LIMIT,
    );
    assert_refused(&r, 2, "--synthetic");
    // A model directory whose name is not UTF-8 is still a path.
    let dir = TempDir::new("non-utf8");
    let mut name = dir.path().as_os_str().to_owned().into_vec();
    name.extend_from_slice(b"/m\xff\xfe");
    let model = OsString::from_vec(name);
    std::os::unix::fs::symlink(fixtures().join("llama_tied"), &model).unwrap();
    let r = run(
        KILN,
        &[
            os(&["-m"]),
            vec![model.clone()],
            os(&["-p", "hi", "-n", "2"]),
        ]
        .concat(),
        None,
        LIMIT,
    );
    assert_ok(&r);
    let r = run(
        DUMP,
        &[os(&["-m"]), vec![model.clone()], os(&["--stage", "graph"])].concat(),
        None,
        LIMIT,
    );
    assert_ok(&r);
    let r = run(
        BENCH,
        &[
            os(&["-m"]),
            vec![model],
            os(&["-p", "0", "-n", "2", "-r", "1", "--bandwidth-gbs", "1"]),
        ]
        .concat(),
        None,
        LIMIT,
    );
    assert_ok(&r);
}

/// Runs `exe args` with stdout (and stderr, with `both`) on a pipe whose reader is already gone.
fn into_closed_pipe(exe: &str, args: &[&str], both: bool) -> cli_support::Run {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut cmd = Command::new(exe);
    cmd.args(args).stdout(writer.try_clone().unwrap());
    cmd.stderr(if both { writer.into() } else { Stdio::piped() });
    run_with(&mut cmd, None, LIMIT)
}

fn into_dev_full(exe: &str, args: &[&str]) -> cli_support::Run {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    run_with(
        Command::new(exe)
            .args(args)
            .stdout(full)
            .stderr(Stdio::piped()),
        None,
        LIMIT,
    )
}

#[test]
fn a_closed_pipe_ends_quietly_and_a_full_disk_is_an_error() {
    let m = tied();
    let gen = ["-m", &m, "-p", "The 3 cats", "-n", "4"];
    let dump = ["-m", &m, "--stage", "graph"];
    let bench = [
        "-m",
        &m,
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "--bandwidth-gbs",
        "1",
    ];
    // `kiln … 2>&1 | head -0` and `kiln-dump | head -0`: killed by SIGPIPE like cat, no panic.
    for (exe, args) in [(KILN, &gen[..]), (DUMP, &dump), (BENCH, &bench)] {
        for both in [false, true] {
            let r = into_closed_pipe(exe, args, both);
            assert!(!r.timed_out, "{exe}");
            assert_eq!(
                r.signal(),
                Some(SIGPIPE),
                "{exe} {:?}: {}",
                r.status,
                r.stderr()
            );
            assert!(!r.stderr().contains("panicked"), "{}", r.stderr());
        }
    }
    for (exe, args) in [(KILN, &gen[..]), (DUMP, &dump), (BENCH, &bench)] {
        let r = into_dev_full(exe, args);
        assert_refused(&r, 1, "writing to stdout: No space left on device");
    }
    // Errors writing stderr are dropped: there is nowhere to report them.
    let bench_measuring = [
        "-m",
        &m,
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "--bandwidth-mib",
        "1",
    ];
    for (exe, args) in [(KILN, &gen[..]), (DUMP, &dump), (BENCH, &bench_measuring)] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let r = run_with(
            Command::new(exe)
                .args(args)
                .stdout(Stdio::piped())
                .stderr(full),
            None,
            LIMIT,
        );
        assert_ok(&r);
        assert!(!r.stdout.is_empty(), "{exe}");
    }
    let r = run_with(
        Command::new(KILN)
            .args(["chat", "-m", &m, "-n", "2"])
            .stdout(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            )
            .stderr(Stdio::piped()),
        Some(b"Hi\n"),
        LIMIT,
    );
    assert_refused(&r, 1, "writing to stdout: No space left on device");
}

const RUNAWAY: &str =
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";

#[test]
fn a_runaway_chat_template_is_too_expensive_naming_its_file() {
    let dir = TempDir::new("template");
    let in_config = dir.path().join("in-config");
    copy_fixture("llama_tied", &in_config);
    set_json_field(
        &in_config.join("tokenizer_config.json"),
        "chat_template",
        RUNAWAY.into(),
    );
    let in_jinja = dir.path().join("in-jinja");
    copy_fixture("llama_tied", &in_jinja);
    let cfg = in_jinja.join("tokenizer_config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&cfg, v.to_string()).unwrap();
    std::fs::write(in_jinja.join("chat_template.jinja"), RUNAWAY).unwrap();
    for (model, file) in [
        (&in_config, "tokenizer_config.json"),
        (&in_jinja, "chat_template.jinja"),
    ] {
        let m = model.display().to_string();
        let r = run(
            KILN,
            &os(&["-m", &m, "--chat", "-p", "hi", "-n", "2"]),
            None,
            LIMIT,
        );
        assert_refused(&r, 1, "too expensive");
        assert!(
            r.stderr().contains(&model.join(file).display().to_string()),
            "{}",
            r.stderr()
        );
        // In a chat, the turn fails and the session goes on.
        let r = run(
            KILN,
            &os(&["chat", "-m", &m, "-n", "2"]),
            Some(b"hi\n"),
            LIMIT,
        );
        assert_ok(&r);
        assert!(r.stderr().contains("too expensive"), "{}", r.stderr());
    }
}

#[test]
fn chat_skips_a_line_that_is_not_utf8() {
    let r = run(
        KILN,
        &os(&["chat", "-m", &tied(), "-n", "2"]),
        Some(b"\xff\xfe\nHi\n"),
        LIMIT,
    );
    assert_ok(&r);
    let err = r.stderr();
    assert!(
        err.contains("not valid UTF-8 (byte 0); it was skipped"),
        "{err}"
    );
    assert_eq!(err.matches("prefill:").count(), 1, "{err}");
}

#[test]
fn flags_that_would_be_ignored_are_refused() {
    let m = tied();
    let r = run(KILN, &os(&["-m", &m, "-p", "x", "--stop", ""]), None, LIMIT);
    assert_refused(&r, 2, "must not be empty");
    let r = run(
        KILN,
        &os(&["-m", &m, "-p", "x", "--system", "s"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 2, "--chat");
    let r = run(
        KILN,
        &os(&["-m", &m, "--chat", "--prompt-ids", "1,2"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 2, "cannot be used with");
    for special in ["/dev/null", "/nonexistent/model"] {
        let r = run(KILN, &os(&["-m", special, "-p", "x"]), None, LIMIT);
        assert_refused(&r, 1, &format!("-m {special}: "));
    }
    let dir = TempDir::new("fifo");
    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let f = fifo.display().to_string();
    for exe in [KILN, DUMP, BENCH] {
        let r = run(exe, &os(&["-m", &f]), None, Duration::from_secs(10));
        assert_refused(&r, 1, "a FIFO");
    }
}

#[test]
fn prompt_from_a_file_or_stdin_matches_the_same_prompt_inline() {
    let m = tied();
    let gen = |extra: &[&str], stdin: Option<&[u8]>| {
        let mut a = os(&["-m", &m, "-n", "5", "--ignore-eos", "--json"]);
        a.extend(os(extra));
        let r = run(KILN, &a, stdin, LIMIT);
        assert_ok(&r);
        let v: Value = serde_json::from_slice(&r.stdout).unwrap();
        (v["prompt_ids"].clone(), v["generated_ids"].clone())
    };
    let dir = TempDir::new("prompt-file");
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "The 3 cats").unwrap();
    let inline = gen(&["-p", "The 3 cats"], None);
    assert_eq!(gen(&["-f", &file.display().to_string()], None), inline);
    assert_eq!(gen(&["-f", "-"], Some(b"The 3 cats")), inline);
    let r = run(
        KILN,
        &os(&["-m", &m, "-f", "/nonexistent/p.txt"]),
        None,
        LIMIT,
    );
    assert_refused(&r, 1, "reading the prompt from /nonexistent/p.txt");
    let r = run(KILN, &os(&["-m", &m, "-f", "-", "-p", "x"]), None, LIMIT);
    assert_refused(&r, 2, "cannot be used with");
}
