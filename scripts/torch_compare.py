#!/usr/bin/env python3
"""PyTorch's batch decode speed on the model kiln benchmarks, for the ratio in docs/gpu-results.md.

The model is a synthetic shape from src/model/synthetic_shapes.json (the file `kiln-bench
--synthetic` reads, so both build the same architecture), with random bf16 weights drawn in torch
from --seed (normal, std = the shape's initializer_range, norms 1: transformers' own init). A dense
bf16 decode's speed depends on shapes and dtypes, not on the weights' values, so the synthetic
`smollm2-135m` (the demo model's exact config) stands in for the demo GGUF; `kiln-bench` can time
both to show it (scripts/gpu-check.sh does). Not the GGUF itself: transformers 5.23 keeps GGUF
weights quantized and computes in float32 (about 1 token/s on the CPU here), which is no bf16
baseline, and the GPU machines have no `gguf` package.

What is timed, per batch size B (mirroring `kiln-bench -n N --batch B`): a transformers
StaticCache of N + 1 positions; each sequence gets one random token at position 0 (untimed), then
N greedy decode steps of the B sequences. One decode step is `model(...)` + argmax, compiled with
torch.compile(mode="reduce-overhead", dynamic=False) (transformers' own CompileConfig, with
shapes static): inductor kernels replayed as CUDA graphs.
Warm-up repetitions (compile, graph capture) first, then --repetitions timed ones, each with CUDA
events around the N steps on a reset cache; the median is reported.

Output: one JSON line per batch size on stdout (tokens/s, ms per token, the samples, bytes per
token by the same formula as kiln's `kiln-bench --bytes-per-token`, and % of the bandwidth when
one is given or measured with --measure-bandwidth); progress on stderr.

    python3 scripts/torch_compare.py --model llama-3.2-1b --batch 1,2,4,8 --measure-bandwidth

Without torch, or without a CUDA GPU, it exits with status 2 and a one-line reason. --dry-run
needs neither: it prints the config and bytes per token it would use. --device cpu is for testing
this script only (use --no-compile there); its numbers compare nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "src" / "model" / "synthetic_shapes.json"


class Refusal(Exception):
    """An expected reason not to run (no torch, no GPU, bad argument): one line, exit status 2."""


def log(msg: str) -> None:
    print(f"torch_compare: {msg}", file=sys.stderr, flush=True)


def load_shapes() -> dict:
    with open(SHAPES) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def shape_config(name: str) -> dict:
    shapes = load_shapes()
    if name not in shapes:
        raise Refusal(f"no synthetic shape named `{name}` (known: {', '.join(sorted(shapes))})")
    return dict(shapes[name])


def num_params(c: dict) -> int:
    """Parameters of a llama config, the tied embedding counted once (ModelConfig::num_params)."""
    h, f, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q = c["num_attention_heads"] * hd
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    attn = h * q * 2 + h * kv * 2
    bias = q + 2 * kv if c.get("attention_bias") else 0
    head = 0 if c.get("tie_word_embeddings") else v * h
    return v * h + layers * (attn + bias + 3 * h * f + 2 * h) + h + head


def tg_context(n_gen: int) -> int:
    """Mean positions attended by kiln-bench's tgN test, rounded up (bench::bytes::tg_context)."""
    return 1 + (n_gen + 2) // 2


def decode_bytes(c: dict, batch: int, context: int, weight: int = 2, kv: int = 2) -> dict:
    """The fewest bytes of one decode step, bf16 weights and KV (kiln::bench::bytes::decode_step)."""
    h, v = c["hidden_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    kv_dim = c.get("num_key_value_heads", c["num_attention_heads"]) * hd
    params = num_params(c) - (0 if c.get("tie_word_embeddings") else v * h)
    per_position = kv * c["num_hidden_layers"] * 2 * kv_dim
    d = {
        "batch": batch,
        "context": context,
        "weights": weight * (params + batch * h),
        "kv_read": batch * context * per_position,
        "kv_write": batch * per_position,
    }
    d["bytes_per_step"] = d["weights"] + d["kv_read"] + d["kv_write"]
    d["bytes_per_token"] = d["bytes_per_step"] / batch
    return d


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise Refusal(f"--batch takes a comma list of positive integers, not `{text}`") from None
    if not batches or min(batches) < 1:
        raise Refusal(f"--batch takes a comma list of positive integers, not `{text}`")
    return batches


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b", help="synthetic shape (src/model/synthetic_shapes.json)")
    p.add_argument("--batch", default="1", help="comma list of batch sizes (default 1)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="decode steps timed per repetition (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=10, help="timed repetitions; the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (compile, CUDA graph capture)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random weights and token ids")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu only tests this script")
    p.add_argument("--no-compile", action="store_true", help="eager PyTorch (no torch.compile, no CUDA graphs)")
    p.add_argument("--bandwidth-gbs", type=float, help="report %% of this bandwidth (GB/s, read + write)")
    p.add_argument("--measure-bandwidth", action="store_true",
                   help="measure the device-to-device copy bandwidth (bytes read + written) and report %% of it")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer for --measure-bandwidth (MiB)")
    p.add_argument("--bandwidth-only", action="store_true",
                   help="with --measure-bandwidth: print the measurement as one JSON line and stop")
    p.add_argument("--dry-run", action="store_true", help="print config and bytes per token; import nothing")
    a = p.parse_args(argv)
    a.batches = parse_batches(a.batch)
    if a.n_gen < 1 or a.repetitions < 1 or a.warmup < 0:
        raise Refusal("-n and -r must be at least 1, --warmup at least 0")
    if a.bandwidth_only and not a.measure_bandwidth:
        raise Refusal("--bandwidth-only goes with --measure-bandwidth")
    if a.bandwidth_gbs is not None and not a.bandwidth_gbs > 0:
        raise Refusal(f"--bandwidth-gbs must be positive, not {a.bandwidth_gbs}")
    return a


def import_torch(device: str):
    try:
        import torch
        import transformers
    except ImportError as e:
        raise Refusal(f"PyTorch and transformers are needed ({e}); pip install -r scripts/requirements-torch.txt") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise Refusal(
            f"no CUDA GPU visible to PyTorch {torch.__version__} (CUDA {torch.version.cuda}); "
            "run this on a GPU machine (--device cpu only tests the script)"
        )
    return torch, transformers


def build_model(torch, transformers, args, device):
    """The synthetic model in bf16 on `device`, its config as a dict, and where it came from."""
    cfg = shape_config(args.model)
    config = transformers.LlamaConfig(**cfg)
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    # transformers initialises linears and embeddings N(0, initializer_range) and norms to 1;
    # check it did (timing zeros or uninitialised memory would flatter the numbers).
    w = model.model.layers[0].mlp.down_proj.weight.detach().float()
    std, want = float(w.std()), cfg["initializer_range"]
    if not (0.5 * want < std < 2 * want) or not bool(torch.isfinite(w).all()):
        raise RuntimeError(f"random init failed: down_proj std {std}, expected about {want}")
    return model.eval(), cfg, f"synthetic:{args.model} seed={args.seed}"


def measure_bandwidth(torch, mib: int, device: str) -> dict:
    """Device-to-device copy: bytes read + written over the median of 20 event-timed copies."""
    n = mib << 20
    src = torch.randint(1, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    samples = []
    for _ in range(20):
        if device == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append((time.perf_counter() - t0) * 1e3)
    if not torch.equal(dst, src):
        raise RuntimeError("the bandwidth copy produced wrong bytes")
    ms = statistics.median(samples)
    return {"buffer_bytes": n, "bytes_moved": 2 * n, "median_ms": ms, "bytes_per_s": 2 * n / (ms / 1e3)}


def time_batch(torch, transformers, model, args, batch: int, device: str) -> list[float]:
    """Milliseconds of N decode steps of `batch` sequences, per timed repetition."""
    vocab = model.config.vocab_size
    cache = transformers.StaticCache(config=model.config, max_cache_len=args.n_gen + 1)
    gen = torch.Generator(device="cpu").manual_seed(args.seed + batch)
    first = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)

    def step(tokens):
        logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits
        return torch.argmax(logits[:, -1, :], dim=-1, keepdim=True)

    with torch.no_grad():
        step(first)  # eager: allocates the cache's static tensors
        compiled = step if args.no_compile else torch.compile(step, mode="reduce-overhead", dynamic=False)

        def fn(tokens):
            # Each call is a new step of the CUDA graph tree, and its output is copied out of
            # the graph's buffer, which the next replay overwrites (what gpt-fast does); without
            # both, torch 2.11 refuses the second replay ("accessing tensor output of CUDAGraphs
            # that has been overwritten", seen on an H200).
            if not args.no_compile:
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(tokens).clone()

        samples = []
        for rep in range(args.warmup + args.repetitions):
            t0 = time.perf_counter()
            cache.reset()
            tok = fn(first)
            if device == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.n_gen):
                    tok = fn(tok)
                e1.record()
                e1.synchronize()
                ms = e0.elapsed_time(e1)
            else:
                t1 = time.perf_counter()
                for _ in range(args.n_gen):
                    tok = fn(tok)
                ms = (time.perf_counter() - t1) * 1e3
            if not (0 <= int(tok.min()) and int(tok.max()) < vocab):
                raise RuntimeError(f"decoded token ids outside the vocabulary: {tok.flatten().tolist()}")
            if rep < args.warmup:
                log(f"batch {batch}: warm-up {rep + 1}/{args.warmup} in {time.perf_counter() - t0:.1f} s")
            else:
                samples.append(ms)
    return samples


def graph_breaks(torch) -> int:
    """Graph breaks dynamo reported so far (each splits the CUDA graph; 0 is the goal)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return -1
    return sum(counters["graph_break"].values())


def run(args) -> int:
    if args.dry_run:
        cfg = shape_config(args.model)
        for b in args.batches:
            line = {"dry_run": True, "model": args.model, "config": cfg, "n_gen": args.n_gen,
                    "num_params": num_params(cfg), **decode_bytes(cfg, b, tg_context(args.n_gen))}
            print(json.dumps(line), flush=True)
        return 0
    torch, transformers = import_torch(args.device)
    device = args.device
    dev_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    bandwidth, bw_source = None, None
    if args.bandwidth_gbs is not None:
        bandwidth, bw_source = args.bandwidth_gbs * 1e9, f"given: {args.bandwidth_gbs:.1f} GB/s"
    elif args.measure_bandwidth:
        m = measure_bandwidth(torch, args.bandwidth_mib, device)
        bandwidth, bw_source = m["bytes_per_s"], f"torch copy_ of {args.bandwidth_mib} MiB on {dev_name}"
        log(f"bandwidth {m['bytes_per_s'] / 1e9:.1f} GB/s ({bw_source}, read + write, median of 20)")
        if args.bandwidth_only:
            print(json.dumps({"tool": "torch_compare", "device": dev_name, "source": bw_source, **m}), flush=True)
            return 0
    t0 = time.perf_counter()
    model, cfg, source = build_model(torch, transformers, args, device)
    log(f"{source}: {sum(p.numel() for p in model.parameters())} parameters on {dev_name} "
        f"in {time.perf_counter() - t0:.1f} s")
    name = args.model
    for b in args.batches:
        samples = time_batch(torch, transformers, model, args, b, device)
        ms = statistics.median(samples)
        by = decode_bytes(cfg, b, tg_context(args.n_gen))
        ms_per_token = ms / (args.n_gen * b)
        line = {
            "tool": "torch_compare",
            "model": name,
            "source": source,
            "device": dev_name,
            "num_params": num_params(cfg),
            "batch": b,
            "n_gen": args.n_gen,
            "tokens_per_s": args.n_gen * b / (ms / 1e3),
            "ms_per_token": ms_per_token,
            "ms_per_step": ms / args.n_gen,
            "samples_ms": samples,
            "repetitions": len(samples),
            "bytes_per_token": by["bytes_per_token"],
            "context": by["context"],
            "max_cache_len": args.n_gen + 1,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_source": bw_source,
            "roofline_pct": None if bandwidth is None else by["bytes_per_token"] / bandwidth / (ms_per_token / 1e3) * 100,
            "compile": None if args.no_compile else "torch.compile(mode=reduce-overhead, dynamic=False)",
            "graph_breaks": graph_breaks(torch),
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        print(json.dumps(line), flush=True)
    return 0


def main(argv: list[str]) -> int:
    try:
        return run(parse_args(argv))
    except Refusal as e:
        print(f"torch_compare: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
