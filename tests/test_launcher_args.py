"""The launcher's composed command line: every part's flags in one parser, checked once at start-up."""

import pytest

from scripts.arguments import build_parser, parse, parse_args


@pytest.fixture()
def base(toy_model_dir):
    return ["--hf-checkpoint", str(toy_model_dir), "--prompt-data", str(toy_model_dir / "data/train.jsonl")]


def test_all_parts_compose_without_clashes(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--lr", "1e-5",
                              "--max-weight-staleness", "1", "--update-weight-transport", "disk",
                              "--update-weight-disk-dir", "/tmp/w"])
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.lr) == (4, 2, 1e-5)
    assert args.max_weight_staleness == 1 and args.update_weight_transport == "disk"
    flags = [o for a in build_parser()._actions for o in a.option_strings]
    assert len(flags) == len(set(flags))


@pytest.mark.parametrize("extra,use_tis", [
    ([], False),  # sync: the engines sampled from the weights being trained
    (["--max-weight-staleness", "0"], False),
    (["--max-weight-staleness", "1"], True),  # async: every group is a version behind, corrected by default
    (["--max-weight-staleness", "2", "--no-use-tis"], False),
    (["--use-tis"], True),
])
def test_tis_is_on_by_default_exactly_in_async_mode(base, extra, use_tis):
    args, settings = parse(base + extra)
    assert settings.train.use_tis is use_tis
    assert args.use_tis is use_tis  # what plugins read (slime's args.use_tis)


@pytest.mark.parametrize("extra,msg", [
    (["--debug-train-only"], "--debug-train-only needs --load-debug-rollout-data"),
    (["--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data", "x"], "exclude each other"),
    (["--save-interval", "2"], "--save-interval needs --save"),
    (["--eval-interval", "5"], "--eval-interval needs --eval-prompt-data"),
    (["--global-batch-size", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"],
     "--global-batch-size 3 must divide"),
    (["--colocate", "--max-weight-staleness", "1"], "--colocate needs sync mode"),
    (["--num-rollout", "0"], "--num-rollout must be >= 1"),
    (["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "3"],
     "3 trainer ranks (--actor-num-nodes 1 x --actor-num-gpus-per-node 3) is not a multiple of "
     "--tensor-model-parallel-size 2"),
    (["--train-device", "cuda:1", "--actor-num-nodes", "2"], "--train-device cuda:1 pins one device"),
])
def test_bad_combinations_name_the_flags(base, extra, msg, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(base + extra)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_missing_checkpoint_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tmp_path / "nope"), "--prompt-data", "x.jsonl"])
    assert "--hf-checkpoint" in capsys.readouterr().err


def test_config_file_errors_name_file_and_line(base, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("lr: 1e-5\nrolout-batch-size: 4\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)] + base)
    assert f"--config {cfg}, line 2: unknown flag '--rolout-batch-size'" in capsys.readouterr().err


def test_sglang_flags_pass_through(base, capsys):
    args = parse_args(base + ["--rollout-engine", "sglang", "--rollout-num-gpus", "2",
                              "--sglang-mem-fraction-static", "0.7", "--sglang-enable-torch-compile"])
    assert args.sglang_args == ["--mem-fraction-static", "0.7", "--enable-torch-compile"]
    with pytest.raises(SystemExit):
        parse_args(base + ["--sglang-mem-fraction-static", "0.7"])  # needs --rollout-engine sglang
    assert "--rollout-engine sglang" in capsys.readouterr().err


def test_abbreviations_are_errors(base, capsys):
    """Issue 16 item 5: ``--num-roll`` is not silently taken for ``--num-rollout``."""
    with pytest.raises(SystemExit):
        parse_args(base + ["--num-roll", "3"])
    assert "unrecognized arguments: --num-roll" in capsys.readouterr().err


@pytest.mark.parametrize("yaml_text,msg", [
    ("lr: [0.1, 0.2]\n", "line 1: key 'lr' (--lr) expects one value (float), got a list"),
    ("seed: 1\nlr: {a: 1}\n", "line 2: key 'lr' (--lr) expects one value (float), got a mapping"),
    # a flag taking several values takes a list, but of single values
    ("rollout-stop-token-ids: [1, [2, 3]]\n",
     "line 1: key 'rollout-stop-token-ids' (--rollout-stop-token-ids) expects a list of single values (int), "
     "got a list: [2, 3]"),
])
def test_a_yaml_value_of_the_wrong_shape_names_the_key_and_file(base, tmp_path, capsys, yaml_text, msg):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit):
        parse_args(base + ["--config", str(cfg)])
    assert f"--config {cfg}, {msg}" in capsys.readouterr().err


def test_wandb_flags(base, capsys):
    """slime's --wandb-group / --wandb-key are accepted with --use-wandb; without the package the
    error names the flags at parse time (before Ray and the engines start)."""
    import importlib.util

    with pytest.raises(SystemExit):
        parse_args(base + ["--wandb-group", "g"])
    assert "--wandb-group need(s) --use-wandb" in capsys.readouterr().err
    argv = base + ["--use-wandb", "--wandb-group", "g", "--wandb-key", "k"]
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--use-wandb, --wandb-group, --wandb-key: the wandb package is not installed" in capsys.readouterr().err
    else:
        args = parse_args(argv)
        assert (args.wandb_group, args.wandb_key) == ("g", "k")


def test_the_toy_configs_build_flag_does_not_build_at_a_mistyped_path(tmp_path, capsys):
    """The toy config says build-toy-model: true; a mistyped --hf-checkpoint must be an error naming
    the flag, not a fresh toy model trained at that path. An explicit --build-toy-model still builds."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    typo = tmp_path / "exmaples/toy/model"
    argv = ["--config", str(root / "examples/toy/grpo_cpu.yaml"), "--hf-checkpoint", str(typo)]
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert f"--hf-checkpoint {typo}: no HF checkpoint there" in capsys.readouterr().err
    # the prompts inside the model to build are checked once it is built
    data = ["--prompt-data", str(typo / "data/train.jsonl"), "--eval-prompt-data", str(typo / "data/eval.jsonl")]
    assert parse_args(argv + ["--build-toy-model"] + data).build_toy_model
    assert not typo.exists()  # parsing builds nothing


def _entry_point_parsers():
    import rollout_manager.__main__ as rollout_cli

    return {"scripts/train.py": build_parser(), "python -m rollout_manager": rollout_cli.build_parser()}


@pytest.mark.parametrize("entry_point", ["scripts/train.py", "python -m rollout_manager"])
def test_help_has_text_for_every_option_and_each_section_once(entry_point):
    import argparse

    parser = _entry_point_parsers()[entry_point]
    without_help = [a.option_strings for a in parser._actions
                    if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert without_help == []
    titles = [g.title for g in parser._action_groups]
    assert sorted(t for t in set(titles) if titles.count(t) > 1) == []
    # what --help prints: each section heading once
    headings = [line for line in parser.format_help().splitlines() if line and not line[0].isspace()
                and line.endswith(":")]
    assert len(headings) == len(set(headings))


def test_entry_points_declare_each_shared_flag_once():
    """Issue 24: a flag both entry points take is one declaration: the same help, type, choices and
    default in both parsers, the default differing only where ``python -m rollout_manager`` overrides
    it (``STANDALONE_DEFAULTS``, which says why), never by a second declaration."""
    import rollout_manager.__main__ as rollout_cli

    def options(parser):
        return {o: a for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}

    launcher, standalone = (options(p) for p in _entry_point_parsers().values())
    shared = sorted(launcher.keys() & standalone.keys())
    assert {"--num-rollout", "--ray-address", "--hf-checkpoint", "--rollout-batch-size"} <= set(shared)
    for opt in shared:
        a, b = launcher[opt], standalone[opt]
        assert (type(a), a.dest, a.help, a.type, a.choices, a.nargs) == \
            (type(b), b.dest, b.help, b.type, b.choices, b.nargs), f"{opt} is declared twice"
        want = rollout_cli.STANDALONE_DEFAULTS.get(a.dest, a.default)
        assert b.default == want, (f"{opt}: default {b.default!r} in python -m rollout_manager, {a.default!r} in "
                                   "scripts/train.py: declare it once (an override goes in STANDALONE_DEFAULTS)")
    for dest, value in rollout_cli.STANDALONE_DEFAULTS.items():  # each override is of a shared flag, and needed
        a = next(a for a in launcher.values() if a.dest == dest)
        assert a.option_strings[0] in shared and a.default != value, dest
