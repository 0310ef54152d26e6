//! Argument checks the binaries share: text that must be UTF-8 (named by its flag when it is
//! not), thread counts, and prompts read from a file or stdin.

use std::ffi::OsStr;
use std::path::Path;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;

/// A clap value parser for text flags: the value must be UTF-8 (clap's own parser says only
/// that "one or more arguments" are not), and, unless `allow_empty`, not empty.
#[derive(Clone, Copy, Debug)]
pub struct Text {
    pub allow_empty: bool,
}

impl Text {
    pub const ANY: Text = Text { allow_empty: true };
    pub const NON_EMPTY: Text = Text { allow_empty: false };
}

impl TypedValueParser for Text {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<String, clap::Error> {
        let name = arg.map_or_else(|| "a value".to_string(), |a| format!("'{a}'"));
        let Some(text) = value.to_str() else {
            return Err(clap::Error::raw(
                ErrorKind::InvalidUtf8,
                format!(
                    "{name} is not valid UTF-8: {}\n",
                    value.as_encoded_bytes().escape_ascii()
                ),
            )
            .with_cmd(cmd));
        };
        if text.is_empty() && !self.allow_empty {
            return Err(clap::Error::raw(
                ErrorKind::InvalidValue,
                format!("{name} must not be empty\n"),
            )
            .with_cmd(cmd));
        }
        Ok(text.to_string())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgError {
    #[error(
        "{flag} {threads}: at most {max} threads (4 × the {cores} cores, at least 64); more only \
         adds scheduling cost"
    )]
    TooManyThreads {
        flag: &'static str,
        threads: usize,
        max: usize,
        cores: usize,
    },
    #[error("{flag} {path}: {reason}")]
    NotAModel {
        flag: &'static str,
        path: String,
        reason: String,
    },
}

/// The most CPU threads a flag may ask for on a machine of `cores` cores: 4 × cores, and never
/// fewer than 64 (so a thread sweep runs the same on small machines).
pub fn max_threads(cores: usize) -> usize {
    cores.saturating_mul(4).max(64)
}

/// Refuses a thread count above [`max_threads`] of this machine (0, "every core", passes).
pub fn check_threads(flag: &'static str, threads: usize) -> Result<usize, ArgError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = max_threads(cores);
    if threads > max {
        return Err(ArgError::TooManyThreads {
            flag,
            threads,
            max,
            cores,
        });
    }
    Ok(threads)
}

/// Refuses a model path that is neither a regular file nor a directory (a FIFO would block the
/// loader's `open` forever, a device reads as garbage) before anything opens it.
pub fn check_model_path(flag: &'static str, path: &Path) -> Result<(), ArgError> {
    let fail = |reason: String| ArgError::NotAModel {
        flag,
        path: path.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    let t = meta.file_type();
    if t.is_file() || t.is_dir() {
        return Ok(());
    }
    Err(fail(format!(
        "not a model file or directory but {}",
        kind_of(&t)
    )))
}

fn kind_of(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    let _ = t;
    "a special file"
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, Command};
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;

    fn cmd(parser: Text) -> Command {
        Command::new("t").arg(
            Arg::new("prompt")
                .short('p')
                .long("prompt")
                .value_parser(parser),
        )
    }

    #[test]
    fn non_utf8_text_names_its_flag() {
        let args = [
            OsString::from("t"),
            OsString::from("-p"),
            OsString::from_vec(vec![b'a', 0xff]),
        ];
        let e = cmd(Text::ANY).try_get_matches_from(args).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUtf8);
        let msg = e.to_string();
        assert!(
            msg.contains("--prompt") && msg.contains("not valid UTF-8"),
            "{msg}"
        );
        let m = cmd(Text::ANY)
            .try_get_matches_from(["t", "-p", "hé"])
            .unwrap();
        assert_eq!(m.get_one::<String>("prompt").unwrap(), "hé");
    }

    #[test]
    fn empty_text_is_refused_where_it_means_nothing() {
        let e = cmd(Text::NON_EMPTY)
            .try_get_matches_from(["t", "-p", ""])
            .unwrap_err();
        assert!(e.to_string().contains("must not be empty"), "{e}");
        assert!(cmd(Text::ANY).try_get_matches_from(["t", "-p", ""]).is_ok());
    }

    #[test]
    fn special_files_are_not_models() {
        let e = check_model_path("-m", Path::new("/dev/null")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "-m /dev/null: not a model file or directory but a character device"
        );
        assert!(check_model_path("-m", Path::new("/")).is_ok());
        let e = check_model_path("-m", Path::new("/nonexistent/x")).unwrap_err();
        assert!(
            e.to_string().starts_with("-m /nonexistent/x: No such file"),
            "{e}"
        );
    }

    #[test]
    fn thread_bound() {
        assert_eq!(max_threads(2), 64);
        assert_eq!(max_threads(96), 384);
        assert_eq!(max_threads(usize::MAX), usize::MAX);
        assert_eq!(check_threads("-t", 0), Ok(0));
        let e = check_threads("-t", 100_000).unwrap_err();
        assert!(e.to_string().starts_with("-t 100000: at most"), "{e}");
    }
}

/// `--numerics`: how activations are rounded against the weights, where that is faster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NumericsArg {
    /// f32 activations: results equal the f32 product with the dequantized weights up to the
    /// rounding of the sums.
    Exact,
    /// The default. Activations rounded to 24-bit integers per 32 values (the size of one f32
    /// rounding), integer dot products against Q4_0, Q4_1, Q5_0 and Q8_0 weights in steps of up
    /// to 16 rows on AVX512-VNNI CPUs; everything else as exact. Within the exact path's reference
    /// bounds, not bit-equal to it.
    Int24,
    /// Activations rounded to 16-bit integers per 32 values, integer dot products: on
    /// AVX512-VNNI CPUs against Q4_0, Q4_1, Q5_0 and Q8_0 weights in every step, prefill included
    /// (faster than exact where the step is not bound by memory); on other AVX2 CPUs against
    /// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K in steps of up to 16 rows (slower than exact
    /// there). Not bit-equal to exact.
    Int16,
    /// Activations rounded to bf16 against bf16 weights (quantized weights: their dequantized
    /// values rounded to bf16) in prefill (calls of more than 16 tokens), multiplied by
    /// `vdpbf16ps` (AVX512-BF16 CPUs): faster prefill, not bit-equal to exact.
    Bf16,
    /// Activations rounded to 8-bit integers per 32 values against Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
    /// weights regrouped at load, in every step (AVX512-VNNI or AVX2 CPUs): llama.cpp's arithmetic,
    /// faster decode and batched steps, not bit-equal to exact.
    Int8,
}

impl NumericsArg {
    pub fn numerics(self) -> crate::backend::cpu::Numerics {
        match self {
            NumericsArg::Exact => crate::backend::cpu::Numerics::Exact,
            NumericsArg::Int16 => crate::backend::cpu::Numerics::Int16,
            NumericsArg::Int24 => crate::backend::cpu::Numerics::Int24,
            NumericsArg::Int8 => crate::backend::cpu::Numerics::Int8,
            NumericsArg::Bf16 => crate::backend::cpu::Numerics::Bf16,
        }
    }
}
