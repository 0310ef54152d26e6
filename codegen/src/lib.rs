//! kiln-codegen: will lower a decode program (kiln's own small instruction set) to the CUDA C
//! of one persistent megakernel per decode step.
//!
//! Nothing is implemented yet: the CUDA backend and the megakernel are later milestones. The
//! crate exists so the workspace layout is the one the design fixes, and it deliberately exposes
//! no API until there is a working one.
