"""The pipeline's layer split taken from Megatron-Core's own functions (trainer.pipeline_split), and
the refusals of splits the trainer cannot run."""

from __future__ import annotations

import json

import pytest

from dora_megatron.config.trainer import TrainerConfig
from dora_megatron.models.hf_config import spec_from_dict
from dora_megatron.models.presets import preset_config
from dora_megatron.trainer.pipeline_split import PipelineSplit, split_problems, trainer_split
from dora_megatron.weights.naming import Layout


def _arch(layers: int):
    return spec_from_dict({**preset_config("tiny-moe"), "num_hidden_layers": layers})


@pytest.mark.parametrize("layers,pp,vpp", [(4, 2, 1), (6, 3, 1), (8, 2, 2), (8, 4, 2)])
def test_a_layout_without_a_table_is_megatrons_even_split(layers, pp, vpp):
    """Weight naming's default (no ``chunk_layers``) places every chunk where Megatron builds it."""
    split = trainer_split(_arch(layers), TrainerConfig(pp=pp, vpp=vpp))
    for r in range(pp):
        for v in range(vpp):
            layout = Layout(pp=pp, pp_rank=r, vpp=vpp, vp_stage=v)
            assert (layout.layer_offset(layers), layout.layers_per_stage(layers)) == split.rank(r)[v]


def test_the_first_and_last_stage_fields_move_layers_and_the_table_drives_naming():
    arch = _arch(3)
    first = trainer_split(arch, TrainerConfig(pp=2, megatron={"num_layers_in_first_pipeline_stage": 1}))
    assert [first.rank_layers(r) for r in range(2)] == [1, 2]
    last = trainer_split(arch, TrainerConfig(pp=2, megatron={"num_layers_in_last_pipeline_stage": 1}))
    assert [last.rank_layers(r) for r in range(2)] == [2, 1]
    # interleaved: the first rank's 2 layers are one per virtual stage; each chunk starts where the one before ends
    inter = trainer_split(_arch(6), TrainerConfig(pp=2, vpp=2, megatron={"num_layers_in_first_pipeline_stage": 2}))
    order = [inter.rank(r)[v] for v in range(2) for r in range(2)]
    assert [n for _, n in order] == [1, 2, 1, 2] and [o for o, _ in order] == [0, 1, 3, 4]
    stage1 = Layout(pp=2, pp_rank=1, chunk_layers=first.rank(1))
    assert stage1.layer_offset(3) == 1 and stage1.layers_per_stage(3) == 2


def test_chunks_that_do_not_cover_the_layers_once_are_refused():
    fields = {"num_layers_in_first_pipeline_stage": 2}
    overlap = split_problems(PipelineSplit((((0, 2),), ((1, 2),))), 3, fields)
    assert overlap and "trainer.megatron.num_layers_in_first_pipeline_stage=2: the pipeline ranks would hold " \
                      "[[2], [2]] layers" in overlap[0] and "model's 3 layers once each" in overlap[0]
    assert split_problems(PipelineSplit((((0, 1),), ((1, 1),))), 3, fields)  # layer 2 on no stage
    assert split_problems(PipelineSplit((((0, 1),), ((1, 2),))), 3, fields) == []


def test_dora_convert_refuses_an_impossible_split_before_any_rank_starts(tmp_path, capsys):
    from dora_megatron.cli.convert import main

    (tmp_path / "config.json").write_text(json.dumps({**preset_config("tiny-moe"), "num_hidden_layers": 3}))
    assert main(["hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "out"), "--pp", "2",
                 "--first-stage-layers", "4"]) == 2
    err = capsys.readouterr().err
    assert "--first-stage-layers=4: pipeline rank 1 would hold -1 transformer layers" in err
    assert not (tmp_path / "out").exists()
    # without the option 3 layers do not split over 2 stages
    assert main(["hf-to-megatron", "--hf", str(tmp_path), "--out", str(tmp_path / "out"), "--pp", "2"]) == 2
    assert "--pp=2: the model's 3 layers are not divisible by pp" in capsys.readouterr().err
