//! kiln: a runtime for decoder-only language models.
//!
//! The pipeline runs one way: [`model`] reads files into a [`model::ModelConfig`] and
//! [`model::Weights`]; [`graph`] builds a typed IR per architecture and fuses it; [`plan`] lowers
//! the graph to an [`plan::ExecutionPlan`] per phase (prefill, decode) with buffers reused by
//! liveness; [`backend`] executes plans; [`engine`] drives generation over a [`kv::KvCache`].
//! [`files`] opens the files a model names and parses the GGUF container, beneath both [`model`]
//! and [`tokenizer`]. [`cli`] is what the binaries share to turn hostile input into messages.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod dump;
pub mod engine;
pub mod files;
pub mod graph;
pub mod huge_pages;
pub mod kv;
pub mod model;
pub mod plan;
pub mod sample;
pub mod server;
pub mod tokenizer;
