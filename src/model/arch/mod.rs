//! One graph builder per architecture family.
