#!/usr/bin/env python3
"""Convert a native nanochat checkpoint (karpathy/nanochat) into a directory kiln can load.

    convert_nanochat.py CHECKPOINT_DIR TOKENIZER_PKL OUT_DIR [--step N] [--softcap 15|20]

CHECKPOINT_DIR holds `model_<step>.pt` (a torch.save'd state dict) and `meta_<step>.json`
(nanochat's base_checkpoints/<tag>, chatsft_checkpoints/<tag> or chatrl_checkpoints/<tag>);
the latest step is used unless --step is given. TOKENIZER_PKL is nanochat's
`tokenizer/tokenizer.pkl` (a pickled tiktoken.core.Encoding).

Writes OUT_DIR/config.json (model_type "nanochat_native"), OUT_DIR/model.safetensors (state-dict
names with `_orig_mod.` stripped, dtypes as saved) and OUT_DIR/tokenizer.json (a Hugging Face
byte-level BPE rebuilt from the tiktoken ranks). The checkpoint has no version field: the
architecture era (A-H, see the nanochat spec section 0) is detected from keys/shapes and the meta
file and printed to stderr. Eras D, E and F have identical keys but different logit softcaps
(15 for D, 20 for E/F); the default is D (15), `--softcap 20` selects E.

config.json fields:
  model_type "nanochat_native"; era "A".."H" (E/F reported as "D" unless --softcap 20 -> "E");
  vocab_size (tokenizer size = meta vocab_size; logits are sliced to it); padded_vocab_size
  (rows of wte/lm_head/value_embeds); n_layer, n_head, n_kv_head, n_embd, head_dim, sequence_len;
  window_pattern (upper-cased meta value, "L" if missing, null for eras A/B); window_sizes
  (per layer W: query at p sees keys p-W..p; -1 = unlimited causal, eras A/B);
  value_embed_layers (layers with value_embeds.{i} + attn.ve_gate, [] before era D);
  rope_theta (1e4 / 1e5 from G); qk_scale (1.0, 1.15 G, 1.2 H; applied to q and k after QK-norm);
  ve_gate_channels (32 D-F, 12 G/H, null) and ve_gate_scale (2.0 / 3.0 / null): gate =
  scale*sigmoid(h[:channels] @ ve_gate^T); softcap (15, 20 for E/F); resid_lambdas (bool, B+);
  smear (bool, H); backout_layer (L//2 for H, else null); rms_norm_eps (1.1920929e-07);
  bos_token_id; special_tokens {bos, user_start, user_end, assistant_start, assistant_end,
  python_start, python_end, output_start, output_end} -> id; source {checkpoint, step, era_reason}.

Requirements: scripts/requirements-nanochat.txt (torch, numpy, safetensors, tiktoken).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ERAS = "ABCDEFGH"
RMS_NORM_EPS = 1.1920929e-07  # FLT_EPSILON: F.rms_norm(eps=None) on fp32
SPECIAL_NAMES = [
    "bos", "user_start", "user_end", "assistant_start", "assistant_end",
    "python_start", "python_end", "output_start", "output_end",
]
SPECIAL_TOKENS = [f"<|{n}|>" for n in SPECIAL_NAMES]
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# checkpoint
# ----------------------------------------------------------------------------------------------


def find_step(ckpt_dir: Path, step: int | None) -> int:
    steps = sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"model_(\d+)\.pt", p.name)))
    if not steps:
        sys.exit(f"error: no model_<step>.pt in {ckpt_dir}")
    if step is None:
        return steps[-1]
    if step not in steps:
        sys.exit(f"error: step {step} not found in {ckpt_dir} (have {steps})")
    return step


def detect_era(sd: dict, model_config: dict, softcap: float | None) -> tuple[str, str]:
    """Returns (era, human-readable reason). Rules: spec section 0 'detect by' column."""
    gates = {k: tuple(v.shape) for k, v in sd.items() if k.endswith(".attn.ve_gate.weight")}
    if "smear_gate.weight" in sd:
        return "H", f"`smear_gate.weight` {tuple(sd['smear_gate.weight'].shape)} present"
    if gates:
        chans = {s[1] for s in gates.values()}
        if len(chans) != 1:
            sys.exit(f"error: inconsistent ve_gate shapes {gates}")
        ch = chans.pop()
        k0 = sorted(gates)[0]
        if ch == 12:
            return "G", f"`{k0}` shape {gates[k0]} (12 gate channels), no `smear_gate.weight`"
        if ch == 32:
            why = f"`{k0}` shape {gates[k0]} (32 gate channels): era D/E/F, identical keys; "
            if softcap == 20:
                return "E", why + "--softcap 20 given -> E (softcap 20; E and F are the same at inference in fp32)"
            return "D", why + "reported as D (softcap 15); pass --softcap 20 for an E/F checkpoint (2026-03-02..03-09)"
        sys.exit(f"error: unknown ve_gate channel count {ch} ({k0} {gates[k0]})")
    if any(k.startswith("value_embeds.") for k in sd):
        sys.exit("error: value_embeds.* present but no attn.ve_gate.weight")
    if "resid_lambdas" in sd:
        if "window_pattern" in model_config:
            return "C", "`resid_lambdas` present, no `value_embeds.*`, meta model_config has `window_pattern`"
        return "B", "`resid_lambdas` present, no `value_embeds.*`, meta model_config lacks `window_pattern`"
    return "A", "no `resid_lambdas` key (original architecture)"


def short_window(era: str, S: int) -> int:
    if era in "CDEF":
        return S // 2
    if era == "G":
        return -(-S // 3 // 128) * 128
    return -(-S // 4 // 128) * 128  # H


def resolve(era: str, mc: dict, padded_vocab: int, softcap_override: float | None) -> dict:
    L, S = mc["n_layer"], mc["sequence_len"]
    after = lambda e: ERAS.index(era) >= ERAS.index(e)  # noqa: E731
    if after("C"):
        pattern = str(mc.get("window_pattern") or "L").upper()
        short = short_window(era, S)
        ws = [S if pattern[i % len(pattern)] == "L" else short for i in range(L)]
        ws[-1] = S
    else:
        pattern = None
        ws = [-1] * L
    ve_layers = [i for i in range(L) if i % 2 == (L - 1) % 2] if after("D") else []
    softcap = 20.0 if era in "EF" else 15.0
    if softcap_override is not None and softcap_override != softcap:
        log(f"warning: --softcap {softcap_override:g} overrides era {era}'s softcap {softcap:g}")
        softcap = float(softcap_override)
    return {
        "window_pattern": pattern,
        "window_sizes": ws,
        "value_embed_layers": ve_layers,
        "rope_theta": 100000.0 if after("G") else 10000.0,
        "qk_scale": {"G": 1.15, "H": 1.2}.get(era, 1.0),
        "ve_gate_channels": (12 if after("G") else 32) if after("D") else None,
        "ve_gate_scale": (3.0 if after("G") else 2.0) if after("D") else None,
        "softcap": softcap,
        "resid_lambdas": after("B"),
        "smear": era == "H",
        "backout_layer": L // 2 if era == "H" else None,
    }


def check_shapes(sd: dict, mc: dict, era: str, cfg: dict) -> None:
    L, H, Hk, C = mc["n_layer"], mc["n_head"], mc["n_kv_head"], mc["n_embd"]
    D = C // H
    Vp = cfg["padded_vocab_size"]
    exp = {"transformer.wte.weight": (Vp, C), "lm_head.weight": (Vp, C)}
    for i in range(L):
        b = f"transformer.h.{i}."
        exp.update({
            b + "attn.c_q.weight": (H * D, C), b + "attn.c_k.weight": (Hk * D, C),
            b + "attn.c_v.weight": (Hk * D, C), b + "attn.c_proj.weight": (C, C),
            b + "mlp.c_fc.weight": (4 * C, C), b + "mlp.c_proj.weight": (C, 4 * C),
        })
        if i in cfg["value_embed_layers"]:
            exp[b + "attn.ve_gate.weight"] = (Hk, cfg["ve_gate_channels"])
            exp[f"value_embeds.{i}.weight"] = (Vp, Hk * D)
    if cfg["resid_lambdas"]:
        exp.update({"resid_lambdas": (L,), "x0_lambdas": (L,)})
    if era == "H":
        exp.update({"smear_gate.weight": (1, 24), "smear_lambda": (1,), "backout_lambda": (1,)})
    missing = sorted(set(exp) - set(sd))
    extra = sorted(set(sd) - set(exp))
    bad = sorted(k for k in exp if k in sd and tuple(sd[k].shape) != exp[k])
    if missing or extra or bad:
        sys.exit(f"error: state dict does not match era {era}: missing {missing}, unexpected {extra}, "
                 f"wrong shapes {[(k, tuple(sd[k].shape), exp[k]) for k in bad]}")


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------


def load_tiktoken(path: Path):
    """Returns (pat_str, mergeable_ranks, special_tokens). Unpickles tiktoken.core.Encoding if
    tiktoken is installed, else reads the pickled state dict without it."""
    data = path.read_bytes()
    try:
        enc = pickle.loads(data)
        return enc._pat_str, dict(enc._mergeable_ranks), dict(enc._special_tokens)
    except ModuleNotFoundError:
        pass

    class _Stub:
        def __setstate__(self, state):
            self.state = state

    class _U(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("tiktoken.core", "Encoding"):
                return _Stub
            return super().find_class(module, name)

    import io

    st = _U(io.BytesIO(data)).load().state
    return st["pat_str"], dict(st["mergeable_ranks"]), dict(st["special_tokens"])


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's byte-pair merge restricted to ranks < max_rank."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def build_tokenizer_json(pat_str: str, ranks: dict[bytes, int], specials: dict[str, int]) -> dict:
    b2u = bytes_to_unicode()
    to_str = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        sys.exit("error: mergeable ranks are not 0..n-1")
    for i in range(256):
        if ranks.get(bytes([i])) != i:
            sys.exit(f"error: rank of byte {i} is {ranks.get(bytes([i]))}; nanochat expects ids 0..255 = bytes")
    vocab = {to_str(b): r for b, r in ranks.items()}
    merges = []
    for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if r < 256:
            continue
        parts = bpe(ranks, b, r)
        if len(parts) != 2:
            sys.exit(f"error: cannot recover a merge for token {b!r} (rank {r}): {parts}")
        merges.append([to_str(parts[0]), to_str(parts[1])])
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s, i in sorted(specials.items(), key=lambda kv: kv[1])
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken returns a whole pre-token directly when it is in the vocab
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("tokenizer_pkl", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--softcap", type=float, choices=[15.0, 20.0], default=None,
                    help="logit softcap; 20 marks a D/E/F-keyed checkpoint as era E (2026-03-02..09)")
    args = ap.parse_args(argv)

    step = find_step(args.checkpoint_dir, args.step)
    model_path = args.checkpoint_dir / f"model_{step:06d}.pt"
    meta_path = args.checkpoint_dir / f"meta_{step:06d}.json"
    if not model_path.exists():  # tolerate non-zero-padded names
        model_path = next(p for p in args.checkpoint_dir.iterdir()
                          if re.fullmatch(r"model_0*%d\.pt" % step, p.name))
        meta_path = args.checkpoint_dir / model_path.name.replace("model_", "meta_").replace(".pt", ".json")
    log(f"checkpoint: {model_path} (step {step})")
    meta = json.loads(meta_path.read_text())
    mc = dict(meta["model_config"])
    for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
        if k not in mc:
            sys.exit(f"error: meta model_config lacks {k}")

    sd = torch.load(model_path, map_location="cpu", weights_only=True)
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}
    era, why = detect_era(sd, mc, args.softcap)
    log(f"era: {era} — {why}")

    pat_str, ranks, specials = load_tiktoken(args.tokenizer_pkl)
    n_vocab = len(ranks) + len(specials)
    if n_vocab != mc["vocab_size"]:
        sys.exit(f"error: tokenizer has {n_vocab} tokens but model_config.vocab_size = {mc['vocab_size']}")
    missing = [s for s in SPECIAL_TOKENS if s not in specials]
    if missing:
        sys.exit(f"error: tokenizer lacks special tokens {missing}")

    Vp = sd["transformer.wte.weight"].shape[0]
    if Vp < mc["vocab_size"]:
        sys.exit(f"error: wte has {Vp} rows < vocab_size {mc['vocab_size']}")
    cfg = {
        "model_type": "nanochat_native",
        "era": era,
        "vocab_size": mc["vocab_size"],
        "padded_vocab_size": Vp,
        "n_layer": mc["n_layer"],
        "n_head": mc["n_head"],
        "n_kv_head": mc["n_kv_head"],
        "n_embd": mc["n_embd"],
        "head_dim": mc["n_embd"] // mc["n_head"],
        "sequence_len": mc["sequence_len"],
    }
    cfg.update(resolve(era, mc, Vp, args.softcap))
    cfg["rms_norm_eps"] = RMS_NORM_EPS
    cfg["bos_token_id"] = specials["<|bos|>"]
    cfg["special_tokens"] = {n: specials[f"<|{n}|>"] for n in SPECIAL_NAMES}
    cfg["source"] = {"checkpoint": model_path.name, "step": step, "era_reason": why}
    check_shapes(sd, mc, era, cfg)
    log(f"config: L={cfg['n_layer']} C={cfg['n_embd']} H={cfg['n_head']} Hk={cfg['n_kv_head']} "
        f"V={cfg['vocab_size']} Vp={Vp} S={cfg['sequence_len']} windows={cfg['window_sizes']} "
        f"ve_layers={cfg['value_embed_layers']} softcap={cfg['softcap']:g}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in sd.items()}
    save_file(tensors, str(args.out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok = build_tokenizer_json(pat_str, ranks, specials)
    (args.out_dir / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values()})
    log(f"wrote {args.out_dir}/{{config.json, model.safetensors ({len(tensors)} tensors, {dtypes}), "
        f"tokenizer.json ({len(ranks)} ranks, {len(tok['model']['merges'])} merges, {len(specials)} specials)}}")


if __name__ == "__main__":
    main()
