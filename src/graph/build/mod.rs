//! One graph builder per architecture family (`graph::build` in the design's pipeline). Builders check every weight they reference
//! against the shape the config implies, so a wrong file fails at load with the tensor's name.

mod gemma3;
mod llama;
mod mistral;
mod nanochat;
mod phi3;
mod qwen3;

use crate::graph::{Graph, KvSpec, Linear, Norm, Op, RopeSpec, Value};
use crate::model::validate::{self, Keys};
use crate::model::{Architecture, LoadError, ModelConfig, Weights};

/// Which token rows get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last token of each sequence (what generation needs).
    Last,
    /// Every token (for scoring and for checking against a reference).
    All,
}

/// Builds the unoptimised graph of one forward step.
pub fn build_graph(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    // Loaders validate with the file's own key names; this catches configs built any other way
    // before a single size is computed from them.
    validate::check(&weights.source, config, &Keys::config())?;
    match config.architecture {
        Architecture::Llama => llama::build(config, weights, logits),
        Architecture::Mistral => mistral::build(config, weights, logits),
        Architecture::Qwen3 => qwen3::build(config, weights, logits),
        Architecture::Phi3 => phi3::build(config, weights, logits),
        Architecture::Gemma3 => gemma3::build(config, weights, logits),
        Architecture::NanoChat => nanochat::build(config, weights, logits),
    }
}

/// Helpers shared by the builders.
pub(crate) struct Builder<'a> {
    pub g: Graph,
    pub config: &'a ModelConfig,
    pub weights: &'a Weights,
}

impl<'a> Builder<'a> {
    pub fn new(config: &'a ModelConfig, weights: &'a Weights) -> Builder<'a> {
        let g = Graph::new(
            RopeSpec {
                theta: config.rope_theta,
                head_dim: config.head_dim,
                style: config.rope_style,
                scaling: config.rope_scaling,
            },
            KvSpec {
                layers: config.num_layers,
                kv_heads: config.num_kv_heads,
                head_dim: config.head_dim,
                state_dim: match &config.nanochat {
                    Some(n) if n.smear => config.hidden_size,
                    _ => 0,
                },
            },
            config.vocab_size,
        );
        Builder { g, config, weights }
    }

    /// A linear layer `name.weight` of shape `[out, inp]`, with `name.bias` when present.
    pub fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, LoadError> {
        self.linear_rows(name, out, out, inp)
    }

    /// A linear layer using the first `out` of the `rows` rows its weight has (padded vocab).
    pub fn linear_rows(
        &self,
        name: &str,
        out: usize,
        rows: usize,
        inp: usize,
    ) -> Result<Linear, LoadError> {
        let wname = format!("{name}.weight");
        let w = self.weights.get_shaped(&wname, &[rows, inp])?;
        let bname = format!("{name}.bias");
        let bias = if self.weights.contains(&bname) {
            self.weights.get_shaped(&bname, &[out])?;
            Some(bname)
        } else {
            None
        };
        Ok(Linear {
            weight: wname,
            bias,
            out,
            inp,
            weight_bytes: w.raw().len(),
        })
    }

    pub fn matmul(&mut self, x: Value, l: Linear, label: String) -> Value {
        let cols = l.out;
        self.g.push1(
            Op::MatMul {
                linears: vec![l],
                norm: None,
                epilogue: crate::graph::Epilogue::None,
            },
            vec![x],
            cols,
            label,
        )
    }

    pub fn rms_norm(
        &mut self,
        x: Value,
        weight: Option<&str>,
        label: String,
    ) -> Result<Value, LoadError> {
        let cols = self.g.shape(x).cols;
        let weight = match weight {
            Some(w) => {
                self.weights.get_shaped(w, &[cols])?;
                Some(w.to_string())
            }
            None => None,
        };
        Ok(self.g.push1(
            Op::RmsNorm(Norm {
                weight,
                eps: self.config.rms_norm_eps,
            }),
            vec![x],
            cols,
            label,
        ))
    }

    /// The token embedding from a table of `rows` rows (≥ vocab_size when padded).
    pub fn embed_rows(&mut self, table: &str, rows: usize) -> Result<Value, LoadError> {
        self.embed_table(table, rows, self.config.hidden_size, "embed".into())
    }

    /// Rows of an embedding-like table `[rows, dim]` picked by the step's token ids.
    pub fn embed_table(
        &mut self,
        table: &str,
        rows: usize,
        dim: usize,
        label: String,
    ) -> Result<Value, LoadError> {
        let t = self.weights.get_shaped(table, &[rows, dim])?;
        let ids = self.g.token_ids();
        Ok(self.g.push1(
            Op::Embed {
                table: table.to_string(),
                dim,
                row_bytes: t.dtype.row_bytes(dim),
            },
            vec![ids],
            dim,
            label,
        ))
    }

    /// Rows of a vocabulary table (embedding or head): the tensor's own row count, which may
    /// exceed `vocab_size` when the file pads the vocabulary (Qwen2.5: 151,936 rows for
    /// 151,665 tokens); the padded rows are never looked up and never become logits. A table
    /// with fewer rows than the vocabulary fails the shape check where it is used.
    pub fn vocab_rows(&self, table: &str) -> Result<usize, LoadError> {
        let t = self.weights.get(table)?;
        Ok(t.shape
            .first()
            .copied()
            .unwrap_or(0)
            .max(self.config.vocab_size))
    }

    /// RoPE over `heads` heads, with the local layers' frequencies when `local` is set.
    pub fn rope(&mut self, x: Value, heads: usize, local: bool, label: String) -> Value {
        let head_dim = self.config.head_dim;
        self.op1(
            Op::Rope {
                heads,
                head_dim,
                local,
            },
            vec![x],
            label,
        )
    }

    /// Per-head RMSNorm with a `[head_dim]` weight shared by the heads (q/k norm).
    pub fn head_norm(
        &mut self,
        x: Value,
        heads: usize,
        weight: &str,
        label: String,
    ) -> Result<Value, LoadError> {
        let head_dim = self.config.head_dim;
        self.weights.get_shaped(weight, &[head_dim])?;
        Ok(self.op1(
            Op::HeadNorm {
                heads,
                head_dim,
                eps: self.config.rms_norm_eps,
                scale: 1.0,
                weight: Some(weight.to_string()),
            },
            vec![x],
            label,
        ))
    }

    pub fn op1(&mut self, op: Op, inputs: Vec<Value>, label: String) -> Value {
        let cols = self.g.shape(inputs[0]).cols;
        self.g.push1(op, inputs, cols, label)
    }

    pub fn finish(mut self, output: Value) -> Graph {
        self.g.output = output;
        self.g
    }
}
