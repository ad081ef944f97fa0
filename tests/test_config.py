"""The typed run config: every shipped config loads; bad input names its field and exits 2."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS, TINY_CONFIG, run_module
from x1_pretrain.config import ConfigError, load_config

SHIPPED = sorted(CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.grad_accum(1) >= 1
    assert len(cfg.config_hash()) == 64


def test_the_labs_config_has_its_tables():
    cfg = load_config(CONFIGS / "x1-50m-a100.yaml")
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.d_ff, m.seq_len, m.vocab_size) == (8, 768, 12, 4, 2048, 1024, 50257)
    assert (m.rope_base, m.init_std, m.padded_vocab_size) == (10000, 0.02, 50304)
    assert (o.lr, o.min_lr, o.warmup_steps, o.beta1, o.beta2, o.weight_decay, o.grad_clip) == (3e-4, 3e-5, 1000, 0.9, 0.95, 0.1, 1.0)
    assert (t.tokens_per_step, t.micro_batch_size, t.seed, t.precision) == (524288, 64, 42, "bf16-mixed")
    assert cfg.grad_accum(1) == 8 and cfg.grad_accum(2) == 4 and cfg.grad_accum(8) == 1


def test_tiny_config_divides_at_one_and_two_processes():
    cfg = load_config(TINY_CONFIG)
    assert cfg.grad_accum(1) == 2 * cfg.grad_accum(2)


def test_set_overrides_parse_yaml_values():
    cfg = load_config(TINY_CONFIG, ["optim.lr=1e-3", "train.compile=true", "budget.cap_usd=35"])
    assert cfg.optim.lr == 1e-3 and cfg.train.compile is True and cfg.budget.cap_usd == 35.0


def test_config_hash_covers_math_not_logistics():
    base = load_config(TINY_CONFIG)
    same = load_config(TINY_CONFIG, ["train.log_every=3", "checkpoint.every=7", "train.micro_batch_size=4",
                                     "tracking.metrics_port=0", "data.dir=/elsewhere"])
    assert same.config_hash() == base.config_hash()
    for change in ["optim.lr=1e-2", "train.total_steps=999", "model.n_layer=3", "train.seed=1", "optim.warmup_steps=3"]:
        assert load_config(TINY_CONFIG, [change]).config_hash() != base.config_hash(), change


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.n_head=5", "model.n_head"),
        ("model.n_kv_head=3", "model.n_kv_head"),
        ("train.tokens_per_step=1000", "train.tokens_per_step"),
        ("model.n_layer=two", "model.n_layer"),
        ("optim.beta2=1.5", "optim.beta2"),
        ("optim.nesterov=true", "optim.nesterov"),
        ("widgets.size=3", "widgets.size"),
    ],
)
def test_bad_value_raises_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(TINY_CONFIG, [override])
    assert str(e.value).startswith(field), str(e.value)


def test_unknown_key_in_yaml_file_names_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY_CONFIG.read_text().replace("n_layer: 2", "n_layer: 2\n  n_layers: 4"))
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        load_config(bad)


def test_bad_config_on_the_command_line_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY_CONFIG.read_text().replace("n_kv_head: 2", "n_kv_head: 3"))
    proc = run_module("x1_pretrain.plan", "--config", str(bad), "--price-usd-per-hr", "1.1")
    assert proc.returncode == 2
    assert "model.n_kv_head" in proc.stderr
    proc = run_module("x1_pretrain.plan", "--config", str(tmp_path / "missing.yaml"), "--price-usd-per-hr", "1.1")
    assert proc.returncode == 2 and "missing.yaml" in proc.stderr


def test_resolved_config_round_trips_through_json():
    from x1_pretrain.config import config_from_dict

    cfg = load_config(CONFIGS / "x1-50m-a100.yaml")
    again = config_from_dict(json.loads(json.dumps(cfg.resolved())))
    assert again == cfg and again.config_hash() == cfg.config_hash()


def test_on_and_off_mean_the_words_not_yaml_booleans():
    assert load_config(TINY_CONFIG, ["optim.fused=off"]).optim.fused == "off"
    assert load_config(TINY_CONFIG, ["optim.fused=on"]).optim.fused == "on"


def test_every_config_field_marked_as_a_flag_is_a_trainer_flag_with_its_description_as_help():
    from x1_pretrain.config import CLI_FLAGS, flags
    from x1_pretrain.train.parser import build_parser

    by_flag = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    assert set(CLI_FLAGS) == {
        "data_dir", "ckpt_dir", "mlflow_uri", "total_steps", "ckpt_every", "eval_every", "log_every", "budget_cap_usd",
        "budget_curr_cost_uri", "budget_alert_usd", "budget_check_every_min", "budget_stale_after_min",
        "max_price_usd_per_hr", "planned_rate_usd_per_hr", "planned_hours", "expected_tokens_per_sec", "metrics_port",
        "metrics_host", "heartbeat_file"}
    for f in flags():
        action = by_flag[f.name]
        assert action.dest == f.dest and action.type is f.type
        assert action.help.startswith(f.help) and f.path in action.help
    args = build_parser().parse_args(["--config", "c.yaml", "--ckpt-every", "7", "--budget-cap-usd", "30"])
    assert (args.ckpt_every, args.budget_cap_usd, args.total_steps) == (7, 30.0, None)
