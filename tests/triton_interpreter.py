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
