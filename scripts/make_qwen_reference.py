#!/usr/bin/env python3
"""Greedy reference for the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF.

Run from the repo root (environment of scripts/requirements-fixtures.txt):
    scripts/fetch_models.sh qwen2.5-coder-0.5b
    .venv-fixtures/bin/python scripts/make_qwen_reference.py

transformers loads the GGUF with `gguf_file=` and dequantizes every tensor to float32 (gguf-py's
dequantization is bit-identical to ggml's); the tokenizer comes from the same file. For two chat
prompts (rendered with the model's own chat template and generation prompt) and two raw
completions it records the prompt ids and 32 greedy tokens (KV cache, no stop at EOS) with the
top-2 logit margin of every step, into tests/fixtures/qwen2.5_coder_0.5b_reference.json.
Deterministic (float32, eager attention, 2 threads).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
OUT = REPO / "tests" / "fixtures" / "qwen2.5_coder_0.5b_reference.json"
NEW_TOKENS = 32

CHAT = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does the `?` operator do in Rust?",
]
RAW = [
    "def is_prime(n):\n",
    "// Binary search over a sorted slice\nfn binary_search(xs: &[i32], target: i32) -> Option<usize> {\n",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    pkv, lg = out.past_key_values, out.logits[0, -1]
    gen, margins = [], []
    for _ in range(NEW_TOKENS):
        t = torch.topk(lg.double(), 2)
        gen.append(int(t.indices[0]))
        margins.append(float(t.values[0] - t.values[1]))
        out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=pkv, use_cache=True)
        pkv, lg = out.past_key_values, out.logits[0, -1]
    return gen, margins


def main() -> None:
    if not MODEL.exists():
        sys.exit(f"{MODEL} missing: run scripts/fetch_models.sh qwen2.5-coder-0.5b")
    got = sha256(MODEL)
    assert got == SHA256, f"{MODEL}: sha256 {got}, expected {SHA256}"
    d, f = str(MODEL.parent), MODEL.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cases = []
    for user in CHAT:
        messages = [{"role": "user", "content": user}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cases.append({"kind": "chat", "user": user, "text": rendered})
    for text in RAW:
        cases.append({"kind": "raw", "text": text})
    for c in cases:
        c["prompt_ids"] = tok.encode(c["text"], add_special_tokens=False)
        gen, margins = greedy(model, c["prompt_ids"])
        c["generated_ids"] = gen
        c["generated_text"] = tok.decode(gen, skip_special_tokens=False)
        c["top2_margins"] = margins
        print(f"{c['kind']} {c['text'][-40:]!r} -> {c['generated_text']!r} "
              f"(min margin {min(margins):.4f})", file=sys.stderr)
    data = {
        "model": f"models/{MODEL.name} (sha256 {SHA256}), dequantized to f32 by transformers "
                 f"{transformers.__version__} (gguf_file=), torch {torch.__version__}",
        "decoding": f"greedy, f32, {NEW_TOKENS} new tokens, no stop at EOS, KV cache",
        "tokenization": "the GGUF's tokenizer as transformers converts it, add_special_tokens=False; "
                        "chat prompts rendered by the GGUF's chat template with the generation "
                        "prompt",
        "cases": cases,
    }
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
