"""Where a saved model's forward first turns non-finite, down to the KDA kernel buffer (CUDA).

    PYTHONPATH=src python tools/localize_nonfinite.py MODEL_DIR --out DIR [--dtype bfloat16] [--lengths 256,8192]

1. Held-out rows of the embedded corpus (`kdamoe.data.validation_rows`, packed documents with `position_ids`, as
   `kdamoe-eval` reads them), cut to each of `--lengths`: the first sublayer (`model.layers.N.mixer` / `.ffn`) whose
   output holds a NaN or an infinity.
2. When that sublayer is a KDA mixer: the same input through the mixer again, per row, with grad (the training path,
   `conv_chunk_kda`), in fp32, and in fp32 under bf16 autocast; then op by op (fused projections, conv + SiLU against
   its torch reference, q/k L2 norm, the chunked op on Triton in the input dtype and in fp32, and on torch in fp32).
3. The forward kernels one by one on those inputs (`kda_chunk_fwd.prepare_chunks`, `state_loop`, `output_chunks`),
   every buffer checked (shape, dtype, finite, largest magnitude, first bad index); the inputs of the document that
   holds the first bad token are written to `--out` (`q.pt`, `k.pt`, `v.pt`, `g.pt`, `meta.pt`: β, A_log, dt_bias,
   gate, bounds), at most 7,680 tokens, to replay on any machine.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

from kdamoe.data import load_corpus, validation_rows
from kdamoe.model import kda_chunk, kda_chunk_fwd, kda_launch
from kdamoe.model.fused_norm import l2norm
from kdamoe.model.kda import chunk_kda
from kdamoe.model.kda_chunk import chunk_kda_triton
from kdamoe.model.modeling_kdamoe import KDAMoEForCausalLM, KDAMoEKimiDeltaAttention, fused_projections
from kdamoe.model.short_conv import short_conv_silu, short_conv_silu_torch

SAVE_TOKENS = 7680


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finite(t) -> bool:
    return bool(torch.isfinite(t).all())


def describe(name: str, t: torch.Tensor) -> bool:
    ok = torch.isfinite(t)
    line = f"   {name:6s} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} finite={bool(ok.all())}"
    line += f" absmax={float(t[ok].float().abs().max()) if ok.any() else float('nan'):.4g}"
    if not ok.all():
        line += f" first bad {(~ok).nonzero()[0].tolist()} of {int((~ok).sum())}"
    print(line, flush=True)
    return bool(ok.all())


def first_bad_sublayer(model, ids, pos, lengths):
    """`(name, module, args, kwargs)` of the first sublayer with a non-finite output at the shortest failing length."""
    caught = {}

    def hook(name):
        def record(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            if "name" not in caught and torch.is_tensor(out) and not finite(out):
                caught.update(name=name, module=module, args=args, kwargs=kwargs)
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules()
               if n.startswith("model.layers.") and n.count(".") == 3]
    try:
        for T in lengths:
            with torch.no_grad():
                logits = model(input_ids=ids[:, :T], position_ids=pos[:, :T], use_cache=False).logits
            print(f"T={T}: logits finite {finite(logits)}; first non-finite sublayer: {caught.get('name')}", flush=True)
            if "name" in caught:
                return caught
    finally:
        for h in handles:
            h.remove()
    return None


def mixer_variants(mixer, x, kwargs):
    with torch.no_grad():
        print("again:", finite(mixer(x, **kwargs)), "| per row, unpacked:",
              [finite(mixer(x[i:i + 1], **{**kwargs, "packed": None})) for i in range(x.shape[0])])
    with torch.enable_grad():
        print("with grad (conv_chunk_kda):", finite(mixer(x, **kwargs)))
    wide = copy.deepcopy(mixer).float()
    with torch.no_grad():
        print("fp32:", finite(wide(x.float(), **kwargs)))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            print("fp32 under bf16 autocast:", finite(wide(x.float(), **kwargs)))


def kda_inputs(mixer, x, packed):
    """The chunked op's inputs as the mixer's inference path builds them: `[q, k, v, g_raw, β]`, flattened to one
    row when packed."""
    B, T, _ = x.shape
    h, k = mixer.num_heads, mixer.head_dim
    qkv, beta, decay, _ = fused_projections(x, (mixer.q_proj, mixer.k_proj, mixer.v_proj), (mixer.beta_proj,),
                                            (mixer.decay_down_proj,), (mixer.out_gate_down_proj,))
    beta = beta.float().sigmoid()
    g_raw = mixer.decay_up_proj(decay).view(B, T, h, k)
    cu_dev = packed.cu_seqlens_device if packed is not None else None
    mixed = short_conv_silu(qkv, mixer.conv_weight, cu_seqlens=cu_dev)
    ref = short_conv_silu_torch(qkv.float(), mixer.conv_weight.float(), cu_seqlens=cu_dev)
    print("conv: Triton against torch in fp32, max |diff|", float((mixed.float() - ref).abs().max()))
    for name, t in (("qkv", qkv), ("beta", beta), ("g_raw", g_raw), ("conv", mixed)):
        describe(name, t)
    q, key, v = (t.reshape(B, T, h, k) for t in mixed.split(h * k, dim=-1))
    inputs = [l2norm(q), l2norm(key), v.contiguous(), g_raw, beta]
    if packed is not None:
        inputs = [t.reshape(1, B * T, *t.shape[2:]) for t in inputs]
    return inputs


def step_through_kernels(mixer, inputs, cu_seqlens):
    """The forward kernels on `inputs` with every buffer kept and checked; the first bad token index or None."""
    dev = inputs[0].device
    B, T, H, K = inputs[0].shape
    V = inputs[2].shape[-1]
    flat = kda_chunk.flatten_rows(*inputs)
    mode = 1 if mixer.gate == "bounded" else 2
    lower = mixer.lower_bound if mixer.gate == "bounded" else 0.0
    gate = kda_chunk.gate_args(mode, mixer.A_log, mixer.dt_bias, lower, H, K, dev)
    tables = kda_launch.chunk_tables(B, T, cu_seqlens, dev)
    TT, NC, scale = flat[0].shape[0], tables.num_chunks, K ** -0.5
    # the dtypes `kda_chunk_fwd.chunk_fwd` gives its buffers in the output's forward
    low = dict(device=dev, dtype=flat[0].dtype if flat[0].dtype in (torch.bfloat16, torch.float16) else torch.float32)
    tables16 = dict(device=dev, dtype=torch.bfloat16 if flat[0].dtype == torch.bfloat16 else torch.float32)
    wide = dict(device=dev, dtype=torch.float32)
    buf = kda_chunk_fwd.ChunkBuffers(
        aqk=torch.zeros(TT, H, 64, **tables16), tinv=torch.zeros(TT, H, 64, **tables16), w=torch.zeros(TT, H, K, **low),
        kd=torch.zeros(TT, H, K, **low), u=torch.zeros(TT, H, V, **low), qg=None, dl=torch.zeros(NC, H, K, **wide),
        gam=torch.zeros(TT, H, K, **wide))
    safe = kda_chunk._safe_path(mixer.gate, mixer.lower_bound)
    print(f"kernels: {TT} tokens, {NC} chunks, {tables.num_seqs} sequences, safe path {safe}")
    kda_chunk_fwd.prepare_chunks(flat, gate, scale, safe, tables, buf, None, intra=True)
    sync(dev)
    for name in ("gam", "aqk", "tinv", "w", "kd", "u", "dl"):
        describe(name, getattr(buf, name))
    buf.hs, buf.o = torch.zeros(NC, H, K, V, **low), torch.zeros(TT, H, V, **low)
    final = torch.zeros(tables.num_seqs, H, K, V, **wide)
    kda_chunk_fwd.state_loop(tables, flat[0], buf, None, final, scale)
    sync(dev)
    describe("hs", buf.hs), describe("U", buf.u), describe("final", final)
    kda_chunk_fwd.output_chunks(tables, flat[0], buf, scale)
    sync(dev)
    describe("o", buf.o)
    for name in ("gam", "aqk", "tinv", "w", "kd", "u", "o"):
        t = getattr(buf, name)
        if not finite(t):
            token = int((~torch.isfinite(t)).nonzero()[0, 0])
            print(f"first bad buffer: {name}, token {token}")
            return token
    return None


def save_document(mixer, inputs, cu_seqlens, token, out: Path):
    """The inputs of the document (or row) holding `token`, up to SAVE_TOKENS tokens, as .pt files in `out`."""
    T = inputs[0].shape[1]
    if cu_seqlens is not None:
        cu = cu_seqlens.cpu().long()
        d = int(torch.searchsorted(cu, torch.tensor(token), right=True)) - 1
        row, a, b = 0, int(cu[d]), int(cu[d + 1])
    else:
        row, col = divmod(token, T)
        a, b = 0, T
    b = min(b, a + SAVE_TOKENS)
    part = [t[row:row + 1, a:b].contiguous() for t in inputs]
    kw = dict(use_gate_in_kernel=True, A_log=mixer.A_log, dt_bias=mixer.dt_bias, gate=mixer.gate,
              lower_bound=mixer.lower_bound if mixer.gate == "bounded" else None)
    with torch.no_grad():
        print(f"document of the first bad token: row {row}, tokens [{a}, {b}); alone on Triton: "
              f"finite {finite(chunk_kda_triton(*part, **kw)[0])}")
    out.mkdir(parents=True, exist_ok=True)
    for name, t in zip(("q", "k", "v", "g"), part):
        torch.save(t.cpu(), out / f"{name}.pt")
    torch.save(dict(beta=part[4].cpu(), A_log=mixer.A_log.detach().cpu(), dt_bias=mixer.dt_bias.detach().cpu(),
                    gate=mixer.gate, lower_bound=mixer.lower_bound, rows=(row, a, b), token=token), out / "meta.pt")
    print(f"wrote the document's KDA inputs to {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--out", type=Path, required=True, help="folder for the failing document's KDA inputs")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--lengths", default="256,1024,4096,8192", help="row lengths to try, shortest first")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels under TRITON_INTERPRET=1 (small rows)")
    args = p.parse_args()
    lengths = sorted(int(t) for t in args.lengths.split(","))
    dev = torch.device(args.device)
    model = KDAMoEForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(dev).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    val = validation_rows(load_corpus("stdlib", "all"), tokenizer, lengths[-1], args.rows)
    ids, pos = val["input_ids"].to(dev), val["position_ids"].to(dev)
    caught = first_bad_sublayer(model, ids, pos, lengths)
    if caught is None:
        print("every length finite")
        return
    mixer, x, kwargs = caught["module"], caught["args"][0], caught["kwargs"]
    print(f"{caught['name']} ({type(mixer).__name__}); its input finite: {finite(x)}")
    if not isinstance(mixer, KDAMoEKimiDeltaAttention):
        return
    mixer_variants(mixer, x, kwargs)
    packed = kwargs.get("packed")
    cu = packed.cu_seqlens if packed is not None else None
    with torch.no_grad():
        inputs = kda_inputs(mixer, x, packed)
        for name, t in zip(("q", "k", "v"), inputs):
            describe(name, t)
        kw = dict(use_gate_in_kernel=True, A_log=mixer.A_log, dt_bias=mixer.dt_bias, gate=mixer.gate,
                  lower_bound=mixer.lower_bound if mixer.gate == "bounded" else None, cu_seqlens=cu)
        wide = [t.float() for t in inputs]
        kw32 = {**kw, "A_log": mixer.A_log.float(), "dt_bias": mixer.dt_bias.float()}
        print("op, Triton in", str(inputs[0].dtype).removeprefix("torch."), finite(chunk_kda_triton(*inputs, **kw)[0]),
              "| Triton fp32", finite(chunk_kda_triton(*wide, **kw32)[0]),
              "| torch fp32", finite(chunk_kda(*wide, backend="torch", **kw32)[0]))
        token = step_through_kernels(mixer, inputs, cu)
        if token is not None:
            save_document(mixer, inputs, cu, token, args.out)


if __name__ == "__main__":
    sys.exit(main())
