"""How the Triton kernel tests run without a GPU: under ``TRITON_INTERPRET=1``, which takes effect only before triton
is first imported. Import this module before anything that imports triton. When another test module imported
triton earlier in the same process, the kernel tests of a file are skipped there and ``rerun_in_interpreter``
reruns the whole file in a fresh process with the flag set."""

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


def rerun_in_interpreter(path, timeout):
    """Run the test file at ``path`` in a fresh interpreter process with ``TRITON_INTERPRET=1``; it must pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]


SM90_PRELUDE = r"""
import torch, triton
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
print("compiled", len(launches))
"""


def check_compiles_for_sm90(launch: str, expected: int) -> None:
    """Compile a kernel for an H100/H200 (sm_90) as the GPU would launch it, without a GPU: ``launch`` (Python run
    after ``SM90_PRELUDE``) sets ``kernel`` to the jit function, replaces the module's attribute by ``Record()`` and
    calls the host code, whose launches are recorded; each is then compiled to a cubin in a process without the
    interpreter. ``expected``: the number of launches."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SM90_PRELUDE + launch + SM90_COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and f"compiled {expected}" in res.stdout, res.stderr[-3000:]
