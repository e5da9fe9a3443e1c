"""PyTorch SDPA baselines for `mkernel-bench --op attention`.

Reads a JSON list of cases ({"b", "hq", "hkv", "s", "d", "causal"}) from argv[1], times
torch.nn.functional.scaled_dot_product_attention (bf16, forward) with the cuDNN backend and with
the FlashAttention-2 backend, and prints one JSON object per case on stdout:
{"case": i, "cudnn_ms": float|null, "fa2_ms": float|null, "cudnn_err": str|null, "fa2_err": str|null}.
With argv[4] == "bwd" each backend's backward is timed too (`torch.autograd.grad` of the output
for a random dO, the forward's graph retained, so only the backward runs): "cudnn_bwd_ms",
"fa2_bwd_ms", "cudnn_bwd_err", "fa2_bwd_err".
Timing: CUDA events around each call, `warmup` untimed calls, median of `iters`.
GQA cases run with enable_gqa=True; a backend that refuses it is given K/V expanded to hq heads.
"""
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_backward(q, k, v, causal, backend, warmup, iters):
    """(median ms of the backward, error) of one backend; K/V expanded when GQA is refused."""
    hq, hkv = q.shape[1], k.shape[1]
    err = None
    for expand in (False, True):
        if expand and hkv == hq:
            break
        qq = q.detach().requires_grad_(True)
        kk = (k.repeat_interleave(hq // hkv, dim=1) if expand else k).detach().requires_grad_(True)
        vv = (v.repeat_interleave(hq // hkv, dim=1) if expand else v).detach().requires_grad_(True)
        gqa = (hkv != hq) and not expand
        try:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=gqa)
            do = torch.randn_like(o)

            def call():
                with sdpa_kernel([backend]):
                    torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
            ms = time_ms(call, warmup, iters)
            return ms, (None if not expand else "K/V expanded to hq heads (backend refused enable_gqa)")
        except Exception as e:  # noqa: BLE001 - report why a backend did not run
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None, err


def main():
    cases = json.loads(sys.argv[1])
    warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    bwd = len(sys.argv) > 4 and sys.argv[4] == "bwd"
    print(json.dumps({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name(0)}), flush=True)
    for i, c in enumerate(cases):
        b, hq, hkv, s, d, causal = c["b"], c["hq"], c["hkv"], c["s"], c["d"], c["causal"]
        g = torch.Generator(device="cuda").manual_seed(i)
        # (batch, heads, seq, dim) views of (batch, seq, heads, dim) tensors, as a model has them.
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        out = {"case": i}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            ms, err = None, None
            for expand in (False, True):
                if expand and hkv == hq:
                    break
                kk = k.repeat_interleave(hq // hkv, dim=1) if expand else k
                vv = v.repeat_interleave(hq // hkv, dim=1) if expand else v
                gqa = (hkv != hq) and not expand

                def call():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)
                try:
                    ms = time_ms(call, warmup, iters)
                    err = None if not expand else "K/V expanded to hq heads (backend refused enable_gqa)"
                    break
                except Exception as e:  # noqa: BLE001 - report why a backend did not run
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out[f"{name}_ms"] = ms
            out[f"{name}_err"] = err
            if bwd:
                out[f"{name}_bwd_ms"], out[f"{name}_bwd_err"] = time_backward(q, k, v, causal, backend, warmup, iters)
        print(json.dumps(out), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
