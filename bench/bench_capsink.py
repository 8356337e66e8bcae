"""What soft-capping and attention sinks cost in the op.

Times ``flashfuse.attention`` forward and forward+backward with no extra,
``softcap=50``, ``sinks`` and both, at a few shapes (Gemma 2 / gpt-oss-like
head dims, causal), and the eager spellings the models use (materialised
scores) for comparison where they fit. Prints one table, writes
``capsink.csv`` under ``--out``.

    python bench/bench_capsink.py            # GPU, a few seconds per case
    python bench/bench_capsink.py --smoke    # CPU, tiny shapes
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repository root on sys.path)
import torch

import flashfuse
from common import Results, base_parser, bench_ms, env_info, pick_device, print_table, short_error, tables_header

# (B, H, Hkv, N, D)
CASES = [(4, 16, 8, 2048, 128), (8, 32, 8, 1024, 64), (1, 16, 8, 8192, 128)]
SMOKE_CASES = [(1, 2, 1, 48, 16)]
VARIANTS = ["plain", "softcap", "sinks", "softcap+sinks"]
CAP = 50.0


def eager(q, k, v, softcap, sinks):
    """The models' eager attention (Gemma 2's cap, gpt-oss's sink column)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(s.shape[-2], n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1).to(s.dtype)], -1)
    p = torch.softmax(s.float(), -1).to(q.dtype)
    return (p[..., :-1] if sinks is not None else p) @ v


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], budget_s=120).parse_args()
    device = pick_device(args)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    res = Results(args.out, "capsink.csv", env_info(device))
    table = []
    for B, H, Hkv, N, D in SMOKE_CASES if args.smoke else CASES:
        torch.manual_seed(0)
        q = torch.randn(B, H, N, D, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype, requires_grad=True)
        sinks = torch.randn(H, device=device, dtype=torch.float32, requires_grad=True)
        g = torch.randn(B, H, N, D, device=device, dtype=dtype)
        for provider in ("flashfuse", "eager"):
            if provider == "eager" and B * H * N * N * 4 > 2**33:
                continue  # the materialised scores would not fit
            for variant in VARIANTS:
                cap = CAP if "softcap" in variant else None
                snk = sinks if "sinks" in variant else None

                def fwd():
                    if provider == "eager":
                        return eager(q, k, v, cap, snk)
                    return flashfuse.attention(q, k, v, is_causal=True, enable_gqa=True, softcap=cap, sinks=snk)

                def fwd_bwd():
                    fwd().backward(g)

                row = dict(provider=provider, variant=variant, B=B, H=H, Hkv=Hkv, N=N, D=D,
                           dtype=str(dtype).replace("torch.", ""))
                try:
                    with torch.no_grad():
                        row["fwd_ms"] = bench_ms(fwd, device)
                    row["fwd_bwd_ms"] = bench_ms(fwd_bwd, device, grad_to_none=[q, k, v, sinks])
                except Exception as exc:  # noqa: BLE001 - record and go on
                    row["error"] = short_error(exc)
                res.add(**row)
                table.append([provider, variant, f"{B}x{H}/{Hkv}x{N}x{D}", _f(row.get("fwd_ms")),
                              _f(row.get("fwd_bwd_ms")), row.get("error", "")])
    tables_header()
    print_table(table, ["provider", "variant", "shape", "fwd ms", "fwd+bwd ms", "error"],
                title=f"soft-capping and sinks, causal, {dtype} ({res.path})")


def _f(x):
    return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main()
