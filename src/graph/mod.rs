//! graph (being built)
