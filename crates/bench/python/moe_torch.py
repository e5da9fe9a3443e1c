#!/usr/bin/env python3
"""The MoE expert FFN in PyTorch with torch._grouped_mm, timed the way mkernel-bench times
ours (CUDA events around each run, median). Started by `mkernel-bench --op moe`.

Input: one JSON object on argv[1]: {"cases": [{"tokens", "experts", "top_k", "hidden", "ffn",
"routing": "uniform"|"skewed"}], "iters", "warmup"}.
Output: one JSON line per case on stdout: {"label", "layer_ms", "gemm_ms"} where layer_ms is
the whole layer (sort by expert, gather, grouped_mm up, SwiGLU, grouped_mm down, weighted
combine with index_add_ in f32) and gemm_ms the two grouped_mm calls alone on prepared inputs.
"""
import json
import sys

import torch
import torch.nn.functional as F


def routing(kind, tokens, experts, top_k, gen):
    if kind == "uniform":
        ids = torch.rand(tokens, experts, generator=gen, device="cuda").topk(top_k, dim=1).indices
    else:
        p = 1.0 / torch.arange(1, experts + 1, device="cuda", dtype=torch.float32)
        ids = torch.multinomial(p.expand(tokens, experts), top_k, replacement=False, generator=gen)
    w = torch.softmax(torch.rand(tokens, top_k, generator=gen, device="cuda"), dim=1)
    return ids.to(torch.int32), w


def median_ms(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in times)
    return t[len(t) // 2]


def run(c, iters, warmup):
    T, E, k, H, Fd = c["tokens"], c["experts"], c["top_k"], c["hidden"], c["ffn"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    # nn.Linear layout (E, out, in); _grouped_mm takes (E, K, N): the transposed views.
    w_up = torch.randn(E, 2 * Fd, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_down = torch.randn(E, H, Fd, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_up_t, w_down_t = w_up.transpose(1, 2), w_down.transpose(1, 2)
    ids, wts = routing(c["routing"], T, E, k, gen)

    def layer():
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        xs = x.index_select(0, tok)
        h = torch._grouped_mm(xs, w_up_t, offs=offs)
        h = F.silu(h[:, :Fd]) * h[:, Fd:]
        y = torch._grouped_mm(h, w_down_t, offs=offs)
        y = y.float() * wts.view(-1)[order].unsqueeze(1)
        return torch.zeros(T, H, device="cuda", dtype=torch.float32).index_add_(0, tok, y).to(torch.bfloat16)

    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
    xs = x.index_select(0, order // k).contiguous()
    hs = torch.randn(T * k, Fd, device="cuda", dtype=torch.bfloat16, generator=gen)

    def gemms():
        torch._grouped_mm(xs, w_up_t, offs=offs)
        torch._grouped_mm(hs, w_down_t, offs=offs)

    return {"layer_ms": median_ms(layer, iters, warmup), "gemm_ms": median_ms(gemms, iters, warmup)}


def main():
    req = json.loads(sys.argv[1])
    for c in req["cases"]:
        try:
            r = run(c, req["iters"], req["warmup"])
        except Exception as e:  # report, keep going
            r = {"error": f"{type(e).__name__}: {e}"}
        r["label"] = c["label"]
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
