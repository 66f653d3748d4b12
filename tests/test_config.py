"""ModelConfig: presets match the released configs; bad configs are rejected with the field named."""

import json

import pytest

from dsv4.model.config import ConfigError, ModelConfig
from dsv4.model.model import Transformer


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
