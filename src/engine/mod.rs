//! engine (being built)
