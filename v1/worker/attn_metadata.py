"""AttentionMetadataFactory: the backend's metadata builders, the KV cache groups (layer names,
attention type) and each group's block table; builds a step's attention metadata by layer name
(decoder self-attention, cross-attention, encoder-states, cache-less bidirectional passes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from v1.host_copy import to_device
from v1.kv_cache.spec import CrossAttentionSpec, EncoderStatesSpec, KVCacheConfig
from v1.worker.block_table import BlockTable

if TYPE_CHECKING:
    from v1.worker.step_inputs import StepInputs


class AttentionMetadataFactory:
    def __init__(
        self, backend: type[AttentionBackend], device: torch.device, block_size: int
    ) -> None:
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.layer_types: dict[str, AttentionType] = {}
        """Every attention layer of the model (known once it is loaded)."""
        self.group_layers: list[tuple[str, ...]] = []
        """Per KV group (known once the KV cache exists): its layers, which share metadata."""
        self.group_types: list[AttentionType] = []
        """Per KV group: DECODER (self-attention) or ENCODER_DECODER (cross or encoder states)."""
        self.builders: list[AttentionMetadataBuilder] = []
        """Per KV group: the backend's builder (the encoder-states one for absorbed groups)."""
        self.block_tables: list[BlockTable] = []
        """Per KV group: rows are persistent batch slots."""

    # ---- set-up ----
    def set_layers(self, layer_types: dict[str, AttentionType]) -> None:
        self.layer_types = dict(layer_types)

    def layers_of_type(self, attn_type: AttentionType) -> list[str]:
        return [name for name, t in self.layer_types.items() if t == attn_type]

    def initialize(
        self,
        kv_cache_config: KVCacheConfig,
        max_num_reqs: int,
        max_model_len: int,
        max_encoder_len: int,
    ) -> None:
        """One builder and one block table per KV group; cross groups (per-layer K/V or the
        encoder states) hold `max_encoder_len` positions, self-attention `max_model_len`."""
        self.group_layers, self.group_types, self.builders, self.block_tables = [], [], [], []
        for group in kv_cache_config.groups:
            spec = group.spec
            is_cross = isinstance(spec, (CrossAttentionSpec, EncoderStatesSpec))
            attn_type = AttentionType.ENCODER_DECODER if is_cross else AttentionType.DECODER
            max_len = max_encoder_len if is_cross else max_model_len
            self.block_tables.append(
                BlockTable(max_num_reqs, -(-max_len // spec.block_size), spec.block_size)
            )
            self.group_layers.append(group.layer_names)
            self.group_types.append(attn_type)
            builder_cls = (
                self.backend.get_encoder_states_builder_cls()
                if isinstance(spec, EncoderStatesSpec)
                else self.backend.get_builder_cls()
            )
            self.builders.append(builder_cls(attn_type, self.device, spec.block_size))

    # ---- block tables (rows follow the persistent batch's slots) ----
    def set_rows(self, slots: list[int], block_ids: list[tuple[list[int], ...]]) -> None:
        """New requests' blocks: block_ids[i] (one list per KV group) for slots[i]."""
        for group, table in enumerate(self.block_tables):
            for slot, ids in zip(slots, block_ids, strict=True):
                table.set_row(slot, ids[group])

    def append_rows(self, slot: int, new_block_ids: tuple[list[int], ...]) -> None:
        """Blocks the scheduler added to a running request's tables, per KV group."""
        for table, ids in zip(self.block_tables, new_block_ids, strict=True):
            table.append_row(slot, ids)

    def clear_rows(self, slots: np.ndarray) -> None:
        for table in self.block_tables:
            table.clear_rows(slots)

    # ---- metadata ----
    def make_common(
        self,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        causal: bool,
        block_table: torch.Tensor | None = None,
        slot_mapping: np.ndarray | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> CommonAttentionMetadata:
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_cpu = torch.from_numpy(np.ascontiguousarray(seq_lens, dtype=np.int32))
        num_reqs = len(seq_lens)
        query_lens = np.diff(query_start_loc)
        return CommonAttentionMetadata(
            # non_blocking: a blocking host-to-device copy would wait for the whole stream.
            query_start_loc=to_device(qsl_cpu, self.device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=to_device(seq_cpu, self.device),
            seq_lens_cpu=seq_cpu,
            num_reqs=num_reqs,
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            causal=causal,
            block_table=block_table,
            slot_mapping=to_device(slot_mapping, self.device) if slot_mapping is not None else None,
            query_positions=query_positions,
        )

    def decoder(self, step: StepInputs) -> dict[str, Any]:
        """Metadata of every decoder self-attention group (one object per group)."""
        out: dict[str, Any] = {}
        for i, attn_type in enumerate(self.group_types):
            if attn_type != AttentionType.DECODER:
                continue
            table = self.block_tables[i]
            common = self.make_common(
                step.query_start_loc,
                step.seq_lens,
                causal=True,
                block_table=table.rows(step.slots, self.device),
                slot_mapping=table.slot_mapping(step.token_slots, step.positions_np),
                query_positions=step.positions,
            )
            metadata = self.builders[i].build(common)
            out.update(dict.fromkeys(self.group_layers[i], metadata))
        return out

    def cross(
        self,
        step: StepInputs,
        encoder_lens: np.ndarray,
        writer_slots: np.ndarray,
        writer_lens: np.ndarray,
    ) -> dict[str, Any]:
        """Metadata of every cross-attention group: the step's queries over `encoder_lens`
        [R] keys each; the requests in `writer_slots` (their encoder lengths `writer_lens`)
        write their whole encoder output into their cross blocks (none: a read-only step)."""
        out: dict[str, Any] = {}
        for i, attn_type in enumerate(self.group_types):
            if attn_type != AttentionType.ENCODER_DECODER:
                continue
            table = self.block_tables[i]
            slot_mapping = None
            if len(writer_slots):
                slot_mapping = table.prefix_slot_mapping(writer_slots, writer_lens)
            common = self.make_common(
                step.query_start_loc,
                encoder_lens,
                causal=False,
                block_table=table.rows(step.slots, self.device),
                slot_mapping=slot_mapping,
                query_positions=step.positions,
            )
            out.update(dict.fromkeys(self.group_layers[i], self.builders[i].build(common)))
        return out

    def uncached(
        self, lengths: np.ndarray, attn_type: AttentionType, layer_names: list[str]
    ) -> dict[str, Any]:
        """Bidirectional metadata over packed sequences with no cache (ENCODER, ENCODER_ONLY)."""
        qsl = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=qsl[1:])
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], lengths)
        common = self.make_common(
            qsl, lengths, causal=False, query_positions=to_device(positions, self.device)
        )
        metadata = self.backend.get_builder_cls()(attn_type, self.device, self.block_size).build(
            common
        )
        return dict.fromkeys(layer_names, metadata)
