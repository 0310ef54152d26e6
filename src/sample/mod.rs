//! sample (being built)
