//! The speculative-decoding flags `kiln` and `kiln-bench` share: `--spec ngram|draft`,
//! `--draft MODEL`, `--draft-max K`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, ValueEnum};

use super::args::{check_model_path, ArgError};
use crate::engine::{Engine, SpecError, SpecOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SpecKind {
    /// Prompt lookup: the continuation of the longest earlier match in the sequence's tokens.
    Ngram,
    /// A smaller model with the same tokenizer (`--draft`).
    Draft,
}

#[derive(Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding: `ngram` (prompt lookup, no second model) or `draft` (`--draft`).
    /// Greedy output is unchanged, sampled output keeps its distribution.
    #[arg(long, value_enum)]
    pub spec: Option<SpecKind>,
    /// The draft model for `--spec draft` (a directory or .gguf with the model's tokenizer).
    #[arg(long, value_name = "MODEL")]
    pub draft: Option<PathBuf>,
    /// Most tokens proposed per verification pass (adapted to the acceptance rate below it).
    #[arg(long, value_name = "K", default_value_t = 4)]
    pub draft_max: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SpecArgError {
    #[error("--spec draft needs --draft MODEL")]
    NoDraft,
    #[error("--draft is only used with --spec draft")]
    DraftUnused,
    #[error("--draft-max must be at least 1")]
    DraftMax,
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error(transparent)]
    Spec(#[from] SpecError),
}

impl SpecArgs {
    /// Checks what can be checked before any model is loaded.
    pub fn check(&self) -> Result<(), SpecArgError> {
        if self.draft_max == 0 {
            return Err(SpecArgError::DraftMax);
        }
        match (self.spec, &self.draft) {
            (Some(SpecKind::Draft), None) => Err(SpecArgError::NoDraft),
            (Some(SpecKind::Draft), Some(path)) => Ok(check_model_path("--draft", path)?),
            (_, Some(_)) => Err(SpecArgError::DraftUnused),
            _ => Ok(()),
        }
    }

    /// The draft model to load, if the flags name one that is used.
    pub fn draft_path(&self) -> Option<&Path> {
        match self.spec {
            Some(SpecKind::Draft) => self.draft.as_deref(),
            _ => None,
        }
    }

    /// The options the flags ask for (`None` without `--spec`), given the model
    /// [`SpecArgs::draft_path`] named, loaded; refused unless it shares `target`'s vocabulary.
    pub fn options(
        &self,
        target: &Engine,
        draft: Option<Arc<Engine>>,
    ) -> Result<Option<SpecOptions>, SpecArgError> {
        self.check()?;
        Ok(match (self.spec, draft) {
            (None, _) => None,
            (Some(SpecKind::Ngram), _) => Some(SpecOptions::ngram(self.draft_max)?),
            (Some(SpecKind::Draft), None) => return Err(SpecArgError::NoDraft),
            (Some(SpecKind::Draft), Some(d)) => {
                Some(SpecOptions::draft(target, d, self.draft_max)?)
            }
        })
    }
}
