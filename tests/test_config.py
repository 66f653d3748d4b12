"""ModelConfig: presets match the released configs; bad configs are rejected with the field named."""

import json

import pytest

from dsv4.model.config import REQUIRED_FIELDS, ConfigError, ModelConfig
from dsv4.model.model import Transformer
from dsv4.model.transformers_config import transformers_config_dict


def test_presets_match_released_schedules():
    flash, pro = ModelConfig.preset("flash"), ModelConfig.preset("pro")
    assert len(flash.compress_ratios) == 44 and flash.compress_ratios[:4] == (0, 0, 4, 128)
    assert flash.compress_ratios[-2:] == (4, 0)
    assert sum(r == 4 for r in flash.compress_ratios) == 21 and sum(r == 128 for r in flash.compress_ratios) == 20
    assert len(pro.compress_ratios) == 62 and pro.compress_ratios[:3] == (128, 128, 4)
    assert sum(r == 4 for r in pro.compress_ratios) == 30 and sum(r == 128 for r in pro.compress_ratios) == 31
    assert (flash.hidden_size, pro.hidden_size, flash.index_topk, pro.index_topk) == (4096, 7168, 512, 1024)


def test_tiny_covers_every_layer_kind():
    t = ModelConfig.preset("tiny")
    kinds = set(t.compress_ratios[:t.n_layers])
    assert 0 in kinds and 4 in kinds and any(r > 4 for r in kinds)
    assert t.num_hash_layers >= 1 and t.n_mtp == 1 and t.sliding_window < 16


def test_released_config_json_round_trip(tmp_path):
    d = ModelConfig.preset("flash").to_dict()
    d.update(torch_dtype="bfloat16", transformers_version="4.57.1", use_cache=True, initializer_range=0.02)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.from_json(tmp_path) == ModelConfig.preset("flash")


@pytest.mark.parametrize("change, field", [
    ({"bogus_field": 1}, "bogus_field"),
    ({"compress_ratios": [0, 4, 16, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4, 16, 4, 4]}, "compress_ratios"),  # MTP block must be sliding
    ({"compress_ratios": [0, 4, 17, 4, 0]}, "compress_ratios"),  # max_seq_len not a multiple
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"o_groups": 3}, "o_groups"),
    ({"head_dim": 64}, "head_dim"),
    ({"index_head_dim": 96}, "index_head_dim"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.preset("tiny", **change)


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        ModelConfig.preset("huge")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_flash_parameter_count_matches_release():
    # "284B total" per the release (the MTP block not counted); built on the meta device
    import torch
    with torch.device("meta"):
        m = Transformer(ModelConfig.preset("flash"), quantized=False)
    n = sum(p.numel() for name, p in m.named_parameters() if not name.startswith("mtp."))
    assert 283.5e9 < n < 284.5e9, n


# ---- a checkpoint's config.json must state what shapes the model (issue 13.7) ----------------------


def _write_config(d: dict, directory) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("field", sorted(REQUIRED_FIELDS))
def test_checkpoint_config_without_a_required_field_names_it(field, tmp_path):
    d = ModelConfig.preset("flash").to_dict()
    del d[field]
    _write_config(d, tmp_path)
    alt = REQUIRED_FIELDS[field]
    named = f"{field} (or {' / '.join(alt)})" if alt else field
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(tmp_path)
    assert f"config.json is missing required field(s): {named} (a checkpoint" in str(e.value)  # only it


def test_missing_fields_come_in_one_error_also_in_the_transformers_form(tmp_path):
    d = ModelConfig.preset("tiny").to_dict()
    for k in ("hidden_size", "model_type", "index_topk"):
        del d[k]
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_checkpoint(d)
    assert "missing required field(s): model_type, hidden_size, index_topk (" in str(e.value)
    assert ModelConfig.from_checkpoint(d, hidden_size=128, index_topk=4, model_type="deepseek_v4") == \
        ModelConfig.preset("tiny")  # overrides count as stated

    hf = transformers_config_dict(ModelConfig.preset("tiny"))
    assert ModelConfig.from_checkpoint(hf) == ModelConfig.preset("tiny")  # states them under its own keys
    for k in ("layer_types", "mlp_layer_types", "partial_rotary_factor", "rope_parameters", "qk_rope_head_dim"):
        hf.pop(k)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_checkpoint(hf)
    assert ("missing required field(s): qk_rope_head_dim (or partial_rotary_factor), compress_ratios (or "
            "layer_types), num_hash_layers (or mlp_layer_types) (") in str(e.value)


def test_unknown_fields_still_refused_from_a_checkpoint(tmp_path):
    d = {**ModelConfig.preset("tiny").to_dict(), "frobnicate": 1}
    _write_config(d, tmp_path)
    with pytest.raises(ConfigError, match="unknown config field\\(s\\): frobnicate"):
        ModelConfig.from_json(tmp_path)


def test_load_checkpoint_reports_missing_fields_before_any_shape_work(tmp_path):
    """One tensor and a config.json without hidden_size / model_type: the loader's one error names
    the two fields and nothing else (with Flash's hidden_size it would list every tensor as missing
    or mis-shaped)."""
    import torch
    from safetensors.torch import save_file

    from dsv4.model.checkpoint import CheckpointError, load_checkpoint

    d = ModelConfig.preset("tiny").to_dict()
    del d["hidden_size"], d["model_type"]
    _write_config(d, tmp_path)
    save_file({"embed.weight": torch.zeros(512, 128, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith("config: config.json is missing required field(s): model_type, hidden_size (")
