//! kv (being built)
