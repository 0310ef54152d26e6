//! Errors raised while reading model files. Every variant names the file and, where there is one,
//! the tensor or config field, so a user can tell what to fix without a debugger.
//!
//! Everything a message quotes may come from a hostile file (tensor names, keys, architecture
//! strings, paths from a shard index), so every string is printed through [`Escaped`]: control
//! characters cannot reach a terminal raw.

use std::fmt;
use std::path::{Path, PathBuf};

/// Displays a string with control and bidirectional-formatting characters escaped (`\u{1b}`),
/// everything else as is.
pub struct Escaped<'a>(pub &'a str);

/// Characters a terminal interprets instead of printing: C0/C1 controls and the Unicode
/// bidirectional overrides that reorder what a reader sees.
fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find(is_unsafe) {
            f.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write!(f, "\\u{{{:x}}}", c as u32)?;
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// A path for a message, lossy for non-UTF-8 bytes and escaped like [`Escaped`].
pub struct EscapedPath<'a>(pub &'a Path);

impl fmt::Display for EscapedPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Escaped(&self.0.to_string_lossy()).fmt(f)
    }
}

/// `s` with unsafe characters escaped, as an owned string (for reasons built by callers).
pub fn escape(s: &str) -> String {
    Escaped(s).to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The I/O error is part of the message, not a separate `source`, so that printing the
    /// error chain does not repeat it.
    #[error("{}: {error}", EscapedPath(.path))]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: invalid JSON: {}", EscapedPath(.path), Escaped(&.error.to_string()))]
    Json {
        path: PathBuf,
        error: serde_json::Error,
    },
    #[error("{}: {}", EscapedPath(.path), Escaped(.reason))]
    Format { path: PathBuf, reason: String },
    #[error("{}: config field `{}`: {}", EscapedPath(.path), Escaped(.field), Escaped(.reason))]
    Config {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error(
        "{}: unsupported architecture `{}` (kiln supports: {supported})",
        EscapedPath(.path),
        Escaped(.found)
    )]
    UnknownArchitecture {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("{}: missing tensor `{}`", EscapedPath(.path), Escaped(.name))]
    MissingTensor { path: PathBuf, name: String },
    #[error(
        "{}: tensor `{}` has shape {found:?}, expected {expected:?}",
        EscapedPath(.path),
        Escaped(.name)
    )]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error(
        "{}: tensor `{}` has unsupported dtype {}",
        EscapedPath(.path),
        Escaped(.name),
        Escaped(.dtype)
    )]
    DType {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{}: tensor `{}`: {}", EscapedPath(.path), Escaped(.name), Escaped(.reason))]
    Tensor {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{}: tokenizer: {}", EscapedPath(.path), Escaped(.reason))]
    Tokenizer { path: PathBuf, reason: String },
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        LoadError::Io {
            path: path.into(),
            error,
        }
    }

    pub fn json(path: impl Into<PathBuf>, error: serde_json::Error) -> Self {
        LoadError::Json {
            path: path.into(),
            error,
        }
    }

    pub fn format(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        LoadError::Format {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub fn config(path: impl Into<PathBuf>, field: &str, reason: impl Into<String>) -> Self {
        LoadError::Config {
            path: path.into(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    pub fn tensor(path: impl Into<PathBuf>, name: &str, reason: impl Into<String>) -> Self {
        LoadError::Tensor {
            path: path.into(),
            name: name.to_string(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_everywhere() {
        let e = LoadError::UnknownArchitecture {
            path: PathBuf::from("m\u{1b}.gguf"),
            found: "\u{1b}[2Jllama\u{9b}\u{202e}x".into(),
            supported: "llama",
        };
        let s = e.to_string();
        assert_eq!(
            s,
            "m\\u{1b}.gguf: unsupported architecture `\\u{1b}[2Jllama\\u{9b}\\u{202e}x` (kiln supports: llama)"
        );
        let e = LoadError::config("c.json", "a\nb", "bad \u{7} value é");
        assert_eq!(
            e.to_string(),
            "c.json: config field `a\\u{a}b`: bad \\u{7} value é"
        );
    }

    #[test]
    fn io_and_json_causes_print_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = LoadError::io("x.json", io);
        assert!(std::error::Error::source(&e).is_none());
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e = LoadError::json("x.json", json);
        assert!(std::error::Error::source(&e).is_none());
        assert!(
            e.to_string().starts_with("x.json: invalid JSON: EOF"),
            "{e}"
        );
    }
}
