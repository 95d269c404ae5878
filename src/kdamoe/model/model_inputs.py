"""What the model derives from a forward's inputs before the layers run: the token-id check, the document tables
of packed rows, the attention layers' mask, and the names of damaged weights files. Shapes: B batch, T new tokens,
Tk attended tokens."""

import dataclasses
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.modeling_utils import safe_open


class TokenIdCheck:
    """Token ids outside `[0, vocab_size)` are a `ValueError`, without a host round trip on a CUDA device.

    Ids elsewhere are checked at once. On a CUDA device the ids are clamped into range (no device fault) and their
    min and max, copied to pinned host memory behind the forward, raise at the first later call that finds the copy
    done: the forward that read a bad id is reported one call late, and no call waits for the device.

    Under `torch.compile` or a CUDA graph's recording the check is part of the graph (no host read, no graph break):
    an assertion on the device (a `RuntimeError` with the same message at the call on the CPU, a device-side assert on
    CUDA), then the clamp.
    """

    def __init__(self):
        self._pending = None  # (copy-done event, pinned [min, max], vocab size) of the last CUDA call

    def __call__(self, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if torch.compiler.is_compiling() or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            torch._assert_async(((input_ids >= 0) & (input_ids < vocab_size)).all(), _token_id_message(vocab_size))
            return input_ids.clamp(0, vocab_size - 1)
        self.raise_pending()
        if input_ids.numel() == 0:
            return input_ids
        if not input_ids.is_cuda:
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= vocab_size:
                raise _token_id_error(low, high, vocab_size)
            return input_ids
        stats = torch.empty(2, dtype=input_ids.dtype, pin_memory=True)
        stats.copy_(torch.stack([input_ids.min(), input_ids.max()]), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (done, stats, vocab_size)
        return input_ids.clamp(0, vocab_size - 1)

    def raise_pending(self) -> None:
        """Raise for an earlier call's bad ids once their min and max have reached the host."""
        if self._pending is None or not self._pending[0].query():
            return
        _, stats, vocab_size = self._pending
        self._pending = None
        low, high = stats.tolist()
        if low < 0 or high >= vocab_size:
            raise _token_id_error(low, high, vocab_size)


def _token_id_message(vocab_size: int) -> str:
    return f"`input_ids` holds token ids outside [0, vocab_size={vocab_size})"


def _token_id_error(low: int, high: int, vocab_size: int) -> ValueError:
    return ValueError(f"{_token_id_message(vocab_size)}: min {low}, max {high}")


_PACKED_UNDER_COMPILE = (
    "packed sequences (position_ids restarting at 0 after a real token of the row) need eager mode: under "
    "torch.compile every row runs as one document"
)


@dataclasses.dataclass
class PackedDocuments:
    """Document structure of a packed batch, derived from `position_ids` that restart at 0.

    `doc_ids`: `[B, T]` global document index of each token; `cu_seqlens`: `[N + 1]` int32 offsets of the N
    documents in the flattened `[1, B*T]` sequence, on the host (the KDA kernels build their chunk tables from it
    without a device round trip, the attention layers split long rows by it) and in `cu_seqlens_device` on the
    inputs' device (the short convolution reads it there); `last_doc_of_row`: `[B]` the document each row ends in;
    `last_doc_start`: `[B]` int64 on the inputs' device, the column where that document starts (a cache keeps it:
    later tokens continue that document); `longest_document`: the most tokens of one document (host int).
    """

    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_device: torch.Tensor
    last_doc_of_row: torch.Tensor
    last_doc_start: torch.Tensor
    longest_document: int

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, device: torch.device, token_mask: torch.Tensor | None = None
    ) -> "PackedDocuments | None":
        """None when every row holds a single document (the fast, unpacked path). The tables are built on the host
        and sent to `device`: `position_ids` on the host (as `kdamoe-train` passes them) cost no device round trip,
        on the device one.

        Under `torch.compile` the document count would set the shapes: the batch runs unpacked, and an assertion on
        the device (a `RuntimeError` on the CPU) rejects a real token (`token_mask [B, T]` True, or every token
        without a mask) whose position restarts at 0 after a real token of its row. Restarts after padding only (the
        left padding of `generate`) give the unpacked result, since padded tokens carry no state."""
        if torch.compiler.is_compiling():
            starts = position_ids.to(device) == 0
            real = torch.ones_like(starts) if token_mask is None else token_mask.bool()
            after_real = real.long().cumsum(1) > real.long()  # a real token precedes this one in its row
            torch._assert_async(~(starts & real & after_real).any(), _PACKED_UNDER_COMPILE)
            return None
        starts = (position_ids == 0).cpu()
        starts[:, 0] = True
        if int(starts.sum()) == starts.shape[0]:
            return None
        flat = starts.flatten()
        doc_ids = (flat.cumsum(0) - 1).view_as(starts)
        last_doc_start = torch.where(starts, torch.arange(starts.shape[1]), 0).amax(1)
        cu_seqlens = F.pad(flat.nonzero().flatten(), (0, 1), value=flat.numel()).to(torch.int32)
        device = torch.device(device)

        def put(x):  # a pinned copy: the host does not wait for it
            return (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)

        doc_ids = put(doc_ids)
        return cls(doc_ids=doc_ids, cu_seqlens=cu_seqlens, cu_seqlens_device=put(cu_seqlens),
                   last_doc_of_row=doc_ids[:, -1], last_doc_start=put(last_doc_start),
                   longest_document=int(cu_seqlens.diff().max()))


DENSE_MASK_ELEMENTS = 1 << 28  # the largest block-diagonal mask of packed rows; past it, attention runs per document


def build_attention_mask(
    padding_mask: torch.Tensor | None, packed: PackedDocuments | None, seq_len: int, past_len: int, device
) -> torch.Tensor | None:
    """Boolean mask `[B, 1, T, Tk]` (True = attend) for the attention layers, or None: plain causal attention, or
    for packed rows without padding whose mask would pass `DENSE_MASK_ELEMENTS` (`B * T * T`: 2^40 at 1M tokens),
    causal attention inside each document, one call per document (`KDAMoEAttention`).

    `padding_mask: [B, Tk]` is the 2-D attention mask (1 = real token) over past and new tokens. Each query may
    always attend to itself, so fully padded rows never produce NaN.
    """
    if padding_mask is None and packed is None and (past_len == 0 or seq_len == 1):
        return None
    if padding_mask is None and packed is not None and packed.doc_ids.numel() * seq_len > DENSE_MASK_ELEMENTS:
        return None
    kv_len = past_len + seq_len
    q_pos = torch.arange(past_len, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    allowed = (k_pos[None, :] <= q_pos[:, None]).unsqueeze(0)  # [1, T, Tk]
    if padding_mask is not None:
        allowed = allowed & padding_mask[:, None, :].bool()
    if packed is not None:  # only without a past: the documents of this forward
        allowed = allowed & (packed.doc_ids[:, :, None] == packed.doc_ids[:, None, :])
    allowed = allowed | (k_pos[None, :] == q_pos[:, None]).unsqueeze(0)
    return allowed.unsqueeze(1)


def unreadable_weights(path) -> str:
    """The `*.safetensors` files of a local folder that safetensors cannot open (else a description of them)."""
    if not os.path.isdir(path):
        return f"a weights file of the Hub repo {path} (in the Hugging Face cache)"
    bad = []
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:
            if not is_safetensors_error(error):
                raise
            bad.append(str(file))
    return ", ".join(bad) or f"a weights file of {path}"


def is_safetensors_error(error: Exception) -> bool:
    """safetensors' `SafetensorError`, named without importing safetensors (the folder imports only torch and
    transformers)."""
    return type(error).__name__ == "SafetensorError"
