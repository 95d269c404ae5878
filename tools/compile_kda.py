"""Compile every KDA kernel launch of one forward+backward (or, ``--conv``, the short convolution's: forward, backward
plain and with packed documents, the KDA layer's three-way split) for an H100/H200 (sm_90) on a machine without a GPU,
and print each kernel's registers, spill stack and shared memory: what limits occupancy and whether triton pipelined a
loop's loads (its shared memory grows with `num_stages` only then), before spending device time on a version.

The host code runs on CPU tensors with every kernel launch recorded instead of run; each launch is then compiled
with the specialisations triton's launcher gives it on the GPU (16-byte-aligned pointers and multiples of 16 as
divisibility hints, ints equal to 1 as constants — without the hints the loads are not vectorised, nothing is
pipelined and the counts are far off), and with the host code's GPU choices (`kda_launch.lp`: 16-bit tensor-core
dots and ftz exponentials; `kda_launch.few_loop_programs`: which loop launch settings, `--few`). Use the triton the
device has (3.6 on our H200): a different triton compiles differently. With it, the registers and shared memory
printed here equal Nsight Compute's on the H200.

    pip install --target /tmp/tr36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/tr36:src python tools/compile_kda.py [--dtype bf16] [--dim 128] [--heads 16] [--few] \
        [--launch '{"fwd_o": {"num_warps": 4}}'] [--slice '{"wu_k": 32}'] [--sass _intra_kernel [--lines 20]]
    PYTHONPATH=/tmp/tr36:src python tools/compile_kda.py --conv --heads 8 [--launch '{"dpre": {"BT": 16}}'] \
        [--sass _conv_dpre_kernel]          # C = 3 · heads · dim channels (the KDA layer's q | k | v)

``--sass KERNEL`` also prints that kernel's SASS opcode counts (static: an instruction in a loop counts once), by
group — tensor-core MMAs, shared-memory traffic, barriers and shuffles, MUFU (exp, reciprocal), global loads and
stores, local memory (spills) — to compare two versions of a kernel instruction by instruction without a GPU;
``--lines N`` the N source lines (of the model folder's `kda_*.py` and `short_conv.py`) that compile to the most
instructions (a loop body's lines run once per iteration, so weigh them by its trip count: in `_intra_kernel` the
slice loop runs K/16 times, the solve once).
"""
import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from kdamoe.model import kda_chunk, kda_launch, short_conv

MODEL_DIR = os.path.dirname(kda_launch.__file__)


class Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead of running it."""

    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def specialise(fn, args, kwargs):
    """(signature, constexprs, attrs, options) of one launch, by the specialisation triton's launcher applies on a
    GPU (its own native routine: types, 16-byte alignment and multiples of 16, ints equal to 1 as constants)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    values = dict(zip(fn.arg_names, args), **kwargs)
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = values.get(name, param.default)
        if param.is_constexpr:
            sig[name], consts[name] = "constexpr", v
            continue
        ty, key = native_specialize_impl(CUDABackend, v, param.is_const, not param.do_not_specialize,
                                         not param.do_not_specialize_on_alignment)
        sig[name] = ty
        if ty == "constexpr":
            consts[name] = key
        elif isinstance(key, str) and CUDABackend.parse_attr(key):
            attrs[(i,)] = CUDABackend.parse_attr(key)
    return sig, consts, attrs, options


def cubin_tool(compiled, tool, flag):
    """stdout of ``tool flag cubin`` for a compiled kernel, by the CUDA tool that ships with triton."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([path, flag, f.name], capture_output=True, text=True).stdout


def resources(compiled):
    """(registers, stack bytes) from the cubin (cuobjdump)."""
    out = cubin_tool(compiled, "cuobjdump", "-res-usage")
    fields = dict(kv.split(":") for line in out.splitlines() if "REG:" in line for kv in line.split() if ":" in kv)
    return int(fields["REG"]), int(fields["STACK"])


SASS_GROUPS = {"mma": ("HMMA", "HGMMA"), "shared": ("LDS", "STS", "LDSM"), "sync": ("BAR", "SHFL"),
               "mufu": ("MUFU",), "global": ("LDG", "STG", "LDGSTS"), "local (spill)": ("LDL", "STL")}


def sass_by_line(compiled):
    """{(file, line) of the model folder's kda_*.py and short_conv.py files (None: no line info): Counter of opcodes
    (without modifiers)} of the cubin's SASS (nvdisasm with the line information triton compiles in). A helper's line
    stands for every call inlined there."""
    out = cubin_tool(compiled, "nvdisasm", "-g")
    by_line, line_no = collections.defaultdict(collections.Counter), None
    for line in out.splitlines():
        m = re.search(r'//## File "(?:.*/)?(kda_\w+\.py|short_conv\.py)", line (\d+)', line)
        if m:
            line_no = (m.group(1), int(m.group(2)))
        elif "//## File" in line:  # another file (triton's language helpers): keep the caller's line
            continue
        if "/*" not in line or ";" not in line:
            continue
        words = line.split("*/", 1)[-1].strip().rstrip(";").split()
        if words and words[0].startswith("@"):  # a predicate
            words = words[1:]
        if words:
            by_line[line_no][words[0].split(".")[0]] += 1
    return by_line


def print_sass(name, by_line, lines):
    counts = sum(by_line.values(), collections.Counter())
    groups = ", ".join(f"{g} {sum(counts.get(op, 0) for op in ops)}" for g, ops in SASS_GROUPS.items())
    print(f"  {name} SASS: {counts.total()} instructions; {groups}")
    print("  most frequent: " + ", ".join(f"{op} {n}" for op, n in counts.most_common(12)))
    if lines:
        sources = {}
        print(f"  the {lines} source lines with the most instructions:")
        for line_no, ops in sorted(by_line.items(), key=lambda x: -x[1].total())[:lines]:
            if line_no is None:
                where, text = "-", "(no line information)"
            else:
                name, number = line_no
                if name not in sources:
                    with open(os.path.join(MODEL_DIR, name)) as f:
                        sources[name] = f.read().splitlines()
                where, text = f"{name}:{number}", sources[name][number - 1].strip()[:60]
            print(f"  {ops.total():6d}  {where:>26}  {text}")
            print("                 " + ", ".join(f"{op} {n}" for op, n in ops.most_common(6)))


@contextlib.contextmanager
def recording(modules, launches, stand_ins):
    """Within the block, every ``*_kernel`` JIT function of ``modules`` records its launches into ``launches``
    instead of running, and each ``(old, new)`` of ``stand_ins`` replaces ``old`` wherever a module holds it by name
    (the host code's GPU choices); all restored after."""
    replaced = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                stand_in = Recorder(value, launches)
            else:
                stand_in = next((new for old, new in stand_ins if value is old), None)
                if stand_in is None:
                    continue
            replaced.append((module, name, value))
            setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, value in replaced:
            setattr(module, name, value)


def record_kda(args, dtype):
    """The KDA kernel launches of one bf16 forward+backward as the model calls the op, recorded with the GPU's
    choices of `lp` and `few_loop_programs`."""
    H, D, T = args.heads, args.dim, 256
    launches = []
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("kdamoe.model.kda")]
    stand_ins = ((kda_launch.lp, lambda x: True), (kda_launch.few_loop_programs, lambda *a: args.few))
    with recording(modules, launches, stand_ins):
        q, k = (torch.randn(1, T, H, D, dtype=dtype) for _ in range(2))  # raw: the L2 norm in the kernels
        v, g = torch.randn(1, T, H, D, dtype=dtype), torch.randn(1, T, H, D, dtype=dtype)
        beta = torch.rand(1, T, H, dtype=dtype)
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
        o, _ = kda_chunk.chunk_kda_triton(*leaves, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                          A_log=torch.zeros(H), dt_bias=torch.zeros(H * D), gate=args.gate)
        o.backward(torch.randn_like(o))
    return launches


def record_conv(args, dtype):
    """The short convolution's launches in the KDA layer (W = 4, its q | k | v thirds): the forward, and the
    backward of plain rows and of packed documents, recorded (persistent grids sized for 132 SMs)."""
    launches = []
    programs = (short_conv.persistent_programs,
                lambda device, n, columns=1, per_sm=16: max(1, min(n, per_sm * 132 // columns)))
    with recording([short_conv], launches, [programs]):
        C, T = 3 * args.heads * args.dim, 1024
        x, w = torch.randn(1, T, C, dtype=dtype), torch.randn(C, 4, dtype=dtype)
        short_conv.conv_silu_fwd(x, w, None, None, split=True)
        dys = [torch.randn(1, T, C // 3, dtype=dtype) for _ in range(3)]
        for cu in (None, torch.tensor([0, T // 2, T], dtype=torch.int32)):
            short_conv.conv_silu_bwd(x, w, cu, None, dys)
    return launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conv", action="store_true", help="the short convolution's kernels instead of KDA's")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--dim", type=int, default=128, help="head dim K = V")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--gate", default="bounded", choices=["bounded", "softplus"])
    ap.add_argument("--few", action="store_true", help="the launch settings for fewer loop programs than SMs")
    ap.add_argument("--launch", default="{}", help="JSON overrides of kda_launch.LAUNCH (--conv: short_conv.LAUNCH), "
                    "e.g. '{\"fwd_o\": {\"num_warps\": 4}}'")
    ap.add_argument("--slice", default="{}", help="JSON overrides of kda_launch.SLICE")
    ap.add_argument("--sass", metavar="KERNEL", help="also print this kernel's SASS opcode counts")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="with --sass: the N source lines with the most SASS instructions, and their opcodes")
    args = ap.parse_args()
    launch, slices = json.loads(args.launch), json.loads(args.slice)
    launch_table = short_conv.LAUNCH if args.conv else kda_launch.LAUNCH
    for given, known, flag in ((launch, launch_table, "--launch"), (slices, kda_launch.SLICE, "--slice")):
        if set(given) - set(known):
            ap.error(f"{flag}: unknown keys {sorted(set(given) - set(known))} (known: {sorted(known)})")
    for name, cfg in launch.items():
        launch_table[name] = {**launch_table[name], **cfg}
    kda_launch.SLICE.update(slices)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    launches = record_conv(args, dtype) if args.conv else record_kda(args, dtype)
    target = GPUTarget("cuda", 90, 32)
    if args.conv:
        print(f"triton {triton.__version__}, sm_90, {args.dtype}, C={3 * args.heads * args.dim}, W=4")
    else:
        print(f"triton {triton.__version__}, sm_90, {args.dtype}, H={args.heads}, K=V={args.dim}, {args.gate} gate,"
              f" {'few' if args.few else 'many'}-program loop settings")
    print(f"{'kernel':22s} {'warps':>5s} {'stages':>6s} {'registers':>9s} {'stack B':>7s} {'shared B':>8s}")
    seen = set()
    for fn, a, kw in launches:
        sig, consts, attrs, options = specialise(fn, a, dict(kw))
        key = (fn.__name__, str(sig), str(consts), str(attrs), str(options))
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options)
        regs, stack = resources(compiled)
        print(f"{fn.__name__:22s} {options.get('num_warps', 4):5d} {options.get('num_stages', 3):6d} {regs:9d}"
              f" {stack:7d} {compiled.metadata.shared:8d}")
        if fn.__name__ == args.sass:
            print_sass(fn.__name__, sass_by_line(compiled), args.lines)


if __name__ == "__main__":
    main()
