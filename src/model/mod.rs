//! Reading models from disk: Hugging Face directories and GGUF files.

mod arch_weights;
mod config;
pub mod gguf;
pub mod hf;
pub mod quant;
pub mod synthetic;
mod tensor;
pub(crate) mod validate;
mod vocab;

use std::path::{Path, PathBuf};

pub use crate::files::{escape, Escaped, EscapedPath, LoadError};
pub use config::{Architecture, Gemma3Params, ModelConfig, NanochatNative, RopeScaling, RopeStyle};
pub use tensor::{DType, Tensor, TensorBytes, Weights};

use crate::tokenizer::Tokenizer;

/// A model ready to be compiled: what it is, its weights, and how to talk to it.
pub struct Model {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    /// How the file stored its weights, for reports (`"bf16"`, `"Q4_1"`, ...).
    pub weight_type: String,
}

impl Model {
    /// Loads a Hugging Face model directory or a `.gguf` file, chosen by what `path` is.
    /// Anything else (a FIFO, a device, a socket) is refused before it is opened.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, LoadError> {
        let path = path.as_ref();
        let meta = crate::files::file_or_dir(path)?;
        let mut model = if meta.is_dir() {
            hf::load(path)?
        } else {
            gguf::load(path)?
        };
        model
            .tokenizer
            .limit_prompts_to(model.config.max_position_embeddings);
        Ok(model)
    }
}
