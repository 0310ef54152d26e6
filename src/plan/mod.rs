//! plan (being built)
