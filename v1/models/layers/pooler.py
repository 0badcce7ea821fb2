"""Pooling of packed encoder outputs: per-request token reductions (CLS, mean, max, last, ...)
done as segment operations over the packed token axis, Matryoshka truncation, L2 normalization,
classifier activations, and the `Pooler` that turns one step's hidden states into each request's
float32 result for its task (embed, classify, score, encode).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from v1.host_copy import to_device
from v1.models.layers.norm import use_fused_encoder
from v1.pooling_config import ModelPoolingConfig
from v1.pooling_params import PoolingParams

ClassifyFn = Callable[[torch.Tensor], torch.Tensor]
"""First-token hidden states [N, hidden] -> classifier logits [N, num_labels] (float32)."""


@dataclass
class PoolingSegments:
    """One step's requests as contiguous segments of the packed token axis."""

    query_start_loc: torch.Tensor
    """[R + 1] int64 token offsets."""
    lengths: torch.Tensor
    """[R] int64 tokens per request."""
    lengths_cpu: list[int]
    _token_req: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_lengths(cls, lengths: np.ndarray, device: torch.device) -> PoolingSegments:
        """Segments of `lengths` tokens each. The host ships R + 1 offsets and R lengths in one
        copy; the device expands them to the [T] request index of each token when a pooling
        mode asks for it (`token_req`: a BERT step's ~31K indices are neither built on the host
        nor copied, and the fused mean pooling never needs them)."""
        lengths_np = np.asarray(lengths, dtype=np.int64)
        num_reqs = len(lengths_np)
        host = np.empty(2 * num_reqs + 1, dtype=np.int64)  # [offsets | lengths]
        host[0] = 0
        np.cumsum(lengths_np, out=host[1 : num_reqs + 1])
        host[num_reqs + 1 :] = lengths_np
        # non_blocking: no stream sync, so a pipelined step can be prepared while one runs.
        qsl, lengths_t = to_device(host, device).split([num_reqs + 1, num_reqs])
        return cls(qsl, lengths_t, lengths_np.tolist())

    @property
    def token_req(self) -> torch.Tensor:
        """[T] int64 request index of each token (built on the device at first use)."""
        if self._token_req is None:
            # output_size: the device needs no sync to learn the result's length.
            self._token_req = torch.repeat_interleave(
                torch.arange(self.num_reqs, device=self.lengths.device),
                self.lengths,
                output_size=sum(self.lengths_cpu),
            )
        return self._token_req

    @property
    def num_reqs(self) -> int:
        return len(self.lengths_cpu)

    @property
    def first_token_indices(self) -> torch.Tensor:
        return self.query_start_loc[:-1]

    @property
    def last_token_indices(self) -> torch.Tensor:
        return self.query_start_loc[1:] - 1


def segment_sum(values: torch.Tensor, seg: PoolingSegments) -> torch.Tensor:
    """values [T, H] -> per-request sums [R, H]."""
    out = values.new_zeros(seg.num_reqs, values.shape[1])
    return out.index_add_(0, seg.token_req, values)


def pool_tokens(hidden: torch.Tensor, seg: PoolingSegments, mode: str) -> torch.Tensor:
    """hidden [T, H] -> [R, H] float32 by one sentence-transformers pooling mode."""
    # The selecting modes convert only the rows they keep (not a float32 copy of [T, H]).
    if mode == "cls":
        return hidden[seg.first_token_indices].float()
    if mode == "last":
        return hidden[seg.last_token_indices].float()
    h = hidden.float()
    lengths = seg.lengths.to(h.dtype)[:, None]  # [R, 1]
    if mode == "mean":
        return segment_sum(h, seg) / lengths
    if mode == "mean_sqrt_len":
        return segment_sum(h, seg) / lengths.sqrt()
    if mode == "max":
        out = h.new_full((seg.num_reqs, h.shape[1]), float("-inf"))
        index = seg.token_req[:, None].expand_as(h)
        return out.scatter_reduce_(0, index, h, reduce="amax", include_self=True)
    if mode == "weightedmean":
        # Weight of a token = its 1-based index in its request (sentence-transformers).
        local = torch.arange(h.shape[0], device=h.device) - seg.query_start_loc[seg.token_req]
        weights = (local + 1).to(h.dtype)[:, None]  # [T, 1]
        return segment_sum(h * weights, seg) / segment_sum(weights, seg)
    raise ValueError(f"unknown pooling mode {mode!r}")


def pool(hidden: torch.Tensor, seg: PoolingSegments, modes: tuple[str, ...]) -> torch.Tensor:
    """Every mode's pooling, concatenated: [R, H * len(modes)] float32."""
    parts = [pool_tokens(hidden, seg, mode) for mode in modes]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2.0, dim=-1)


def apply_classifier_activation(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """logits [N, L] -> sigmoid | softmax (over labels) | unchanged."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "none":
        return logits
    raise ValueError(f"unknown classifier activation {activation!r}")


class Pooler:
    """One step's hidden states -> each request's float32 result for its PoolingParams.

    - embed: the model's pooling modes, then `dimensions` (Matryoshka: the first N values),
      then L2 normalization (params.normalize, default the model's); truncating before
      normalizing keeps truncated embeddings unit-length, as vLLM does.
    - classify: classifier logits [num_labels] of the first token, with the model's
      activation (sigmoid for one label / multi-label, softmax otherwise) unless
      activation=False.
    - score: the same for a one-label cross-encoder, as a 1-element array.
    - encode: per-token hidden states [n, hidden] (L2-normalized per token if normalize=True).
    """

    def __init__(self, config: ModelPoolingConfig, classify: ClassifyFn | None = None) -> None:
        self.config = config
        self.classify = classify

    def __call__(
        self, hidden: torch.Tensor, seg: PoolingSegments, params: list[PoolingParams]
    ) -> list[np.ndarray]:
        """Every request's result, in `params` order; params must have passed
        `validate_pooling_params` (the engine checks them at its edge and at admission)."""
        return self.launch(hidden, seg, params).result()

    def launch(
        self, hidden: torch.Tensor, seg: PoolingSegments, params: list[PoolingParams]
    ) -> PendingPooledOutput:
        """Enqueues the pooling and the copy of its results to the host; no host sync. The
        results stay stacked per group of requests with equal options (one tensor for a
        usual step) until the host splits them: no tensor op per request."""
        blocks: list[PooledBlock] = []
        by_task = _group(params, range(len(params)), lambda p: p.task)
        if "embed" in by_task:
            self._embed(hidden, seg, params, by_task["embed"], blocks)
        heads = by_task.get("classify", []) + by_task.get("score", [])
        if heads:
            self._classify(hidden, seg, params, heads, blocks)
        if "encode" in by_task:
            self._encode(hidden, seg, params, by_task["encode"], blocks)
        return PendingPooledOutput(len(params), blocks)

    def _embed(
        self,
        hidden: torch.Tensor,
        seg: PoolingSegments,
        params: list[PoolingParams],
        reqs: list[int],
        blocks: list[PooledBlock],
    ) -> None:
        default = self.config.normalize
        groups = _group(
            params,
            reqs,
            lambda p: (p.dimensions, default if p.normalize is None else p.normalize),
        )
        fused = _fused_mean_mode(hidden, self.config.pooling_modes)
        if fused is not None and len(groups) == 1:
            ((dims, normalize),) = groups
            if dims is None:
                # One kernel: the mean and the L2 normalization of every request.
                x = _segment_mean(hidden, seg, fused, normalize)
                if len(reqs) < len(x):
                    x = x[_device_index(reqs, x.device)]
                blocks.append(PooledBlock(x, groups[(dims, normalize)]))
                return
        if fused is not None:
            pooled = _segment_mean(hidden, seg, fused, False)  # [R, E]
        else:
            pooled = pool(hidden, seg, self.config.pooling_modes)  # [R, E]
        for (dims, normalize), idx in groups.items():
            # Row selection by a device index (a Python list index would copy it synchronously).
            x = pooled if len(idx) == len(pooled) else pooled[_device_index(idx, pooled.device)]
            x = x if dims is None else x[:, :dims]
            blocks.append(PooledBlock(l2_normalize(x) if normalize else x, idx))

    def _classify(
        self,
        hidden: torch.Tensor,
        seg: PoolingSegments,
        params: list[PoolingParams],
        reqs: list[int],
        blocks: list[PooledBlock],
    ) -> None:
        assert self.classify is not None
        first = seg.first_token_indices[_device_index(reqs, hidden.device)]
        logits = self.classify(hidden[first]).float()  # [N, num_labels]
        activated = apply_classifier_activation(logits, self.config.classifier_activation)
        # activation on -> rows of `logits` (positions in `reqs`)
        rows = _group(
            [params[i] for i in reqs], range(len(reqs)), lambda p: p.activation is not False
        )
        for use_act in (True, False):
            picked = rows.get(use_act)
            if not picked:
                continue
            values = activated if use_act else logits
            if len(picked) < len(reqs):
                values = values[_device_index(picked, values.device)]
            blocks.append(PooledBlock(values, [reqs[r] for r in picked]))

    def _encode(
        self,
        hidden: torch.Tensor,
        seg: PoolingSegments,
        params: list[PoolingParams],
        reqs: list[int],
        blocks: list[PooledBlock],
    ) -> None:
        """Per-token hidden states: the token rows of the requests with equal `normalize`,
        gathered into one fresh tensor (never a view of the model's buffers)."""
        lengths = np.asarray(seg.lengths_cpu, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        for normalize in (False, True):
            idx = [i for i in reqs if bool(params[i].normalize) == normalize]
            if not idx:
                continue
            counts = lengths[idx]
            # token rows of the requests in `idx`, in order
            offsets = np.cumsum(counts) - counts
            rows = np.arange(int(counts.sum())) + np.repeat(starts[idx] - offsets, counts)
            tokens = hidden[_device_index(rows, hidden.device)].float()  # [n, H]
            blocks.append(
                PooledBlock(l2_normalize(tokens) if normalize else tokens, idx, counts.tolist())
            )


def _fused_mean_mode(hidden: torch.Tensor, modes: tuple[str, ...]) -> str | None:
    """The one mean-like pooling mode that `segment_mean_triton` computes on hidden
    (`use_fused_encoder`), or None: the torch path (`pool`), its reference."""
    if len(modes) == 1 and modes[0] in ("mean", "mean_sqrt_len") and use_fused_encoder(hidden):
        return modes[0]
    return None


def _segment_mean(
    hidden: torch.Tensor, seg: PoolingSegments, mode: str, normalize: bool
) -> torch.Tensor:
    from v1.models.layers.triton_encoder import segment_mean_triton

    return segment_mean_triton(
        hidden, seg.query_start_loc, sqrt_len=mode == "mean_sqrt_len", normalize=normalize
    )


def _group(
    params: list[PoolingParams], reqs: Sequence[int], key: Callable[[PoolingParams], Hashable]
) -> dict[Hashable, list[int]]:
    """`reqs` (indices into `params`) grouped by `key` of their params, each group in order.
    Requests of one call share equal params (the offline LLM clones one PoolingParams per
    batch): when all are equal, one key call and no per-request work but the comparison."""
    if not reqs:
        return {}
    first = params[reqs[0]]
    if all(params[i] == first for i in reqs):
        return {key(first): list(reqs)}
    groups: dict[Hashable, list[int]] = {}
    for i in reqs:
        groups.setdefault(key(params[i]), []).append(i)
    return groups


def _device_index(rows: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(torch.as_tensor(rows, dtype=torch.int64), device)


@dataclass
class PooledBlock:
    """Results of some of a step's requests, stacked in one tensor."""

    values: torch.Tensor
    """[rows, ...]: row j is request reqs[j]'s result, or (`sizes`) its rows."""
    reqs: list[int]
    """Request indices in the step."""
    sizes: list[int] | None = None
    """Rows of each request (per-token results); None: one row each."""


class PendingPooledOutput:
    """One step's pooled results on their way to the host: their blocks concatenated and
    copied into pinned memory with one non-blocking copy when created; `result()` waits for
    that copy only and splits it per request with numpy views."""

    def __init__(self, num_reqs: int, blocks: list[PooledBlock]) -> None:
        self._num_reqs = num_reqs
        self._blocks = [(b.reqs, b.sizes, tuple(b.values.shape)) for b in blocks]
        self._in_order = len(blocks) == 1 and blocks[0].reqs == list(range(num_reqs))
        """One block of every request in order (a usual step): its rows are the result."""
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        if not blocks:
            return
        parts = [b.values.float().reshape(-1) for b in blocks]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        if flat.is_cuda:
            self._host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def result(self, packed: list[int] | None = None) -> list[np.ndarray]:
        """float32 numpy arrays, one per request, in launch order. `packed` (per request of
        the step: its packed inputs' count, 0 for an unpacked one): the launch's sequences
        grouped back into requests, a packed request's results stacked [count, ...] (views of
        one array when the step's results are in order)."""
        rows, block = self._rows()
        if packed is None:
            return rows
        out: list[np.ndarray] = []
        start = 0
        for k in packed:
            if not k:
                out.append(rows[start])
                start += 1
                continue
            end = start + k
            out.append(block[start:end] if block is not None else np.stack(rows[start:end]))
            start = end
        assert start == len(rows), (start, len(rows))
        return out

    def _rows(self) -> tuple[list[np.ndarray], np.ndarray | None]:
        """(one array per launched sequence, the [S, ...] array they are the rows of when the
        step's results are one block in order, else None)."""
        if self._host is None:
            return [], None
        if self._event is not None:
            self._event.synchronize()  # sync: the step's pooled outputs reach the host
        # A copy: the pinned buffer goes back to torch's host cache instead of living as
        # long as the caller keeps the arrays.
        flat = self._host.numpy().copy() if self._event is not None else self._host.numpy()
        out: list[np.ndarray | None] = [None] * self._num_reqs
        start = 0
        for reqs, sizes, shape in self._blocks:
            n = int(np.prod(shape))
            values = flat[start : start + n].reshape(shape)
            start += n
            if sizes is None:
                rows = list(values)  # row views, made at C speed
            else:
                ends = np.cumsum(sizes).tolist()
                rows = [values[e - k : e] for k, e in zip(sizes, ends, strict=True)]
            if self._in_order:
                return rows, values if sizes is None else None
            for i, row in zip(reqs, rows, strict=True):
                out[i] = row
        assert all(o is not None for o in out)
        return out, None  # type: ignore[return-value]
