//! `kiln serve`'s command line: its flags (a clap derive type), the value parsers for sizes,
//! seconds and listen addresses, and the checks that run before any model is loaded. Like
//! [`super::kiln_args`], it lives in the library so that a fuzz target and tests parse hostile
//! argument lists in-process exactly as the binary does.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;

use super::args::{check_model_path, check_threads, ArgError, NumericsArg, Text};
use super::spec::{SpecArgError, SpecArgs};

#[derive(Parser, Debug)]
#[command(
    name = "kiln serve",
    version,
    about = "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"
)]
pub struct ServeArgs {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Address to listen on: an IPv4 or IPv6 address, or `localhost` (127.0.0.1 keeps the
    /// server off the network).
    #[arg(long, default_value = "127.0.0.1", value_parser = Text::NON_EMPTY)]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Context per request, prompt and completion together (0 = the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// Memory for the KV cache pool shared by all requests: bytes, or with a K/M/G suffix.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    pub kv_budget: usize,
    /// Requests generating at once (each of n choices counts).
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests that may wait for a place; more get 429 with Retry-After (0: none wait, a
    /// request that finds every place taken is refused at once).
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Tokens one engine step may run: decode rows count one each, and prompts are prefilled
    /// in chunks of what is left (at least a quarter of it). Smaller keeps running streams'
    /// inter-token latency low while a long prompt joins.
    #[arg(long, default_value_t = 64)]
    pub max_step_tokens: usize,
    /// With --spec: the most rows a step grows to with proposals (decode rows first; none
    /// once as many streams decode; 0: no proposals). Default: no limit but --max-step-tokens.
    #[arg(long, value_name = "N")]
    pub spec_step_rows: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long, value_parser = Text::NON_EMPTY)]
    pub api_key: Option<String>,
    /// The model name clients send (default: the model file or directory name).
    #[arg(long, value_parser = Text::NON_EMPTY)]
    pub model_name: Option<String>,
    /// Largest request body accepted, bytes or with a K/M/G suffix.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub max_body: usize,
    /// Seconds a client may take to send a request's head, and then its body (slower ones are
    /// disconnected, or answered 408).
    #[arg(long, default_value_t = 30.0, value_parser = parse_seconds)]
    pub read_timeout: f64,
    /// Do not reuse cached prompt prefixes across requests.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// CPU threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// How steps multiply activations by quantized weights: int24 (the default: rounded to
    /// 24-bit integers against Q4_0/Q4_1/Q5_0/Q8_0 weights in steps of up to 16 rows on CPUs with
    /// AVX512-VNNI, as accurate as exact and faster there; exact elsewhere), exact (f32
    /// activations), int16 (rounded to 16-bit integers; on CPUs with AVX512-VNNI,
    /// Q4_0/Q4_1/Q5_0/Q8_0 weights in every step, prompt chunks included, faster than exact; on
    /// other AVX2 CPUs steps of up to 16 rows only, slower than exact), bf16 or int8 (see `kiln
    /// --help`). None is bit-equal to another.
    #[arg(long, value_enum, default_value_t = NumericsArg::Int24)]
    pub numerics: NumericsArg,
    /// Speculative decoding for every request (each of n choices speculates on its own).
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// `kiln serve`'s flags, parsed and checked.
#[derive(Debug)]
pub struct ServeCommand {
    pub args: ServeArgs,
    /// `--host` and `--port` together.
    pub addr: SocketAddr,
}

/// Why a `kiln serve` command line was refused before any model was loaded.
#[derive(Debug, thiserror::Error)]
pub enum ServeArgsError {
    /// A usage error (a value parser's message names its flag), or `--help`/`--version`:
    /// clap's message, printed by `clap::Error::exit`.
    #[error(transparent)]
    Usage(#[from] clap::Error),
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error("{flag} must be at least 1")]
    Zero { flag: &'static str },
    #[error("--host {host:?} is not an IP address or localhost")]
    Host { host: String },
    #[error(transparent)]
    Spec(#[from] SpecArgError),
}

/// Why a size flag's value was refused (clap names the flag beside this message).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("{0:?}: the suffix must be K, M or G")]
    Suffix(String),
    #[error("{0:?} is not a size (bytes, or a number with K, M or G)")]
    NotANumber(String),
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Why a seconds flag's value was refused (clap names the flag beside this message).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a number of seconds in (0, 86400]")]
pub struct SecondsError(pub String);

/// A positive, finite number of seconds, at most a day.
pub fn parse_seconds(s: &str) -> Result<f64, SecondsError> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(SecondsError(s.to_string())),
    }
}

/// `512M`, `2G`, `65536`: a size in bytes.
pub fn parse_size(s: &str) -> Result<usize, SizeError> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                _ => return Err(SizeError::Suffix(s.to_string())),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| SizeError::NotANumber(s.to_string()))?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| SizeError::TooLarge(s.to_string()))
}

/// `--host` (an IPv4 or IPv6 address, bracketed or not, or `localhost`) and `--port` as a
/// socket address.
pub fn listen_addr(host: &str, port: u16) -> Result<SocketAddr, ServeArgsError> {
    let ip: IpAddr = match host {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        h => {
            let bare = h.strip_prefix('[').and_then(|r| r.strip_suffix(']'));
            bare.unwrap_or(h)
                .parse()
                .map_err(|_| ServeArgsError::Host {
                    host: h.to_string(),
                })?
        }
    };
    Ok(SocketAddr::new(ip, port))
}

/// Parses `argv` (`kiln serve` first, in place of the program name and `serve`) and checks
/// what can be checked before a model is loaded: the model path, the thread count, the counts
/// that must be positive and the listen address. Reads no file but the model path's metadata;
/// never panics or exits.
pub fn parse_serve_args(
    argv: impl IntoIterator<Item = OsString>,
) -> Result<ServeCommand, ServeArgsError> {
    let args = ServeArgs::try_parse_from(argv)?;
    check_model_path("-m", &args.model)?;
    check_threads("-t", args.threads)?;
    for (flag, v) in [
        ("--max-running", args.max_running),
        ("--max-step-tokens", args.max_step_tokens),
        ("--max-body", args.max_body),
        ("--kv-budget", args.kv_budget),
    ] {
        if v == 0 {
            return Err(ServeArgsError::Zero { flag });
        }
    }
    args.spec.check()?;
    let addr = listen_addr(&args.host, args.port)?;
    Ok(ServeCommand { args, addr })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn model() -> String {
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama_tied").to_string()
    }

    fn parse(extra: &[&str]) -> Result<ServeCommand, ServeArgsError> {
        let m = model();
        let argv = ["kiln serve", "-m", &m]
            .into_iter()
            .chain(extra.iter().copied())
            .map(OsString::from);
        parse_serve_args(argv)
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("12X"), Err(SizeError::Suffix("12X".into())));
        assert_eq!(parse_size("M"), Err(SizeError::NotANumber("M".into())));
        assert_eq!(parse_size("-1"), Err(SizeError::NotANumber("-1".into())));
        assert_eq!(
            parse_size("99999999999999999999G"),
            Err(SizeError::NotANumber("99999999999999999999G".into()))
        );
        assert_eq!(
            parse_size("999999999999G"),
            Err(SizeError::TooLarge("999999999999G".into()))
        );
        // A multi-byte last character is not a suffix and must not split a char.
        assert!(parse_size("1é").is_err());
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("2.5"), Ok(2.5));
        for bad in ["0", "-1", "inf", "NaN", "86401", "x"] {
            assert_eq!(parse_seconds(bad), Err(SecondsError(bad.into())), "{bad}");
        }
    }

    #[test]
    fn hosts() {
        let addr = |h| listen_addr(h, 80).map(|a| a.to_string());
        assert_eq!(addr("127.0.0.1").unwrap(), "127.0.0.1:80");
        assert_eq!(addr("::1").unwrap(), "[::1]:80");
        assert_eq!(addr("[::1]").unwrap(), "[::1]:80");
        assert_eq!(addr("localhost").unwrap(), "127.0.0.1:80");
        for bad in ["0.0.0.0.1", "[::1", "example.com", "[]"] {
            let e = listen_addr(bad, 80).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("--host {bad:?} is not an IP address or localhost")
            );
        }
    }

    #[test]
    fn defaults_and_flags() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.addr.to_string(), "127.0.0.1:8080");
        assert_eq!(c.args.kv_budget, 512 << 20);
        assert_eq!(c.args.max_step_tokens, 64);
        assert_eq!(c.args.read_timeout, 30.0);
        assert!(c.args.api_key.is_none());
        let c = parse(&[
            "--host",
            "::1",
            "--port",
            "9",
            "--kv-budget",
            "1G",
            "--max-step-tokens",
            "64",
            "--api-key",
            "k",
            "-t",
            "2",
            "--no-prefix-cache",
            "--numerics",
            "int16",
        ])
        .unwrap();
        assert_eq!(c.addr.to_string(), "[::1]:9");
        assert_eq!(c.args.numerics, NumericsArg::Int16);
        assert_eq!(parse(&[]).unwrap().args.numerics, NumericsArg::Int24);
        assert_eq!(c.args.kv_budget, 1 << 30);
        assert_eq!(c.args.max_step_tokens, 64);
        assert_eq!(c.args.api_key.as_deref(), Some("k"));
        assert_eq!(c.args.threads, 2);
        assert!(c.args.no_prefix_cache);
    }

    #[test]
    fn errors_name_their_flag() {
        for flag in [
            "--max-running",
            "--max-step-tokens",
            "--max-body",
            "--kv-budget",
        ] {
            let e = parse(&[flag, "0"]).unwrap_err();
            assert_eq!(e.to_string(), format!("{flag} must be at least 1"));
        }
        // No queue at all is a setting (every request past --max-running is refused), not an
        // error: the OpenAI client check runs the server that way.
        assert_eq!(parse(&["--max-queue", "0"]).unwrap().args.max_queue, 0);
        let e = parse(&["--host", "nowhere"]).unwrap_err();
        assert!(matches!(e, ServeArgsError::Host { .. }), "{e}");
        for (flag, value) in [
            ("--kv-budget", "12X"),
            ("--max-body", "-4"),
            ("--read-timeout", "0"),
            ("--port", "70000"),
            ("--max-running", "-1"),
            ("--numerics", "int4"),
        ] {
            let e = parse(&[&format!("{flag}={value}")]).unwrap_err();
            let ServeArgsError::Usage(u) = &e else {
                panic!("{flag} {value}: {e}");
            };
            assert!(u.to_string().contains(flag), "{flag}: {u}");
        }
        let e = parse(&["--api-key", ""]).unwrap_err();
        assert!(e.to_string().contains("--api-key"), "{e}");
        for (args, want) in [
            (&["--spec", "draft"][..], "--spec draft needs --draft MODEL"),
            (
                &["--spec", "ngram", "--draft-max", "0"],
                "--draft-max must be at least 1",
            ),
            (&["--draft", "."], "--draft is only used with --spec draft"),
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.to_string(), want, "{args:?}");
        }
        let c = parse(&["--spec", "ngram", "--draft-max", "6"]).unwrap();
        assert_eq!(c.args.spec.spec, Some(super::super::spec::SpecKind::Ngram));
        assert_eq!(c.args.spec.draft_max, 6);
        assert_eq!(c.args.spec_step_rows, None);
        let c = parse(&["--spec", "ngram", "--spec-step-rows", "8"]).unwrap();
        assert_eq!(c.args.spec_step_rows, Some(8));
        assert!(parse(&["--spec-step-rows", "-1"]).is_err());
        let bad = OsString::from_vec(vec![b'k', 0xff]);
        let m = model();
        let argv = ["kiln serve", "-m", &m, "--api-key"]
            .into_iter()
            .map(OsString::from)
            .chain([bad]);
        let e = parse_serve_args(argv).unwrap_err();
        assert!(
            e.to_string().contains("--api-key") && e.to_string().contains("UTF-8"),
            "{e}"
        );
        let e =
            parse_serve_args(["kiln serve", "-m", "/dev/null"].map(OsString::from)).unwrap_err();
        assert!(
            matches!(e, ServeArgsError::Arg(ArgError::NotAModel { .. })),
            "{e}"
        );
        let e = parse(&["-t", "100000"]).unwrap_err();
        assert!(
            matches!(e, ServeArgsError::Arg(ArgError::TooManyThreads { .. })),
            "{e}"
        );
        assert!(matches!(
            parse_serve_args(["kiln serve"].map(OsString::from)),
            Err(ServeArgsError::Usage(_))
        ));
    }
}
