//! Errors raised while reading model files. Every variant names the file and, where there is one,
//! the tensor or config field, so a user can tell what to fix without a debugger.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{path}: config field `{field}`: {reason}")]
    Config {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error("{path}: unsupported architecture `{found}` (kiln supports: {supported})")]
    UnknownArchitecture {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype}")]
    DType {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: tensor `{name}`: {reason}")]
    Tensor {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LoadError::Io {
            path: path.into(),
            source,
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
