"""Pipeline-parallel rank layout and layer ownership: pure functions shared by both policy backends.

A policy of ``world_size = tp x dp x pp`` ranks is laid out in megatron-core's default order
``tp-cp-ep-dp-pp`` (``parallel_state.initialize_model_parallel``'s ``RankGenerator``, with context and
expert parallelism 1): tensor-parallel ranks are neighbours, then data-parallel replicas, then pipeline stages::

    rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)

Stage ``p`` of a replica owns decoder layers ``stage_layers(num_layers, pp, p)`` (megatron-core 0.18's even split,
``transformer_layer.get_transformer_layer_offset`` / ``transformer_block.get_num_layers_to_build``); stage 0 also
holds the embedding, the last stage the final norm and the output layer. Inside a stage, layers are numbered from
0 (megatron-core's local numbering); ``global_layer_name`` turns a stage's parameter name into the full model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

PP_KEY = "policy.megatron_cfg.pipeline_model_parallel_size"
VPP_KEY = "policy.megatron_cfg.virtual_pipeline_model_parallel_size"


@dataclass(frozen=True)
class ParallelLayout:
    """The policy's ranks: ``tp`` tensor-parallel x ``dp`` data-parallel x ``pp`` pipeline ranks.

    Raises:
        ValueError: a size below 1.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout: {name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> "ParallelLayout":
        """The layout of ``world_size`` ranks with ``tp`` x ``pp`` model-parallel ranks per replica.

        Raises:
            ValueError: ``world_size`` not a multiple of ``tp x pp``.
        """
        if world_size % (tp * pp):
            raise ValueError(f"{world_size} policy ranks is not a multiple of tensor_model_parallel_size={tp} x "
                             f"pipeline_model_parallel_size={pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        """The global rank of (tensor-parallel rank, data-parallel rank, pipeline stage).

        Raises:
            ValueError: a coordinate out of range.
        """
        for name, v, n in (("tp", tp, self.tp), ("dp", dp, self.dp), ("pp", pp, self.pp)):
            if not 0 <= v < n:
                raise ValueError(f"ParallelLayout.rank_of: {name}={v} outside 0..{n - 1}")
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of global ``rank``.

        Raises:
            ValueError: ``rank`` outside ``0..world_size - 1``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelLayout.coords: rank {rank} outside 0..{self.world_size - 1}")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def replica_ranks(self, dp: int = 0) -> list[int]:
        """The ranks of data-parallel replica ``dp`` in (stage, tensor-parallel rank) order: replica 0's are the
        ranks that take part in the refit's export (its first rank streams; the others send to it)."""
        return [self.rank_of(t, dp, p) for p in range(self.pp) for t in range(self.tp)]

    def read_rank(self, dp: int) -> int:
        """The rank whose answers stand for data-parallel group ``dp``: tensor-parallel rank 0 of the last stage
        (where the log-probs and the loss are computed)."""
        return self.rank_of(0, dp, self.pp - 1)

    def stage_ranks(self, tp: int, dp: int) -> list[int]:
        """The pipeline group of (``tp``, ``dp``): one rank per stage, stage 0 first."""
        return [self.rank_of(tp, dp, p) for p in range(self.pp)]

    def data_parallel_ranks(self, tp: int, pp: int) -> list[int]:
        """The data-parallel group of (``tp``, ``pp``): the ranks whose gradients are summed."""
        return [self.rank_of(tp, d, pp) for d in range(self.dp)]


def layer_split_error(num_layers: int, pp_size: int, vpp_size: Optional[int] = None) -> Optional[str]:
    """Why ``num_layers`` decoder layers cannot be split evenly over ``pp_size`` stages of ``vpp_size`` model
    chunks each (megatron-core 0.18 asserts ``num_layers % pp == 0`` in ``get_num_layers_to_build`` and
    ``(num_layers / pp) % vpp == 0`` in ``TransformerConfig.__post_init__``); None when it can."""
    if pp_size < 1 or (vpp_size is not None and vpp_size < 1):
        return f"{PP_KEY}={pp_size} and {VPP_KEY}={vpp_size} must be >= 1"
    if vpp_size is not None and pp_size == 1:
        return f"{VPP_KEY}={vpp_size} needs {PP_KEY} > 1 (interleaving splits each stage's layers)"
    chunks = pp_size * (vpp_size or 1)
    if num_layers % chunks:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        return (f"the model's {num_layers} decoder layers do not split evenly over {PP_KEY}={pp_size}"
                + (f" x {VPP_KEY}={vpp_size}" if vpp_size else "")
                + f" = {chunks} model chunks (valid products: divisors of {num_layers}: {valid})")
    return None


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, vpp_size: Optional[int] = None) -> list[range]:
    """The global indices of the decoder layers stage ``pp_rank`` builds: one range per model chunk.

    megatron-core 0.18's even split (``get_num_layers_to_build``, ``get_transformer_layer_offset``): each chunk
    has ``L / (pp * vpp)`` layers and chunk ``v`` of stage ``p`` starts at ``v * L / vpp + p * L / (pp * vpp)``;
    without interleaving (``vpp_size`` None) one chunk of ``L / pp`` layers from ``p * L / pp``. E.g. 8 layers,
    2 stages, vpp 2: stage 0 holds [0, 1] and [4, 5], stage 1 [2, 3] and [6, 7].

    Raises:
        ValueError: sizes that do not split ``num_layers`` evenly (the message names
            ``policy.megatron_cfg.pipeline_model_parallel_size`` / ``virtual_pipeline_model_parallel_size``),
            or ``pp_rank`` outside ``0..pp_size - 1``.
    """
    why = layer_split_error(num_layers, pp_size, vpp_size)
    if why:
        raise ValueError(why)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"stage_layers: pp_rank={pp_rank} outside 0..{pp_size - 1}")
    vpp = vpp_size or 1
    per_chunk = num_layers // (pp_size * vpp)
    out = []
    for v in range(vpp):
        start = v * (num_layers // vpp) + pp_rank * per_chunk
        out.append(range(start, start + per_chunk))
    return out


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_layer_name(name: str, offset: int) -> str:
    """A stage's parameter name with its local layer index shifted by ``offset`` (the stage's first layer), e.g.
    ``model.layers.0.mlp.up_proj.weight`` with offset 4 -> ``model.layers.4.mlp.up_proj.weight`` (HF names;
    megatron-core's ``decoder.layers.{i}.`` likewise). Names outside the decoder layers pass unchanged."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + offset}.", name, count=1)
