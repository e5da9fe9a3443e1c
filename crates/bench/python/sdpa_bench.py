"""PyTorch SDPA baselines for `mkernel-bench --op attention`.

Reads a JSON list of cases ({"b", "hq", "hkv", "s", "d", "causal"}) from argv[1], times
torch.nn.functional.scaled_dot_product_attention (bf16, forward) with the cuDNN backend and with
the FlashAttention-2 backend, and prints one JSON object per case on stdout:
{"case": i, "cudnn_ms": float|null, "fa2_ms": float|null, "cudnn_err": str|null, "fa2_err": str|null}.
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


def main():
    cases = json.loads(sys.argv[1])
    warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 20
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
        print(json.dumps(out), flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
