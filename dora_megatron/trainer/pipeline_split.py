"""Which global transformer layers each pipeline model chunk holds, as Megatron-Core builds them.

WHY one module: Megatron decides how many layers each (pipeline rank, virtual stage) builds and
where they start (``transformer_block.get_num_layers_to_build``,
``transformer_layer.get_transformer_layer_offset``): evenly by default, unevenly with
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` (DeepSeek-V3's 61
layers need one), ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``
or ``pipeline_model_parallel_layout``. Every place of dora that maps a global layer index to a stage
(the HF weight loading, the export and weight push, the checkpoint converter, the memory estimate)
reads the table :func:`megatron_split` takes from those functions, so none keeps a copy of the rule.

:func:`split_problems` refuses the splits the trainer cannot run, naming the fields and values:
a stage without transformer layers (Megatron's standalone embedding / loss stage), counts that do
not cover the model's layers once each, a custom layout with virtual stages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from dora_megatron.weights.naming import Layout

#: Megatron's fields that move layers between the pipeline stages (``trainer.megatron``)
UNEVEN_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                       "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                       "account_for_loss_in_pipeline_split")


def uneven_fields(megatron: Mapping[str, Any]) -> dict[str, Any]:
    """The split fields among ``megatron`` (``trainer.megatron``) that change Megatron's even split
    (set: not None, not False)."""
    return {k: v for k, v in megatron.items() if k in UNEVEN_SPLIT_FIELDS and v is not None and v is not False}


@dataclass(frozen=True)
class PipelineSplit:
    """``chunks[pp_rank][vp_stage]`` = (first global layer, layer count) of that model chunk."""

    chunks: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def pp(self) -> int:
        return len(self.chunks)

    @property
    def vpp(self) -> int:
        return len(self.chunks[0])

    def rank(self, pp_rank: int) -> tuple[tuple[int, int], ...]:
        """(offset, count) of each chunk of pipeline rank ``pp_rank``, by virtual stage."""
        return self.chunks[pp_rank]

    def rank_layers(self, pp_rank: int) -> int:
        """Transformer layers pipeline rank ``pp_rank`` holds over all its chunks."""
        return sum(count for _, count in self.chunks[pp_rank])


def megatron_split(config) -> PipelineSplit:
    """The split a Megatron ``TransformerConfig`` builds, from Megatron's own functions, for every
    pipeline rank (passed explicitly, so no process group is needed).

    A ``pipeline_model_parallel_layout`` is asked directly: Megatron's module-level functions take the
    pipeline rank of the running process for it. Its virtual stages are refused (ValueError): its
    methods read the virtual stage only inside an initialised interleaved pipeline."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = config.pipeline_model_parallel_size
    vpp_field = config.virtual_pipeline_model_parallel_size
    layout = config.pipeline_model_parallel_layout
    if layout is not None and layout.virtual_pipeline_model_parallel_size > 1:
        raise ValueError(f"trainer.megatron.pipeline_model_parallel_layout={str(layout)!r}: "
                         f"{layout.virtual_pipeline_model_parallel_size} model chunks per pipeline rank (virtual "
                         "stages) in a custom layout are not supported; give one stage per pipeline rank, or use "
                         "num_layers_in_first/last_pipeline_stage with trainer.vpp")
    chunks = []
    for r in range(pp):
        row = []
        for v in range(vpp_field or 1):
            if layout is not None:
                row.append((layout.get_layer_offset(LayerType.decoder, vp_stage=v, pp_rank=r),
                            layout.get_num_layers_to_build(LayerType.decoder, vp_stage=v, pp_rank=r)))
            else:
                vp = v if vpp_field else None
                row.append((int(get_transformer_layer_offset(config, vp_stage=vp, pp_rank=r)),
                            int(get_num_layers_to_build(config, vp_stage=vp, pp_rank=r))))
        chunks.append(tuple(row))
    return PipelineSplit(tuple(chunks))


#: how a problem names a field: ``trainer.megatron.FIELD`` unless the caller (``dora convert``) says
Names = Mapping[str, str]


def _described(fields: Mapping[str, Any], names: Names | None) -> str:
    named = ", ".join(f"{(names or {}).get(k, 'trainer.megatron.' + k)}={v!r}" for k, v in fields.items())
    return named or "the even split"


def split_problems(split: PipelineSplit, num_layers: int, fields: Mapping[str, Any],
                   names: Names | None = None) -> list[str]:
    """Why ``split`` (:func:`megatron_split`) cannot run the model's ``num_layers`` layers (empty: it
    can). ``fields``: the uneven-split fields that led to it (:func:`uneven_fields`), named in each
    problem with their values (by ``names``, default ``trainer.megatron.FIELD``).

    Every chunk needs a transformer layer: Megatron's standalone embedding / loss stages (a stage
    left with none by ``account_for_*_in_pipeline_split``) are not built by this trainer. The chunks,
    in Megatron's order (virtual stage, then pipeline rank), must hold the layers 0..L-1 once each;
    Megatron itself does not check that a first or last stage count leaves layers for the others."""
    what = _described(fields, names)
    problems = []
    for r, row in enumerate(split.chunks):
        for v, (_, count) in enumerate(row):
            if count < 1:
                where = f"pipeline rank {r}" + (f" virtual stage {v}" if split.vpp > 1 else "")
                problems.append(f"{what}: {where} would hold {count} transformer layers; every stage needs at least "
                                "one (a stage of only the embedding or the loss is not supported)")
    if problems:
        return problems
    order = [split.chunks[r][v] for v in range(split.vpp) for r in range(split.pp)]
    starts = [sum(count for _, count in order[:i]) for i in range(len(order))]
    if [offset for offset, _ in order] == starts and sum(count for _, count in order) == num_layers:
        return []
    counts = [[count for _, count in row] for row in split.chunks]
    return [f"{what}: the pipeline ranks would hold {counts} layers (per rank, per virtual stage), which do not "
            f"cover the model's {num_layers} layers once each"]


def config_problems(config, num_layers: int, megatron: Mapping[str, Any], vpp: int,
                    names: Names | None = None) -> list[str]:
    """:func:`split_problems` of a built ``TransformerConfig``, and a ``pipeline_model_parallel_layout``
    whose chunks per rank disagree with ``trainer.vpp`` (Megatron would take the layout's and build
    chunks this trainer's schedule does not run)."""
    fields = uneven_fields(megatron)
    built = config.virtual_pipeline_model_parallel_size or 1
    if built != vpp:
        return [f"{_described(fields, names)}: {built} model chunks per pipeline rank, but trainer.vpp={vpp}"]
    try:
        split = megatron_split(config)
    except ValueError as err:
        return [str(err)]
    return split_problems(split, num_layers, fields, names)


def staged_layout(layout: Layout, config) -> Layout:
    """``layout`` with the chunks of its pipeline rank as ``config`` builds them (the layer ranges
    every weight mapping of this rank follows)."""
    return replace(layout, chunk_layers=megatron_split(config).rank(layout.pp_rank))


def construct(cls: type, kwargs: Mapping[str, Any], megatron: Mapping[str, Any], names: Names | None = None):
    """``cls(**kwargs)`` (a Megatron ``TransformerConfig``); under an uneven split (``megatron``'s
    fields) Megatron's refusal becomes a ValueError that names those fields and their values (its own
    words say which rule, not which key of the job to change)."""
    fields = uneven_fields(megatron)
    try:
        return cls(**kwargs)
    except (AssertionError, ValueError) as err:
        if not fields:
            raise
        raise ValueError(f"{_described(fields, names)}: Megatron's TransformerConfig refuses the configuration: "
                         f"{err}") from err


def trainer_split(arch, cfg, names: Names | None = None) -> PipelineSplit:
    """The split the trainer section ``cfg`` gives the model ``arch``, before any rank starts: the
    ``TransformerConfig`` is built once here (local spec, no fused kernels: neither moves a layer),
    and ValueError names the fields when Megatron or :func:`config_problems` refuses the split."""
    from dataclasses import replace as replace_cfg

    from dora_megatron.trainer import megatron_args as ma

    config = construct(ma.transformer_config_class(arch), ma.transformer_kwargs(arch, replace_cfg(cfg, fusions=False),
                                                                                "local"), cfg.megatron, names)
    problems = config_problems(config, arch.num_layers, cfg.megatron, cfg.vpp, names)
    if problems:
        raise ValueError("; ".join(problems))
    return megatron_split(config)
