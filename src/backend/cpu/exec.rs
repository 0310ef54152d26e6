//! The plan interpreter: one match arm per op, reading and writing column slots of the
//! workspace's buffers.

use super::attention::{self, AttentionShape};
use super::matmul::{self, PackedMatrix};
use super::{elementwise, norm, par, rope, CpuBackend};
use crate::backend::TokenRow;
use crate::graph::{Epilogue, Op, Rows};
use crate::kv::KvCache;
use crate::plan::{ExecutionPlan, Operand, Slot};

/// Per-session scratch memory: the plan's buffers plus kernel temporaries. Grows to the largest
/// step seen and is reused after that, so steady-state decode allocates nothing here.
#[derive(Default)]
pub struct Workspace {
    buffers: Vec<Vec<f32>>,
    normed: Vec<f32>,
    gated: Vec<f32>,
    angles: Vec<(f32, f32)>,
    /// The same for the graph's local RoPE frequencies (empty when it has none).
    angles_local: Vec<(f32, f32)>,
    /// Per-instruction wall time summed over steps, when profiling is on.
    profile: Option<Vec<std::time::Duration>>,
}

impl Workspace {
    pub fn new() -> Workspace {
        Workspace::default()
    }

    /// Starts (or restarts) timing every instruction of the plans this workspace runs.
    pub fn enable_profile(&mut self) {
        self.profile = Some(Vec::new());
    }

    /// Time spent in each instruction (indexed like the plan's instructions) since
    /// [`Workspace::enable_profile`]; `None` when profiling is off.
    pub fn profile(&self) -> Option<&[std::time::Duration]> {
        self.profile.as_deref()
    }
}

/// A read-only row view of a slot.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    stride: usize,
    col: usize,
    cols: usize,
}

impl<'a> View<'a> {
    fn row(&self, t: usize) -> &'a [f32] {
        let at = t * self.stride + self.col;
        &self.data[at..at + self.cols]
    }
}

fn row_mut(data: &mut [f32], stride: usize, s: Slot, t: usize) -> &mut [f32] {
    let at = t * stride + s.col;
    &mut data[at..at + s.cols]
}

/// Elements below which per-row work stays on the calling thread: waking the pool costs
/// microseconds, about what this many elements of SiLU or RMSNorm take.
const PAR_ELEMS: usize = 1 << 16;

/// `f(t, row t)` for rows `0..rows` of `data` (row `t` at `t·stride + s.col`, `s.cols` wide),
/// spread over the thread pool when the rows hold at least [`PAR_ELEMS`] elements (prefill
/// chunks). Each row's result is the same either way.
fn for_rows(
    data: &mut [f32],
    stride: usize,
    s: Slot,
    rows: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    if rows < 2 || rows * s.cols < PAR_ELEMS {
        for t in 0..rows {
            f(t, row_mut(data, stride, s, t));
        }
    } else {
        par::for_each_chunk_mut(&mut data[..rows * stride], stride, |t, row| {
            f(t, &mut row[s.col..s.col + s.cols])
        });
    }
}

/// How an instruction takes part in rotating queries and keys inside attention: in a step of
/// one token, the two `Rope` instructions just before an `Attention` that alone reads their
/// outputs are skipped, and the attention rotates its inputs itself
/// ([`attention::Rotation`]), each of its tasks its own heads, beside writing its own KV head
/// to the cache. Steps of more tokens run every instruction as planned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Deferral {
    /// Runs as planned.
    Planned,
    /// A `Rope` that the attention after it applies in one-token steps.
    Deferred,
    /// An `Attention` that applies the ropes of instructions `q` and `k` in one-token steps.
    Rotates { q: usize, k: usize },
}

/// Whether slots `a` and `b` share any column of one buffer.
fn overlap(a: Slot, b: Slot) -> bool {
    a.buffer == b.buffer && a.col < b.col + b.cols && b.col < a.col + a.cols
}

/// Each instruction's [`Deferral`] in `plan`.
pub(super) fn deferrals(plan: &ExecutionPlan) -> Vec<Deferral> {
    let mut out = vec![Deferral::Planned; plan.instrs.len()];
    for (idx, ins) in plan.instrs.iter().enumerate() {
        if let Some((q, k)) = deferred_ropes(plan, idx, ins) {
            out[q] = Deferral::Deferred;
            out[k] = Deferral::Deferred;
            out[idx] = Deferral::Rotates { q, k };
        }
    }
    out
}

/// The instructions of the q and k ropes that attention instruction `idx` can apply itself:
/// the two instructions just before it, ropes of its heads' width (the graph's rope's) and
/// count (the same frequencies for both) whose outputs are its q and k inputs, whose inputs lie
/// outside its output buffer and theirs, and whose outputs no later instruction reads before
/// one overwrites them whole.
fn deferred_ropes(
    plan: &ExecutionPlan,
    idx: usize,
    ins: &crate::plan::Instr,
) -> Option<(usize, usize)> {
    let Op::Attention {
        heads,
        kv_heads,
        head_dim,
        ..
    } = ins.op
    else {
        return None;
    };
    let (q_in, k_in) = (ins.inputs.first()?.slot()?, ins.inputs.get(1)?.slot()?);
    let out = *ins.outputs.first()?;
    let before = [idx.checked_sub(1)?, idx.checked_sub(2)?];
    let find = |slot: Slot, want_heads: usize| {
        before.into_iter().find(|&j| {
            let r = &plan.instrs[j];
            matches!(r.op, Op::Rope { heads: h, head_dim: d, .. } if h == want_heads && d == head_dim)
                && r.outputs.first() == Some(&slot)
        })
    };
    // The step's angles are the graph's rope's, `head_dim / 2` a row.
    if head_dim != plan.graph.rope.head_dim {
        return None;
    }
    let (q, k) = (find(q_in, heads)?, find(k_in, kv_heads)?);
    if q == k {
        return None;
    }
    let local = |j: usize| match plan.instrs[j].op {
        Op::Rope { local, .. } => local,
        _ => false,
    };
    if local(q) != local(k) {
        return None;
    }
    let sources = [
        plan.instrs[q].inputs.first()?.slot()?,
        plan.instrs[k].inputs.first()?.slot()?,
    ];
    let rotated = [q_in, k_in];
    if sources
        .iter()
        .any(|&src| src.buffer == out.buffer || rotated.iter().any(|&r| overlap(r, src)))
    {
        return None;
    }
    // No later reader of either rotated slot while it still holds the rotation.
    for r in rotated {
        for later in &plan.instrs[idx + 1..] {
            if later
                .inputs
                .iter()
                .filter_map(Operand::slot)
                .any(|s| overlap(s, r))
            {
                return None;
            }
            if later
                .outputs
                .iter()
                .any(|o| o.buffer == r.buffer && o.col <= r.col && r.col + r.cols <= o.col + o.cols)
            {
                break;
            }
        }
    }
    Some((q, k))
}

/// `mats[i]` is the index into `be.matrices` of the matrix instruction `i` reads; `logit_rows`,
/// when given, replaces the last row of each sequence as the rows the `LastRow` op keeps.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    be: &CpuBackend,
    plan: &ExecutionPlan,
    mats: &[Option<usize>],
    deferred: &[Deferral],
    ws: &mut Workspace,
    kv: &mut KvCache,
    tokens: &[u32],
    rows: &[TokenRow],
    logit_rows: Option<&[usize]>,
    logits: &mut Vec<f32>,
) -> usize {
    let n_tok = tokens.len();
    // The rows that get logits: those the caller chose (checked increasing and in range), or
    // the last token of each run of same-slot tokens, which ends a sequence.
    let seq_last: Vec<usize> = match logit_rows {
        Some(chosen) => chosen.to_vec(),
        None => (0..n_tok)
            .filter(|&t| t + 1 == n_tok || rows[t + 1].slot != rows[t].slot)
            .collect(),
    };
    let n_rows = |r: Rows| match r {
        Rows::Tokens => n_tok,
        Rows::Sequences => seq_last.len(),
    };
    ws.buffers.resize_with(plan.buffers.len(), Vec::new);
    for (b, desc) in ws.buffers.iter_mut().zip(&plan.buffers) {
        let need = n_rows(desc.rows) * desc.cols;
        if b.len() < need {
            b.resize(need, 0.0);
        }
    }
    let half = plan.graph.rope.head_dim / 2;
    let one_token = n_tok == 1;
    ws.angles.clear();
    ws.angles_local.clear();
    for r in rows {
        rope::push_angles(&be.inv_freq, r.pos, &mut ws.angles);
        rope::push_angles(&be.inv_freq_local, r.pos, &mut ws.angles_local);
    }

    if let Some(p) = &mut ws.profile {
        p.resize(plan.instrs.len(), std::time::Duration::ZERO);
    }
    for (idx, ins) in plan.instrs.iter().enumerate() {
        if one_token && deferred[idx] == Deferral::Deferred {
            // The attention after it rotates its input.
            continue;
        }
        let started = ws.profile.is_some().then(std::time::Instant::now);
        let out_slot = ins.outputs[0];
        let ob = out_slot.buffer;
        let stride = plan.buffers[ob].cols;
        let rows_out = n_rows(plan.buffers[ob].rows);
        let mut out = std::mem::take(&mut ws.buffers[ob]);
        {
            let bufs = &ws.buffers;
            let view = |o: &Operand| -> View<'_> {
                let s = o.slot().expect("token ids read as activations");
                let data: &[f32] = if s.buffer == ob { &[] } else { &bufs[s.buffer] };
                View {
                    data,
                    stride: plan.buffers[s.buffer].cols,
                    col: s.col,
                    cols: s.cols,
                }
            };
            match &ins.op {
                Op::TokenIds => unreachable!("the plan has no instruction for the input"),
                Op::Embed { dim, .. } => {
                    let m = &be.matrices[mats[idx].expect("embed has a packed table")];
                    for (t, &id) in tokens.iter().enumerate() {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        m.data.row_f32(id as usize, *dim, dst);
                    }
                }
                Op::RmsNorm(n) => {
                    let x = view(&ins.inputs[0]);
                    let w = n.weight.as_ref().map(|w| be.vectors[w].as_slice());
                    for_rows(&mut out, stride, out_slot, rows_out, |t, dst| {
                        norm::rms_norm(x.row(t), w, n.eps, dst)
                    });
                }
                Op::MatMul {
                    norm: pre,
                    epilogue,
                    ..
                } => {
                    let m: &PackedMatrix =
                        &be.matrices[mats[idx].expect("matmul has a packed matrix")];
                    let x = view(&ins.inputs[0]);
                    let k = x.cols;
                    // The prologue normalises the input rows into scratch.
                    let (xs, ldx, xoff): (&[f32], usize, usize) = match pre {
                        Some(n) => {
                            ws.normed.resize(rows_out * k, 0.0);
                            let w = n.weight.as_ref().map(|w| be.vectors[w].as_slice());
                            let whole = Slot {
                                buffer: ob,
                                col: 0,
                                cols: k,
                            };
                            for_rows(&mut ws.normed, k, whole, rows_out, |t, dst| {
                                norm::rms_norm(x.row(t), w, n.eps, dst)
                            });
                            (&ws.normed, k, 0)
                        }
                        None => (x.data, x.stride, x.col),
                    };
                    let xs = &xs[xoff..];
                    match epilogue {
                        Epilogue::None => matmul::matmul(
                            be.numerics,
                            m,
                            xs,
                            ldx,
                            rows_out,
                            &mut out[out_slot.col..],
                            stride,
                            false,
                        ),
                        Epilogue::Activation(a) => {
                            matmul::matmul(
                                be.numerics,
                                m,
                                xs,
                                ldx,
                                rows_out,
                                &mut out[out_slot.col..],
                                stride,
                                false,
                            );
                            for_rows(&mut out, stride, out_slot, rows_out, |_, dst| {
                                elementwise::act_inplace(dst, *a)
                            });
                        }
                        Epilogue::ResidualAdd => {
                            if !ins.in_place {
                                let r = view(&ins.inputs[1]);
                                for t in 0..rows_out {
                                    row_mut(&mut out, stride, out_slot, t)
                                        .copy_from_slice(r.row(t));
                                }
                            }
                            matmul::matmul(
                                be.numerics,
                                m,
                                xs,
                                ldx,
                                rows_out,
                                &mut out[out_slot.col..],
                                stride,
                                true,
                            )
                        }
                        Epilogue::Gated(a) => {
                            let f = m.rows / 2;
                            ws.gated.resize(rows_out * m.rows, 0.0);
                            matmul::matmul(
                                be.numerics,
                                m,
                                xs,
                                ldx,
                                rows_out,
                                &mut ws.gated,
                                m.rows,
                                false,
                            );
                            let gated = &ws.gated;
                            for_rows(&mut out, stride, out_slot, rows_out, |t, dst| {
                                let g = &gated[t * m.rows..(t + 1) * m.rows];
                                elementwise::gated(&g[..f], &g[f..], *a, dst)
                            });
                        }
                    }
                }
                Op::HeadNorm {
                    head_dim,
                    eps,
                    scale,
                    weight,
                    ..
                } => {
                    let x = view(&ins.inputs[0]);
                    let w = weight.as_ref().map(|w| &be.vectors[w]);
                    for t in 0..rows_out {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        dst.copy_from_slice(x.row(t));
                        norm::head_norm_inplace(dst, *head_dim, *eps);
                        if *scale != 1.0 {
                            dst.iter_mut().for_each(|v| *v *= scale);
                        }
                        if let Some(w) = w {
                            for head in dst.chunks_exact_mut(*head_dim) {
                                head.iter_mut().zip(w.iter()).for_each(|(v, g)| *v *= g);
                            }
                        }
                    }
                }
                Op::Combine { a, b } => {
                    let (x, y) = (view(&ins.inputs[0]), view(&ins.inputs[1]));
                    for t in 0..rows_out {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        for ((d, xv), yv) in dst.iter_mut().zip(x.row(t)).zip(y.row(t)) {
                            *d = a * xv + b * yv;
                        }
                    }
                }
                Op::GatedValueAdd {
                    gate,
                    channels,
                    kv_heads,
                    head_dim,
                    scale,
                } => {
                    let (v, h, ve) = (
                        view(&ins.inputs[0]),
                        view(&ins.inputs[1]),
                        view(&ins.inputs[2]),
                    );
                    let wg = &be.vectors[gate];
                    for t in 0..rows_out {
                        let hr = &h.row(t)[..*channels];
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        dst.copy_from_slice(v.row(t));
                        let ver = ve.row(t);
                        for g in 0..*kv_heads {
                            let z: f32 = hr
                                .iter()
                                .zip(&wg[g * channels..(g + 1) * channels])
                                .map(|(a, b)| a * b)
                                .sum();
                            let gv = scale / (1.0 + (-z).exp());
                            let r = g * head_dim..(g + 1) * head_dim;
                            for (d, e) in dst[r.clone()].iter_mut().zip(&ver[r]) {
                                *d += gv * e;
                            }
                        }
                    }
                }
                Op::Smear {
                    gate,
                    lambda,
                    channels,
                } => {
                    let e = view(&ins.inputs[0]);
                    let wg = &be.vectors[gate];
                    for t in 0..rows_out {
                        let er = e.row(t);
                        let r = rows[t];
                        let prev: Option<&[f32]> = if t > 0 && rows[t - 1].slot == r.slot {
                            Some(e.row(t - 1))
                        } else if r.pos > 0 {
                            Some(kv.state(r.slot, r.pos - 1))
                        } else {
                            None
                        };
                        let z: f32 = er[..*channels]
                            .iter()
                            .zip(wg.iter())
                            .map(|(a, b)| a * b)
                            .sum();
                        let g = lambda / (1.0 + (-z).exp());
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        match prev {
                            Some(p) => {
                                for ((d, x), y) in dst.iter_mut().zip(er).zip(p) {
                                    *d = x + g * y;
                                }
                            }
                            None => dst.copy_from_slice(er),
                        }
                    }
                    // The pre-smear embeddings are what later positions smear with.
                    for (t, r) in rows.iter().enumerate() {
                        kv.write_state(r.slot, r.pos, e.row(t));
                    }
                }
                Op::Rope {
                    head_dim, local, ..
                } => {
                    let x = view(&ins.inputs[0]);
                    let angles = if *local { &ws.angles_local } else { &ws.angles };
                    let style = plan.graph.rope.style;
                    for_rows(&mut out, stride, out_slot, rows_out, |t, dst| {
                        dst.copy_from_slice(x.row(t));
                        rope::apply(dst, *head_dim, style, &angles[t * half..(t + 1) * half]);
                    });
                }
                Op::Attention {
                    layer,
                    heads,
                    kv_heads,
                    head_dim,
                    scale,
                    window,
                } => {
                    let (mut q, mut k, v) = (
                        view(&ins.inputs[0]),
                        view(&ins.inputs[1]),
                        view(&ins.inputs[2]),
                    );
                    // The ropes skipped above: their inputs, rotated here.
                    let rotate = match deferred[idx] {
                        Deferral::Rotates { q: iq, k: ik } if one_token => {
                            q = view(&plan.instrs[iq].inputs[0]);
                            k = view(&plan.instrs[ik].inputs[0]);
                            let local = matches!(plan.instrs[iq].op, Op::Rope { local: true, .. });
                            Some(attention::Rotation {
                                angles: if local { &ws.angles_local } else { &ws.angles },
                                style: plan.graph.rope.style,
                            })
                        }
                        _ => None,
                    };
                    let shape = AttentionShape {
                        layer: *layer,
                        heads: *heads,
                        kv_heads: *kv_heads,
                        head_dim: *head_dim,
                        scale: *scale,
                        window: *window,
                    };
                    attention::attention(
                        be.numerics,
                        &shape,
                        rows,
                        (q.data, q.stride, q.col),
                        (k.data, k.stride, k.col),
                        (v.data, v.stride, v.col),
                        kv,
                        (&mut out, stride, out_slot.col),
                        rotate,
                    );
                }
                Op::Add | Op::Mul => {
                    let (a, b) = (view(&ins.inputs[0]), view(&ins.inputs[1]));
                    for t in 0..rows_out {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        if ins.op == Op::Add {
                            elementwise::add(a.row(t), b.row(t), dst);
                        } else {
                            elementwise::mul(a.row(t), b.row(t), dst);
                        }
                    }
                }
                Op::Act(a) => {
                    let x = view(&ins.inputs[0]);
                    for t in 0..rows_out {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        dst.copy_from_slice(x.row(t));
                        elementwise::act_inplace(dst, *a);
                    }
                }
                Op::Softcap { cap } => {
                    let x = view(&ins.inputs[0]);
                    for t in 0..rows_out {
                        let dst = row_mut(&mut out, stride, out_slot, t);
                        dst.copy_from_slice(x.row(t));
                        elementwise::softcap_inplace(dst, *cap);
                    }
                }
                Op::LastRow => {
                    let x = view(&ins.inputs[0]);
                    for (s, &t) in seq_last.iter().enumerate() {
                        row_mut(&mut out, stride, out_slot, s).copy_from_slice(x.row(t));
                    }
                }
            }
        }
        ws.buffers[ob] = out;
        if let (Some(t0), Some(p)) = (started, &mut ws.profile) {
            p[idx] += t0.elapsed();
        }
    }

    let o = plan.output;
    let stride = plan.buffers[o.buffer].cols;
    let n = n_rows(plan.buffers[o.buffer].rows);
    hand_over_logits(
        &mut ws.buffers[o.buffer],
        (stride, o.col, o.cols),
        n,
        logits,
    );
    n
}

/// Puts the `n` rows of logits (`cols` wide, at `col` in rows `stride` apart) of the plan's
/// output buffer into `logits`. Where the buffer holds exactly those rows and nothing else
/// (a decode step's vocabulary-wide rows) and the caller's vector can hold them, the two
/// vectors trade places instead of copying: the caller's becomes the buffer the next step's
/// head writes whole. A SmolLM2 decode step copied 192 KiB here, ~16 µs of a 2.6 ms step
/// (2 threads of a 2-vCPU AMD EPYC Zen 5); a caller that passes a new vector every step gets a
/// copy, as before, rather than an allocation for the workspace.
fn hand_over_logits(
    buffer: &mut Vec<f32>,
    (stride, col, cols): (usize, usize, usize),
    n: usize,
    logits: &mut Vec<f32>,
) {
    let need = n * cols;
    if col == 0 && stride == cols && buffer.len() == need && logits.capacity() >= need {
        std::mem::swap(buffer, logits);
        // Within capacity: no allocation. Its contents do not matter: a step writes every
        // buffer before it reads it, as it did with the last step's values left there.
        buffer.resize(need, 0.0);
        return;
    }
    logits.clear();
    for t in 0..n {
        let at = t * stride + col;
        logits.extend_from_slice(&buffer[at..at + cols]);
    }
}

#[cfg(test)]
mod tests {
    use super::hand_over_logits;

    /// Rows of `cols` values at `col` in rows `stride` apart, numbered so that every value
    /// says where it came from.
    fn buffer(n: usize, stride: usize) -> Vec<f32> {
        (0..n * stride).map(|i| i as f32).collect()
    }

    #[test]
    fn a_buffer_of_exactly_the_logits_trades_places_with_a_large_enough_vector() {
        let (n, cols) = (2, 5);
        let mut buf = buffer(n, cols);
        let want = buf.clone();
        let mut logits = Vec::with_capacity(n * cols);
        let ptr = buf.as_ptr();
        hand_over_logits(&mut buf, (cols, 0, cols), n, &mut logits);
        assert_eq!(logits, want);
        assert_eq!(logits.as_ptr(), ptr, "the buffer itself was handed over");
        assert_eq!(
            buf.len(),
            n * cols,
            "the workspace keeps a buffer of the same size"
        );
        // The next step hands back the vector it got.
        buf.copy_from_slice(&want.iter().map(|x| x + 100.0).collect::<Vec<_>>());
        let ptr = buf.as_ptr();
        hand_over_logits(&mut buf, (cols, 0, cols), n, &mut logits);
        assert_eq!(logits[0], 100.0);
        assert_eq!(logits.as_ptr(), ptr);
    }

    #[test]
    fn other_buffers_and_small_vectors_are_copied() {
        // Logits at a column offset, in a buffer with more rows than asked for, into a new
        // vector: each a copy of the rows asked for.
        let cases = [(3, 4, 1, 2, 6), (2, 4, 0, 4, 3), (2, 4, 0, 4, 2)];
        for (n, stride, col, cols, rows_in_buffer) in cases {
            let mut buf = buffer(rows_in_buffer, stride);
            let before = buf.clone();
            let mut logits = Vec::new();
            hand_over_logits(&mut buf, (stride, col, cols), n, &mut logits);
            let want: Vec<f32> = (0..n)
                .flat_map(|t| before[t * stride + col..t * stride + col + cols].to_vec())
                .collect();
            assert_eq!(logits, want, "n {n} stride {stride} col {col} cols {cols}");
            assert_eq!(buf, before, "the workspace's buffer is left as it was");
        }
    }
}
