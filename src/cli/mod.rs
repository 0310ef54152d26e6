//! What the three binaries (`kiln`, `kiln-dump`, `kiln-bench`) share so that hostile input —
//! absurd numbers, non-UTF-8 text, a closed pipe, a full disk — ends in a one-line message and
//! never in a panic, an aborted allocation or a hang.
//!
//! * [`output`]: stdout and stderr writes that handle their errors.
//! * [`memory`]: the memory an allocation may take on this machine, now.
//! * [`context`]: the size of a session's KV cache, from what is needed, what was asked for and
//!   what memory allows.
//! * [`args`]: UTF-8 text flags, thread counts, model paths.
//! * [`input`]: prompts from a file or stdin, chat lines.
//! * [`spec`]: the speculative-decoding flags.
//! * [`kiln_args`]: the `kiln` binary's command line, parsed and checked without a model.
//! * [`serve_args`]: `kiln serve`'s command line, likewise.

pub mod args;
pub mod context;
pub mod input;
pub mod kiln_args;
pub mod memory;
pub mod output;
pub mod serve_args;
pub mod spec;
