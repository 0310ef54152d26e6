#!/usr/bin/env python3
"""Generate the fixtures of the Qwen3, Mistral, Phi-3 and Gemma 3 architectures.

Run from the repo root (same environment as make_fixtures.py, whose tokenizer, prompt,
random init and reference procedure this script reuses):
    .venv-fixtures/bin/python scripts/make_arch_fixtures.py

For each architecture NAME it writes into tests/fixtures/:
- NAME/: a tiny random-weight Hugging Face model (config.json, model.safetensors, the fixture
  tokenizer files) and reference.safetensors computed by transformers from the model as
  reloaded from disk (schema in tests/fixtures/README.md);
- NAME.f32.gguf: the same weights written with gguf-py the way llama.cpp's
  convert_hf_to_gguf.py writes that architecture (tensor names, fusions, Gemma's norm + 1, the
  llama q/k permutation for Mistral), and NAME.f32.reference.safetensors computed by
  transformers loading that GGUF file (config keys the GGUF cannot carry are passed to
  from_pretrained). The script asserts that it equals the safetensors reference (< 1e-4), which
  checks the conversion independently of kiln.
Deterministic: rerunning reproduces the same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (sets torch threads/determinism on import)

import gguf  # noqa: E402
import safetensors.torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FIX = mf.FIX
QT = gguf.GGMLQuantizationType


def make_config(name: str):
    c = mf.common_cfg()
    if name == "qwen3":
        # head_dim 32 with 4 heads: q is 128 wide for a hidden size of 64, as in real Qwen3.
        return Qwen3Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=160, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=256, use_sliding_window=False, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **c,
        )
    if name == "mistral":
        # A window of 8 keys: prompt (13) + decode (16) positions cross it many times.
        return MistralConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=256, sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **c,
        )
    if name == "phi3":
        return Phi3Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=256, original_max_position_embeddings=256,
            sliding_window=10, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **c,
        )
    if name == "gemma3":
        # Six layers: the default pattern makes layers 0-4 local (window 8, base 1e4) and layer 5
        # global (base 1e6). query_pre_attn_scalar = head_dim, as in Gemma 3 1B and as llama.cpp
        # assumes for every size but 27B.
        return Gemma3TextConfig(
            hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, intermediate_size=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
            max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=32,
            hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
            attn_logit_softcapping=None,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **c,
        )
    raise ValueError(name)


ONLY = sys.argv[1:]

MODEL_CLASSES = {
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
MODEL_SEEDS = {"qwen3": 6000, "mistral": 7000, "phi3": 8000, "gemma3": 9000}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, name: str) -> None:
    mf.randomize(model, seed)
    if name == "gemma3":
        # Gemma stores norm weights as offsets from 1 (it multiplies by 1 + w): centre them at 0.
        # The embedding is multiplied by √hidden (8) on the way in: scaled down by as much so
        # that the stream is not its own token's (tied) embedding and greedy does not repeat it.
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.sub_(1.0)
            if "embed_tokens" in pname:
                p.div_(8.0)


def build_hf_model(name: str, tok, prompt_ids: list[int]) -> Path:
    cls, seed = MODEL_CLASSES[name], MODEL_SEEDS[name]
    for _ in range(40):
        torch.manual_seed(seed)
        cfg = make_config(name)
        cfg._attn_implementation = "eager"
        model = cls(cfg).float()
        randomize(model, seed, name)
        ref = mf.reference(model, prompt_ids)
        n_distinct = len(set(ref["generated_ids"].tolist()))
        if min(ref["_margins"]) > mf.MIN_MARGIN and n_distinct >= mf.MIN_DISTINCT:
            break
        mf.log(f"  {name}: seed {seed} min margin {min(ref['_margins']):.2e}, {n_distinct} "
               "distinct generated ids; re-seeding")
        seed += 1
    else:
        raise RuntimeError(f"{name}: no seed with clear greedy margins")
    out = FIX / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    mf.write_tokenizer_files(tok, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager")
    ref2 = mf.reference(reloaded, prompt_ids)
    assert torch.equal(ref2["generated_ids"], ref["generated_ids"]), name
    assert (ref2["decode_logits"] - ref["decode_logits"]).abs().max() < 1e-5, name
    mf.save_reference(ref2, out / "reference.safetensors")
    mf.log(f"  {name}: seed {seed}, config {json.loads((out / 'config.json').read_text())}")
    return out


# ----------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's convert_hf_to_gguf.py writes each architecture
# ----------------------------------------------------------------------------------------------

GGUF_ARCH = {"qwen3": "qwen3", "mistral": "llama", "phi3": "phi3", "gemma3": "gemma3"}

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(name: str, hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    rest = ".".join(parts[3:])
    if name == "gemma3":
        table = {**LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    else:
        table = {**LAYER_NAMES, "post_attention_layernorm.weight": "ffn_norm.weight"}
    return f"blk.{parts[2]}.{table[rest]}"


def write_gguf(name: str, model_dir: Path, tok) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    sd = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    arch = GGUF_ARCH[name]
    path = FIX / f"{name}.f32.gguf"
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rp = cfg.get("rope_parameters") or {}
    rope_theta = rp.get("full_attention", rp).get("rope_theta")

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"kiln-fixture-{name}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if name in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name == "mistral":
        w.add_rope_dimension_count(head_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if name == "phi3":
        w.add_rope_dimension_count(head_dim)

    vocab = tok.get_vocab()
    id_to_tok = {i: t for t, i in vocab.items()}
    tokens = [id_to_tok[i] for i in range(len(id_to_tok))]
    types = [int(gguf.TokenType.CONTROL) if t in mf.SPECIAL_TOKENS else int(gguf.TokenType.NORMAL)
             for t in tokens]
    tj = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(mf.BOS_ID)
    w.add_eos_token_id(mf.EOS_ID)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(mf.CHAT_TEMPLATE)

    for hf_name, t in sd.items():
        data = t.float().numpy()
        gname = gguf_tensor_name(name, hf_name)
        if name == "mistral" and gname.endswith("attn_q.weight"):
            data = mf.permute(data, n_head, n_head)
        elif name == "mistral" and gname.endswith("attn_k.weight"):
            data = mf.permute(data, n_head, n_kv)
        if name == "gemma3" and gname.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's Gemma converter stores 1 + w
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_overrides(name: str, cfg: dict) -> dict:
    """Config values transformers' GGUF loader does not read from these files."""
    if name == "qwen3":
        return {"head_dim": cfg["head_dim"]}
    if name == "mistral":
        return {"tie_word_embeddings": False}
    if name == "phi3":
        return {"sliding_window": cfg["sliding_window"],
                "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    if name == "gemma3":
        return {"query_pre_attn_scalar": cfg["query_pre_attn_scalar"],
                "rope_parameters": cfg["rope_parameters"], "tie_word_embeddings": True}
    return {}


def gguf_reference(name: str, path: Path, prompt_ids: list[int]) -> None:
    cfg = json.loads((FIX / name / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(
        FIX, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager",
        **gguf_overrides(name, cfg))
    if name == "mistral":
        # transformers reads a llama-architecture GGUF as Llama (its "mistral" GGUF path needs an
        # arch gguf-py 0.19 lacks): the weights it dequantizes and un-permutes go into the
        # Mistral model of the fixture's config, which adds the sliding window.
        assert type(model).__name__ == "LlamaForCausalLM", type(model).__name__
        cfg_obj = make_config(name)
        cfg_obj._attn_implementation = "eager"
        mistral = MistralForCausalLM(cfg_obj).float().eval()
        missing, unexpected = mistral.load_state_dict(model.state_dict(), strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
        model = mistral
    assert type(model).__name__ == MODEL_CLASSES[name].__name__, type(model).__name__
    ref = mf.reference(model, prompt_ids)
    hf_ref = safetensors.torch.load_file(str(FIX / name / "reference.safetensors"))
    d = max((ref[k] - hf_ref[k]).abs().max().item() for k in ("prefill_logits", "decode_logits"))
    mf.log(f"  {path.name}: transformers from GGUF vs safetensors reference: max |d| = {d:.2e}")
    assert d < 1e-4, (name, d)
    assert torch.equal(ref["generated_ids"], hf_ref["generated_ids"]), name
    mf.save_reference(ref, FIX / f"{name}.f32.reference.safetensors")


def main() -> None:
    tok = mf.train_tokenizer()
    tmp = FIX / "_tok_arch"
    mf.write_tokenizer_files(tok, tmp)
    hf_tok = AutoTokenizer.from_pretrained(tmp)
    shutil.rmtree(tmp)
    prompt_ids = hf_tok.encode(mf.PROMPT_TEXT, add_special_tokens=False)
    ref_ids = json.loads((FIX / "tokenizer_reference.json").read_text())["prompt_ids"]
    assert prompt_ids == ref_ids, "the fixture tokenizer changed"
    for name in MODEL_CLASSES:
        if ONLY and name not in ONLY:
            continue
        mf.log(f"== {name}")
        out = build_hf_model(name, tok, prompt_ids)
        p = write_gguf(name, out, tok)
        gguf_reference(name, p, prompt_ids)


if __name__ == "__main__":
    sys.exit(main())
