"""How precisely the chunk solve ``T = (I + A_kk)^-1`` comes out with its dots in tf32, bf16x3, tf32x3, fp32, and stored
in bf16.

The KDA forward inverts each chunk's unit lower-triangular ``I + A_kk`` (``kda_chunk_intra._solve``): 16 x 16
diagonal blocks by the nilpotent product ``(I − L)(I + L²)(I + L⁴)(I + L⁸)``, then block forward substitution. This
script runs that algorithm in torch with every dot's inputs rounded to tf32 (10 mantissa bits, what ``tl.dot(...,
input_precision="tf32")`` feeds the tensor cores), split into a tf32 high part and the remainder of which the three
products that matter are summed (``"tf32x3"``, the kernel's ``_dot``: three tensor-core products, the high parts
rounded, the remainders truncated to tf32 by the tensor cores; ``"bf16x3"`` the same with bf16 halves, as fla-core
runs its safe-gate backward) or kept in fp32 (``"ieee"``, FMA), on chunks of keys that share a few directions (as a
trained model's do; random keys give a well-conditioned ``A_kk``), and reports the error of T against the float64
inverse relative to T's largest entry. CPU only, seconds.

    PYTHONPATH=src python benchmarks/solve_precision.py --chunks 128 --out solve_precision.json
"""

import argparse
import json
from pathlib import Path

import torch

CHUNK, BLOCK = 64, 16


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to nearest at 10 mantissa bits (tf32), as fp32."""
    bits = x.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` cut to 10 mantissa bits (tf32) toward zero, as the tensor cores read an fp32 operand."""
    return (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32)


def dot(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation (float64 here, exact for 16-term sums of tf32 products) of inputs in
    ``precision``."""
    if precision == "tf32":
        a, b = round_tf32(a), round_tf32(b)
    if precision in ("tf32x3", "bf16x3"):  # a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo b_lo dropped)
        if precision == "tf32x3":
            ah, bh = round_tf32(a), round_tf32(b)
            al, bl = truncate_tf32(a - ah), truncate_tf32(b - bh)
        else:  # bf16 halves (8 mantissa bits each): half the tensor-core time of tf32x3
            ah, bh = a.bfloat16().float(), b.bfloat16().float()
            al, bl = (a - ah).bfloat16().float(), (b - bh).bfloat16().float()
        return (ah.double() @ bh.double() + ah.double() @ bl.double() + al.double() @ bh.double()).float()
    return (a.double() @ b.double()).float()


def solve(akk: torch.Tensor, precision: str) -> torch.Tensor:
    """``(I + akk)^-1`` of a strictly lower ``[64, 64]`` fp32 ``akk`` by the kernel's blocks and dots."""
    n = CHUNK // BLOCK
    a = [[akk[BLOCK * i:BLOCK * (i + 1), BLOCK * j:BLOCK * (j + 1)] for j in range(n)] for i in range(n)]
    t = {}
    for i in range(n):
        lo = a[i][i]
        x = torch.eye(BLOCK) - lo
        l2 = dot(lo, lo, precision)
        x = x + dot(x, l2, precision)
        l4 = dot(l2, l2, precision)
        x = x + dot(x, l4, precision)
        t[i, i] = x + dot(x, dot(l4, l4, precision), precision)
        for j in range(i - 1, -1, -1):
            t[i, j] = -dot(t[i, i], sum(dot(a[i][m], t[m, j], precision) for m in range(j, i)), precision)
    out = torch.zeros(CHUNK, CHUNK)
    for (i, j), block in t.items():
        out[BLOCK * i:BLOCK * (i + 1), BLOCK * j:BLOCK * (j + 1)] = block
    return out


def correlated_chunk(gen: torch.Generator, head_dim: int, directions: int, noise: float):
    """float64 ``A_kk`` (strictly lower, times β) of one chunk: unit keys near a ``directions``-dim subspace, bf16
    keys and β, a bounded gate near 0 (little decay, so A_kk stays far from 0)."""
    base = torch.randn(directions, head_dim, generator=gen)
    k = torch.randn(CHUNK, head_dim, generator=gen) * noise + torch.randn(CHUNK, directions, generator=gen) @ base
    k = torch.nn.functional.normalize(k, dim=-1).bfloat16().double()
    beta = (torch.rand(CHUNK, generator=gen) * 0.2 + 0.8).bfloat16().double()
    gam = (-5 * torch.sigmoid(torch.randn(CHUNK, head_dim, generator=gen) - 6)).double().cumsum(0)
    akk = (k * gam.exp()) @ (k * (-gam).exp()).T
    return torch.tril(beta[:, None] * akk, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--directions", type=int, default=2, help="the subspace the keys share")
    p.add_argument("--noise", type=float, default=0.1, help="key noise off the subspace (before normalising)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    errors = {"tf32 dots": [], "bf16x3 dots": [], "tf32x3 dots": [], "fp32 dots": [], "tf32x3 dots, stored bf16": []}
    largest = []
    for _ in range(args.chunks):
        akk = correlated_chunk(gen, args.head_dim, args.directions, args.noise)
        ref = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + akk)
        scale = ref.abs().max()
        largest.append(float(scale))
        x3 = solve(akk.float(), "tf32x3")
        for name, t in (("tf32 dots", solve(akk.float(), "tf32")), ("bf16x3 dots", solve(akk.float(), "bf16x3")),
                        ("tf32x3 dots", x3),
                        ("fp32 dots", solve(akk.float(), "ieee")), ("tf32x3 dots, stored bf16", x3.bfloat16())):
            errors[name].append(float((t.double() - ref).abs().max() / scale))
    rows = []
    print(f"{args.chunks} chunks, head dim {args.head_dim}, largest |T| entry median "
          f"{torch.tensor(largest).median():.2f}\n")
    print("| T computed with | error / max |T|, median | max |")
    print("|---|---|---|")
    for name, errs in errors.items():
        e = torch.tensor(errs)
        rows.append({"solve": name, "median": float(e.median()), "max": float(e.max())})
        print(f"| {name} | {e.median():.2e} | {e.max():.2e} |")
    if args.out:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
