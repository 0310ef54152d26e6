#!/usr/bin/env python3
"""Independent NumPy reference of the nanochat forward pass, eras A-H.

Written from docs/spec `nanochat.md` (sections 0, 3, 5); it does not import nanochat or torch.

Precision: every weight is upcast to float64 and the whole forward runs in float64; only the
returned logits are cast to float32. RoPE follows nanochat/HF: inv_freq and theta = p*inv_freq are
computed in float32 (as torch does), then cos/sin are taken in float64 of that float32 theta.
(Era A-E nanochat cast cos/sin to bf16 under autocast; this reference does not — it models the
fp32 CPU path of era F+ for every era, which is what a runtime should implement.)

Usage as a library:

    params = {name: np.ndarray}                      # state-dict names, `_orig_mod.` stripped
    cfg = {"n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "sequence_len",
           "window_pattern", "era"}                  # + optional "softcap" override
    model = NanoChatRef(params, cfg)
    cache = model.new_cache()
    logits = model.forward(token_ids, cache)         # (T, vocab_size) float32; appends to cache

Chunked prefill uses the FULL-sequence smear semantics: the first token of a later chunk is smeared
with the previous chunk's last normalized embedding (stored in the cache as `prev_embedding`),
which is not what nanochat's own cache path does (it never smears a chunk's first token).
"""

from __future__ import annotations

import math

import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 1.1920929e-07, F.rms_norm(eps=None) on fp32
ERAS = "ABCDEFGH"


def era_features(era: str) -> dict:
    """Inference-relevant switches per era (spec section 0)."""
    assert era in ERAS, era
    after = lambda e: ERAS.index(era) >= ERAS.index(e)  # noqa: E731
    f = {
        "rope_theta": 100000.0 if after("G") else 10000.0,
        "lambdas": after("B"),
        "windows": after("C"),
        "value_embeds": after("D"),
        "ve_gate_channels": None,
        "ve_gate_scale": None,
        "qk_scale": 1.0,
        "smear": after("H"),
        "backout": after("H"),
        "softcap": 20.0 if era in "EF" else 15.0,
    }
    if after("D"):
        f["ve_gate_channels"], f["ve_gate_scale"] = (12, 3.0) if after("G") else (32, 2.0)
    if era == "G":
        f["qk_scale"] = 1.15
    if era == "H":
        f["qk_scale"] = 1.2
    return f


def short_window(era: str, S: int) -> int:
    if era in "CDEF":
        return S // 2
    if era == "G":
        return -(-S // 3 // 128) * 128  # ceil(S/3/128)*128 as nanochat writes it: -(-S//3//128)*128
    if era == "H":
        return -(-S // 4 // 128) * 128
    raise ValueError(f"era {era} has no sliding windows")


def window_sizes(era: str, n_layer: int, S: int, pattern: str | None) -> list[int | None]:
    """Per-layer window W (query at p sees keys p-W..p); None = unlimited causal (eras A, B)."""
    if not era_features(era)["windows"]:
        return [None] * n_layer
    pattern = (pattern or "L").upper()
    assert pattern and set(pattern) <= {"S", "L"}, pattern
    short = short_window(era, S)
    ws = [S if pattern[i % len(pattern)] == "L" else short for i in range(n_layer)]
    ws[-1] = S
    return ws


def value_embed_layers(era: str, n_layer: int) -> list[int]:
    if not era_features(era)["value_embeds"]:
        return []
    return [i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2]


def rmsnorm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class Cache:
    def __init__(self, n_layer: int):
        self.k = [None] * n_layer  # (T, Hk, D) float64: after RoPE, QK-norm and q/k scale
        self.v = [None] * n_layer  # (T, Hk, D) float64: after value-embedding mixing
        self.pos = 0
        self.prev_embedding = None  # (C,) normalized pre-smear embedding of the last token


class NanoChatRef:
    def __init__(self, params: dict, cfg: dict):
        self.cfg = dict(cfg)
        self.era = cfg["era"]
        self.f = era_features(self.era)
        if cfg.get("softcap") is not None:
            self.f["softcap"] = float(cfg["softcap"])
        self.L, self.H, self.Hk, self.C = cfg["n_layer"], cfg["n_head"], cfg["n_kv_head"], cfg["n_embd"]
        self.D = self.C // self.H
        self.V = cfg["vocab_size"]
        self.S = cfg["sequence_len"]
        assert self.H % self.Hk == 0 and self.C % self.H == 0 and self.D % 2 == 0
        self.p = {k.removeprefix("_orig_mod."): np.asarray(v, dtype=np.float64) for k, v in params.items()}
        self.windows = window_sizes(self.era, self.L, self.S, cfg.get("window_pattern"))
        self.ve_layers = value_embed_layers(self.era, self.L)
        # inv_freq and theta in float32 like torch; cos/sin evaluated in float64
        d = np.arange(0, self.D, 2, dtype=np.float32) / np.float32(self.D)
        self.inv_freq = (np.float32(1.0) / (np.float32(self.f["rope_theta"]) ** d)).astype(np.float32)
        self._check_params()

    def _check_params(self):
        p, L, C, H, Hk, D = self.p, self.L, self.C, self.H, self.Hk, self.D
        Vp = p["transformer.wte.weight"].shape[0]
        assert Vp >= self.V and p["transformer.wte.weight"].shape == (Vp, C)
        assert p["lm_head.weight"].shape == (Vp, C)
        for i in range(L):
            b = f"transformer.h.{i}."
            assert p[b + "attn.c_q.weight"].shape == (H * D, C)
            assert p[b + "attn.c_k.weight"].shape == (Hk * D, C)
            assert p[b + "attn.c_v.weight"].shape == (Hk * D, C)
            assert p[b + "attn.c_proj.weight"].shape == (C, C)
            assert p[b + "mlp.c_fc.weight"].shape == (4 * C, C)
            assert p[b + "mlp.c_proj.weight"].shape == (C, 4 * C)
            if i in self.ve_layers:
                assert p[b + "attn.ve_gate.weight"].shape == (Hk, self.f["ve_gate_channels"])
                assert p[f"value_embeds.{i}.weight"].shape == (Vp, Hk * D)
        if self.f["lambdas"]:
            assert p["resid_lambdas"].shape == (L,) and p["x0_lambdas"].shape == (L,)
        if self.f["smear"]:
            assert p["smear_gate.weight"].shape == (1, 24) and p["smear_lambda"].shape == (1,)
            assert p["backout_lambda"].shape == (1,)

    def new_cache(self) -> Cache:
        return Cache(self.L)

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x (T, nh, D); half-split pairs rotated by -theta."""
        theta = (pos.astype(np.float32)[:, None] * self.inv_freq[None, :]).astype(np.float64)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        h = self.D // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)

    def forward(self, tokens, cache: Cache) -> np.ndarray:
        p, f = self.p, self.f
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        assert T >= 1
        L, H, Hk, D, C = self.L, self.H, self.Hk, self.D, self.C
        pos = np.arange(cache.pos, cache.pos + T)

        e = rmsnorm(p["transformer.wte.weight"][tokens])  # (T, C)
        x = e
        if f["smear"]:
            prev = np.empty_like(e)
            prev[1:] = e[:-1]
            has_prev = np.ones(T, dtype=bool)
            if cache.prev_embedding is not None:
                prev[0] = cache.prev_embedding
            else:
                has_prev[0] = False
                prev[0] = 0.0
            g = p["smear_lambda"][0] * sigmoid(e[:, :24] @ p["smear_gate.weight"][0])  # (T,)
            x = e + np.where(has_prev, g, 0.0)[:, None] * prev
        cache.prev_embedding = e[-1].copy()
        x0 = x
        b = L // 2
        x_b = None
        for i in range(L):
            pre = f"transformer.h.{i}."
            if f["lambdas"]:
                x = p["resid_lambdas"][i] * x + p["x0_lambdas"][i] * x0
            h = rmsnorm(x)
            q = (h @ p[pre + "attn.c_q.weight"].T).reshape(T, H, D)
            k = (h @ p[pre + "attn.c_k.weight"].T).reshape(T, Hk, D)
            v = (h @ p[pre + "attn.c_v.weight"].T).reshape(T, Hk, D)
            if i in self.ve_layers:
                ve = p[f"value_embeds.{i}.weight"][tokens].reshape(T, Hk, D)
                nc = f["ve_gate_channels"]
                gate = f["ve_gate_scale"] * sigmoid(h[:, :nc] @ p[pre + "attn.ve_gate.weight"].T)  # (T,Hk)
                v = v + gate[:, :, None] * ve
            q, k = self.rope(q, pos), self.rope(k, pos)
            q, k = f["qk_scale"] * rmsnorm(q), f["qk_scale"] * rmsnorm(k)
            K = k if cache.k[i] is None else np.concatenate([cache.k[i], k], axis=0)
            Vv = v if cache.v[i] is None else np.concatenate([cache.v[i], v], axis=0)
            cache.k[i], cache.v[i] = K, Vv
            group = H // Hk
            Kr, Vr = np.repeat(K, group, axis=1), np.repeat(Vv, group, axis=1)  # repeat_interleave
            kpos = np.arange(K.shape[0])
            s = np.einsum("thd,jhd->htj", q, Kr) / math.sqrt(D)
            mask = kpos[None, :] <= pos[:, None]
            W = self.windows[i]
            if W is not None:
                mask &= (pos[:, None] - kpos[None, :]) <= W
            s = np.where(mask[None], s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            a = np.exp(s)
            a /= a.sum(axis=-1, keepdims=True)
            y = np.einsum("htj,jhd->thd", a, Vr).reshape(T, C)
            x = x + y @ p[pre + "attn.c_proj.weight"].T
            m = np.maximum(rmsnorm(x) @ p[pre + "mlp.c_fc.weight"].T, 0.0) ** 2
            x = x + m @ p[pre + "mlp.c_proj.weight"].T
            if i == b:
                x_b = x
        if f["backout"]:
            x = x - p["backout_lambda"][0] * x_b
        z = (rmsnorm(x) @ p["lm_head.weight"].T)[:, : self.V]
        cap = f["softcap"]
        cache.pos += T
        return (cap * np.tanh(z / cap)).astype(np.float32)

    def greedy(self, prompt_ids, n_decode: int = 16):
        """Prefill + n_decode one-token steps. Returns (prefill_logits, decode_logits, generated)."""
        cache = self.new_cache()
        pre = self.forward(prompt_ids, cache)
        gen = [int(np.argmax(pre[-1]))]
        dec = []
        for _ in range(n_decode):
            lg = self.forward([gen[-1]], cache)[0]
            dec.append(lg)
            gen.append(int(np.argmax(lg)))
        return pre, np.stack(dec), gen

    def chunked_prefill(self, prompt_ids, split: int) -> np.ndarray:
        cache = self.new_cache()
        a = self.forward(prompt_ids[:split], cache)
        b = self.forward(prompt_ids[split:], cache)
        return np.concatenate([a, b], axis=0)
