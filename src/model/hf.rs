//! Hugging Face model directories.
use std::path::Path;

use super::{LoadError, Model};

pub fn load(path: &Path) -> Result<Model, LoadError> {
    Err(LoadError::format(path, "not yet"))
}
