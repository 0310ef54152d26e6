#!/usr/bin/env python3
"""Generate kiln's native-nanochat test fixtures.

    /path/to/venv/bin/python scripts/make_nanochat_fixtures.py

For eras A, B, D, G, H (+ an era-H copy with bf16 `wte`/`value_embeds`) this writes a tiny
random model in nanochat's on-disk format to tests/fixtures/nanochat_src/<name>/
(`model_000100.pt`, `meta_000100.json`, shared `tests/fixtures/nanochat_src/tokenizer.pkl`),
runs scripts/convert_nanochat.py on it into tests/fixtures/nanochat_<name>/, and writes
`reference.safetensors` there from the NumPy reference (scripts/nanochat_ref.py) evaluated on the
converted weights. Also: tests/fixtures/nanochat_tokenizer_reference.json (tiktoken ids for test
strings), a tokenizer.json-vs-tiktoken check, and a check of the reference against transformers'
NanoChatForCausalLM for era A. Deterministic (fixed seeds); see tests/fixtures/README.md.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import tiktoken
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanochat_ref  # noqa: E402

torch.set_num_threads(2)

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
SRC = FIX / "nanochat_src"
CONVERTER = REPO / "scripts" / "convert_nanochat.py"

PAT_STR = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
            "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
N_MERGES = 35  # 256 bytes + 35 merges + 9 specials = vocab 300 (padded to 320 from era A' on)
N_DECODE = 16
MIN_MARGIN = 1e-3
MIN_DISTINCT = 6
STEP = 100

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, but the fox did not care.
Once upon a time there was a small town by the sea. In the town lived a baker, a fisher and a teacher.
Every morning the baker made bread, the fisher went out on the water, and the teacher walked to school.
The children in the school learned to read, to write and to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
What is the capital of France? The capital of France is Paris. What is 12 + 35? It is 47.
She said: "Hello, world!" and he answered: "Hi there, how are you today?"
I'm fine, thanks. We're going to the market; they've got apples, pears and 20 oranges.
The weather was cold in the winter and warm in the summer. The rain fell on the green hills.
The user asked the assistant a question, and the assistant gave a short and helpful answer.
Numbers like 100, 2024 and 3.14 appear in text, as do dates such as 2025-01-31 and times like 09:30.
There were three cats, two dogs and one bird in the house. The bird sang while the cats slept.
"""
SHORT_PROMPT = "The 3 cats slept in the sun, and the dog"
SHORT_LEN = 20  # prompt = [<|bos|>] + encoding, truncated to this many ids
LONG_LEN = 120  # > 128 - 16: the 16 decode steps cross the 128-token short window of eras G/H
LONG_PROMPT = (
    "Once upon a time there was a small town by the sea. Every morning the baker made bread, "
    "the fisher went out on the water, and the teacher walked to school. The children learned "
    "to read and to count: 1, 2, 3. What is the capital of France? The capital of France is Paris."
)
TOKENIZER_TEST_STRINGS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "What is 12 + 35? It is 47. 123456789 and 3.14159",
    "x  1 and x\n\n1 and   42",
    "  leading spaces and trailing spaces   ",
    "line one\nline two\n\n\ttabbed line\r\n\r\n  \n",
    "I'm sure they've said we'll go; isn't it? HE'S DONE, I'D SAY",
    "Emoji: 🦀🔥 and 👍🏽!",
    "日本語のテキスト、中文文本。 Ünïcödé café naïve",
    "<|bos|>",
    "<|user_start|>Hi<|user_end|><|assistant_start|>",
    "a<|bos|>b <|assistant_end|>",
    SHORT_PROMPT,
]

# name -> (era, config, prompt, init seed start)
MODELS = {
    "A": ("A", dict(n_layer=4, n_head=4, n_kv_head=4, n_embd=32, sequence_len=64), SHORT_PROMPT),
    "B": ("B", dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, sequence_len=64), SHORT_PROMPT),
    "D": ("D", dict(n_layer=4, n_head=2, n_kv_head=1, n_embd=32, sequence_len=48, window_pattern="SL"),
          SHORT_PROMPT),
    "G": ("G", dict(n_layer=4, n_head=2, n_kv_head=2, n_embd=32, sequence_len=256, window_pattern="SSSL"),
          LONG_PROMPT),
    "H": ("H", dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, sequence_len=256, window_pattern="SSL"),
          LONG_PROMPT),
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# tokenizer: a tiny byte-level BPE trained like rustbpe (ids 0..255 = bytes), wrapped in tiktoken
# ----------------------------------------------------------------------------------------------


def train_bpe(text: str, n_merges: int) -> dict[bytes, int]:
    words = Counter(tuple(bytes([b]) for b in w.encode("utf-8")) for w in regex.findall(PAT_STR, text))
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w[:-1], w[1:]):
                pairs[(a, b)] += c
        cands = [(c, p) for p, c in pairs.items() if p[0] + p[1] not in ranks]
        if not cands:
            break
        best = max(c for c, _ in cands)
        a, b = min(p for c, p in cands if c == best)  # deterministic tie-break
        ranks[a + b] = len(ranks)
        new_words: Counter = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return ranks


def make_tokenizer() -> tiktoken.Encoding:
    ranks = train_bpe(CORPUS, N_MERGES)
    specials = {s: len(ranks) + i for i, s in enumerate(SPECIALS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------


def init_state_dict(era: str, mc: dict, Vp: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in nanochat's key order (spec section 2) for the given era."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *shape, std=1.0, mean=0.0: (torch.randn(*shape, generator=g) * std + mean).float()  # noqa: E731
    L, H, Hk, C = mc["n_layer"], mc["n_head"], mc["n_kv_head"], mc["n_embd"]
    D = C // H
    f = nanochat_ref.era_features(era)
    ve_layers = nanochat_ref.value_embed_layers(era, L)
    sd = {}
    if f["lambdas"]:
        sd["resid_lambdas"] = rn(L, std=0.1, mean=1.0)
        sd["x0_lambdas"] = rn(L, std=0.05, mean=0.15)
    if f["smear"]:
        sd["smear_lambda"] = torch.tensor([0.6])
        sd["backout_lambda"] = torch.tensor([0.25])
    sd["transformer.wte.weight"] = rn(Vp, C)
    s = C ** -0.5
    for i in range(L):
        b = f"transformer.h.{i}."
        sd[b + "attn.c_q.weight"] = rn(H * D, C, std=s)
        sd[b + "attn.c_k.weight"] = rn(Hk * D, C, std=s)
        sd[b + "attn.c_v.weight"] = rn(Hk * D, C, std=s)
        sd[b + "attn.c_proj.weight"] = rn(C, C, std=0.7 * s)
        if i in ve_layers:
            sd[b + "attn.ve_gate.weight"] = rn(Hk, f["ve_gate_channels"], std=0.5)
        sd[b + "mlp.c_fc.weight"] = rn(4 * C, C, std=s)
        sd[b + "mlp.c_proj.weight"] = rn(C, 4 * C, std=0.7 * (4 * C) ** -0.5)
    sd["lm_head.weight"] = rn(Vp, C, std=3.0 * s)
    if f["smear"]:
        sd["smear_gate.weight"] = rn(1, 24, std=0.5)
    for i in ve_layers:
        sd[f"value_embeds.{i}.weight"] = rn(Vp, Hk * D)
    return sd


def ref_cfg(era: str, mc: dict, V: int) -> dict:
    return dict(mc, vocab_size=V, era=era)


def greedy_ok(model: nanochat_ref.NanoChatRef, prompt: list[int]):
    pre, dec, gen = model.greedy(prompt, N_DECODE)
    allv = np.concatenate([pre[-1:], dec])
    top2 = np.sort(allv, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    return margin, len(set(gen)), (pre, dec, gen)


def write_checkpoint(d: Path, step: int, sd: dict, mc: dict, era: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    torch.save(sd, d / f"model_{step:06d}.pt")
    model_config = {k: mc[k] for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
    if era not in "AB":
        model_config["window_pattern"] = mc["window_pattern"]
    meta = {"step": step, "val_bpb": 1.234, "model_config": model_config,
            "user_config": {"note": f"kiln test fixture, era {era}, random weights"}}
    (d / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))


def convert(src: Path, out: Path, *extra: str) -> str:
    if out.exists():
        shutil.rmtree(out)
    r = subprocess.run([sys.executable, str(CONVERTER), str(src), str(SRC / "tokenizer.pkl"), str(out), *extra],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"converter failed on {src}:\n{r.stderr}")
    return r.stderr


def load_converted(out: Path):
    cfg = json.loads((out / "config.json").read_text())
    st = load_file(str(out / "model.safetensors"))
    params = {k: v.float().numpy() for k, v in st.items()}
    return cfg, st, params


def make_reference(out: Path, era: str, prompt: list[int]) -> dict:
    cfg, st, params = load_converted(out)
    mc = {k: cfg[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "sequence_len")}
    mc["window_pattern"] = cfg["window_pattern"]
    model = nanochat_ref.NanoChatRef(params, dict(mc, era=era, softcap=cfg["softcap"]))
    # the converter's resolved config must agree with the reference's own era rules
    ref_ws = [-1 if w is None else w for w in model.windows]
    assert cfg["window_sizes"] == ref_ws, (cfg["window_sizes"], ref_ws)
    assert cfg["value_embed_layers"] == model.ve_layers
    assert cfg["rope_theta"] == model.f["rope_theta"] and cfg["qk_scale"] == model.f["qk_scale"]
    assert cfg["ve_gate_channels"] == model.f["ve_gate_channels"] and cfg["ve_gate_scale"] == model.f["ve_gate_scale"]
    margin, distinct, (pre, dec, gen) = greedy_ok(model, prompt)
    P = len(prompt)
    split = P // 2 + 1
    chunked = model.chunked_prefill(prompt, split)
    d_chunk = float(np.abs(chunked - pre).max())
    assert d_chunk < 1e-5, d_chunk
    if model.f["smear"]:  # nanochat's own cache path would not smear the 2nd chunk's first token
        c = model.new_cache()
        model.forward(prompt[:split], c)
        c.prev_embedding = None
        quirk = model.forward(prompt[split:], c)
        d_quirk = float(np.abs(quirk - pre[split:]).max())
        assert d_quirk > 1e-3, d_quirk
        log(f"  {out.name}: chunked prefill with nanochat's no-smear quirk would differ by {d_quirk:.3g}")
    # uncached full forward over prompt + generated[:16] == prefill + decode logits
    full = model.forward(prompt + gen[:N_DECODE], model.new_cache())
    d_full = float(np.abs(full - np.concatenate([pre, dec])).max())
    assert d_full < 1e-5, d_full
    ref = {
        "prompt_ids": torch.tensor(prompt, dtype=torch.int64),
        "prefill_logits": torch.from_numpy(pre),
        "decode_logits": torch.from_numpy(dec),
        "generated_ids": torch.tensor(gen, dtype=torch.int64),
        "chunked_prefill_logits": torch.from_numpy(chunked),
        "chunk_split": torch.tensor([split], dtype=torch.int64),
    }
    save_file(ref, str(out / "reference.safetensors"), metadata={"format": "pt"})
    last = P + N_DECODE - 1  # position of the last decode input
    crosses = [w for w in cfg["window_sizes"] if w != -1 and last > w]
    log(f"  {out.name}: P={P} split={split} generated {gen} margin {margin:.3g} distinct {distinct} "
        f"|chunked-full| {d_chunk:.2e} |uncached-cached| {d_full:.2e} windows {cfg['window_sizes']} "
        f"last pos {last} crosses {sorted(set(crosses)) or 'none'}")
    return {"model": model, "params": params, "cfg": cfg}


def hf_check_era_a(params: dict, cfg: dict, prompt: list[int]) -> float:
    import transformers
    from transformers import NanoChatConfig, NanoChatForCausalLM

    transformers.logging.set_verbosity_error()
    hc = NanoChatConfig(
        vocab_size=cfg["padded_vocab_size"], hidden_size=cfg["n_embd"], intermediate_size=4 * cfg["n_embd"],
        num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
        num_key_value_heads=cfg["n_kv_head"], max_position_embeddings=cfg["sequence_len"] * 10,
        rms_norm_eps=1.1920929e-07, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        final_logit_softcapping=15.0, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["special_tokens"]["assistant_end"], pad_token_id=0,
    )
    hc._attn_implementation = "eager"
    m = NanoChatForCausalLM(hc).eval()
    sd = {"model.embed_tokens.weight": params["transformer.wte.weight"], "lm_head.weight": params["lm_head.weight"]}
    for i in range(cfg["n_layer"]):
        a, b = f"transformer.h.{i}.", f"model.layers.{i}."
        for src, dst in [("attn.c_q", "self_attn.q_proj"), ("attn.c_k", "self_attn.k_proj"),
                         ("attn.c_v", "self_attn.v_proj"), ("attn.c_proj", "self_attn.o_proj"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")]:
            sd[b + dst + ".weight"] = params[a + src + ".weight"]
    missing, unexpected = m.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing), (missing, unexpected)
    model = nanochat_ref.NanoChatRef(params, dict(
        {k: cfg[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "sequence_len")}, era="A"))
    pre, dec, gen = model.greedy(prompt, N_DECODE)
    ids = torch.tensor([prompt + gen[:N_DECODE]])
    with torch.no_grad():
        hf = m(ids).logits[0, :, : cfg["vocab_size"]].numpy()
    return float(np.abs(hf - np.concatenate([pre, dec])).max())


def check_tokenizer(enc: tiktoken.Encoding, tok_json: Path) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_json))
    tok_plain = Tokenizer.from_file(str(tok_json))
    tok.encode_special_tokens = True  # runtime-only flag: do not match added tokens in text
    rows = []
    for s in TOKENIZER_TEST_STRINGS + [CORPUS, LONG_PROMPT]:
        want = enc.encode_ordinary(s)
        got = tok.encode(s, add_special_tokens=False).ids
        plain = tok_plain.encode(s, add_special_tokens=False).ids
        assert got == want, (s, got, want)
        if plain != want:
            log(f"  note: without encode_special_tokens, HF tokenizers encodes {s!r} as {plain} (tiktoken: {want})")
        assert tok.decode(got, skip_special_tokens=False) == s == enc.decode(want)
        rows.append({"text": s, "ids": want})
    # special ids decode to their literal text
    for i, s in enumerate(SPECIALS):
        sid = enc.n_vocab - 9 + i
        assert enc.decode([sid]) == s and tok_plain.decode([sid], skip_special_tokens=False) == s
    return rows


def main() -> None:
    SRC.mkdir(parents=True, exist_ok=True)
    enc = make_tokenizer()
    V = enc.n_vocab
    assert V == 256 + N_MERGES + 9, V
    with open(SRC / "tokenizer.pkl", "wb") as fh:
        pickle.dump(enc, fh, protocol=4)
    log(f"tokenizer: vocab {V} ({N_MERGES} merges), specials {enc.n_vocab - 9}..{enc.n_vocab - 1}")
    bos = enc.encode_single_token("<|bos|>")

    made = {}
    for name, (era, mc, text) in MODELS.items():
        plen = LONG_LEN if text is LONG_PROMPT else SHORT_LEN
        prompt = ([bos] + enc.encode_ordinary(text))[:plen]
        assert len(prompt) == plen, (name, len(prompt))
        Vp = V if era == "A" else -(-V // 64) * 64
        for seed in range(1000 * (ord(name) - 64), 1000 * (ord(name) - 64) + 200):
            sd = init_state_dict(era, mc, Vp, seed)
            model = nanochat_ref.NanoChatRef({k: v.numpy() for k, v in sd.items()}, ref_cfg(era, mc, V))
            margin, distinct, _ = greedy_ok(model, prompt)
            if margin > MIN_MARGIN and distinct >= MIN_DISTINCT:
                break
        else:
            raise RuntimeError(f"{name}: no seed with clear greedy margins")
        log(f"{name}: era {era} seed {seed} V={V} Vp={Vp} {mc} prompt {len(prompt)} ids")
        src = SRC / name
        if src.exists():
            shutil.rmtree(src)
        write_checkpoint(src, STEP, sd, dict(mc, vocab_size=V), era)
        if name == "A":  # an older, smaller step that the converter must NOT pick by default
            old_mc = dict(mc, n_layer=1)
            write_checkpoint(src, 50, init_state_dict(era, old_mc, Vp, seed + 1), dict(old_mc, vocab_size=V), era)
        made[name] = (era, mc, prompt, sd)
        if name == "H":  # same weights, embeddings stored bf16 like nanochat's GPU-trained checkpoints
            sd16 = {k: (v.bfloat16() if k == "transformer.wte.weight" or k.startswith("value_embeds.") else v)
                    for k, v in sd.items()}
            src16 = SRC / "H_bf16"
            if src16.exists():
                shutil.rmtree(src16)
            write_checkpoint(src16, STEP, sd16, dict(mc, vocab_size=V), era)
            made["H_bf16"] = (era, mc, prompt, sd16)

    results = {}
    for name, (era, mc, prompt, sd) in made.items():
        out = FIX / f"nanochat_{name}"
        err = convert(SRC / name, out)
        for line in err.splitlines():
            log(f"  [convert {name}] {line}")
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["era"] == era, (cfg["era"], era)
        assert cfg["source"]["step"] == STEP
        results[name] = make_reference(out, era, prompt)

    # D/E/F ambiguity: --softcap 20 must report era E (checked into a temp dir, not kept)
    tmp = FIX / "_tmp_nanochat_E"
    err = convert(SRC / "D", tmp, "--softcap", "20")
    cfg_e = json.loads((tmp / "config.json").read_text())
    assert cfg_e["era"] == "E" and cfg_e["softcap"] == 20.0, cfg_e
    shutil.rmtree(tmp)
    log("  --softcap 20 on the D checkpoint -> era E, softcap 20: ok")

    # bf16 copy: converted tensors keep bf16; reference computed from the upcast values
    st16 = load_file(str(FIX / "nanochat_H_bf16" / "model.safetensors"))
    assert st16["transformer.wte.weight"].dtype == torch.bfloat16
    assert st16["transformer.h.0.attn.c_q.weight"].dtype == torch.float32

    # era A vs transformers NanoChatForCausalLM
    ra = results["A"]
    d_hf = hf_check_era_a(ra["params"], ra["cfg"], made["A"][2])
    log(f"era A: max |NumPy reference - transformers NanoChatForCausalLM| = {d_hf:.3e}")
    assert d_hf < 1e-4, d_hf

    # tokenizer.json (converter output) vs tiktoken
    rows = check_tokenizer(enc, FIX / "nanochat_A" / "tokenizer.json")
    chat = ([bos, enc.encode_single_token("<|user_start|>")] + enc.encode_ordinary("What is 12 + 35?")
            + [enc.encode_single_token("<|user_end|>"), enc.encode_single_token("<|assistant_start|>")])
    (FIX / "nanochat_tokenizer_reference.json").write_text(json.dumps({
        "note": "ids = tiktoken encode_ordinary (special-token text is NOT matched); "
                "tokenizer = tests/fixtures/nanochat_*/tokenizer.json (all identical)",
        "encode": rows,
        "chat": {"user": "What is 12 + 35?", "ids": chat},
    }, indent=1, ensure_ascii=False) + "\n")
    log(f"tokenizer.json == tiktoken encode_ordinary on {len(rows)} strings (with encode_special_tokens=True)")


if __name__ == "__main__":
    main()
