"""How the Triton kernel tests run without a GPU: under ``TRITON_INTERPRET=1``, which takes effect only before triton
is first imported. Import this module before anything that imports triton. When another test module imported
triton earlier in the same process, the kernel tests of a file are skipped there and ``rerun_in_interpreter``
reruns the whole file in a fresh process with the flag set. Under the interpreter ``tl.reduce`` with a kernel's own
combine function runs vectorised (``_tree_reduce``)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
if not ON_GPU and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton.language as tl
except ImportError:
    tl = None

HAS_TRITON = tl is not None
NEEDS_SUBPROCESS = HAS_TRITON and not ON_GPU and type(tl.cumsum).__name__ != "InterpretedFunction"

kernel_test = pytest.mark.skipif(not HAS_TRITON or NEEDS_SUBPROCESS,
                                 reason="needs triton, run in this process on a GPU or under the interpreter")
rerun_test = pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="the kernels run in this process")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _tree_reduce(self, input):
    """``tl.reduce`` with a combine function of the kernel's own, in log2(n) vectorised calls of it: the interpreter
    calls it once per element (minutes for a model-level test). The combine function is associative, as ``tl.reduce``
    requires, so halving the axis pairwise gives the result of the GPU's tree up to the order of rounding."""
    import numpy as np

    axis = self.axis
    data = [t.handle.data if axis is not None else t.handle.data.reshape(-1) for t in input]
    data = [np.moveaxis(d, axis or 0, -1) for d in data]
    while data[0].shape[-1] > 1:
        half = data[0].shape[-1] // 2
        a = [self.to_tensor(d[..., :half], t.dtype) for d, t in zip(data, input)]
        b = [self.to_tensor(d[..., half:2 * half], t.dtype) for d, t in zip(data, input)]
        out = self.combine_fn.fn(*a, *b)
        out = out if isinstance(out, tuple) else (out,)
        out = [np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else o, d[..., :half].shape)
               for o, d in zip(out, data)]
        data = [np.concatenate([o, d[..., 2 * half:]], -1) for o, d in zip(out, data)]
    data = [d[..., 0] for d in data]
    if self.keep_dims:
        data = [np.expand_dims(d, axis) if axis is not None else d.reshape((1,) * t.handle.data.ndim)
                for d, t in zip(data, input)]
    elif axis is None:
        data = [d.item() for d in data]
    return [self.to_tensor(d, t.dtype) for d, t in zip(data, input)]


if HAS_TRITON and not ON_GPU and not NEEDS_SUBPROCESS:
    from triton.runtime import interpreter as _interpreter

    if hasattr(getattr(_interpreter, "ReduceOps", None), "generic_reduce"):
        _interpreter.ReduceOps.generic_reduce = _tree_reduce


def rerun_in_interpreter(path, timeout):
    """Run the test file at ``path`` in a fresh interpreter process with ``TRITON_INTERPRET=1``; it must pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]


SM90_PRELUDE = r"""
import json, os, sys, traceback
import torch, triton
import kdamoe.model  # the slow imports once, before the pieces fork
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

launches = []
class Record:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((args, kwargs))
"""

SM90_COMPILE = r"""
for args, kwargs in launches:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constants = {}, {}
    for name, param in zip(kernel.arg_names, kernel.params):
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", values[name]
        else:
            signature[name] = native_specialize_impl(CUDABackend, values[name], False, True, True)[0]
            if signature[name] == "constexpr":
                constants[name] = values[name]
    triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
print("compiled", kernel.fn.__name__, len(launches), flush=True)
"""

SM90_EACH = r"""
for piece in json.loads(sys.argv[1]):  # each in a forked child: a piece replaces module attributes by Record()
    pid = os.fork()
    if pid == 0:
        try:
            exec(piece, dict(globals()))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(1)
"""


def check_compiles_for_sm90(launch: str, expected: int, kernels: tuple[str, ...] = ("",)) -> None:
    """Compile kernels for an H100/H200 (sm_90) as the GPU would launch them, without a GPU: ``launch`` (Python run
    after ``SM90_PRELUDE``, once per name in ``kernels``, which replaces ``{kernel}`` in it) sets ``kernel`` to the
    jit function, replaces the module's attribute by ``Record()`` and calls the host code, whose launches are
    recorded; each is then compiled to a cubin, in one process without the interpreter (a forked child per kernel).
    ``expected``: the number of launches of each kernel."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    pieces = [launch.replace("{kernel}", name) + SM90_COMPILE for name in kernels]
    res = subprocess.run([sys.executable, "-c", SM90_PRELUDE + SM90_EACH, json.dumps(pieces)], env=env,
                         capture_output=True, text=True, timeout=600)
    compiled = [line.split() for line in res.stdout.splitlines() if line.startswith("compiled ")]
    assert res.returncode == 0 and len(compiled) == len(kernels), res.stdout[-2000:] + res.stderr[-3000:]
    for _, name, count in compiled:
        assert int(count) == expected, f"{name}: {count} launches, expected {expected}"
