"""One typed builder for every config tree, and one dataclass for the submit options.

The run config, each of its sections and the model (with its nested lamemo/rmt options) are
built by `model.typed.build_dataclass`, so an error names the full dotted field whichever
way the values arrive (YAML + overrides, `ModelConfig.from_dict`, dict options given to
`ModelConfig`). The `memtrain submit` flags are generated from `SubmitOptions`' fields: one
flag per field, read back into exactly that field."""

import ast
import dataclasses
import subprocess
import sys
import typing

import pytest
from shipped_configs import CONFIGS, load_shipped

from cluster.options import LAUNCHERS, SubmitOptions, flag, from_args
from cluster.submit import _parser, main_submit
from model import ConfigError, LaMemoOptions, ModelConfig, RMTOptions
from model.typed import build_dataclass
from train.config import PROJECT_ROOT, from_dict, load_config

RMT_FIELDS = ("mem_loss_token, mem_loss_weight, memory_norm, num_mem_tokens, pattern, "
              "read_mem_from_cache")


# ----------------------------------------------------------------------------- the builder
def _error(make) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make()
    return info.value


NESTED_CASES = {
    "override": lambda v: load_config("quickstart", [f"model.rmt.{k}={x}" for k, x in v.items()]),
    "run_from_dict": lambda v: from_dict({"data": {"path": "d"}, "model": {"rmt": v}}),
    "model_from_dict": lambda v: ModelConfig.from_dict({"rmt": v}),
    "model_constructor": lambda v: ModelConfig(rmt=v),
}


@pytest.mark.parametrize("how", NESTED_CASES)
def test_a_nested_unknown_field_names_its_full_dotted_path_every_way_in(how):
    err = _error(lambda: NESTED_CASES[how]({"num_memory_tokens": 4}))
    assert str(err) == f"model.rmt.num_memory_tokens: unknown field; known fields: {RMT_FIELDS}"
    assert err.field == "model.rmt.num_memory_tokens"


@pytest.mark.parametrize("how", NESTED_CASES)
def test_a_nested_mistyped_value_names_its_full_dotted_path_every_way_in(how):
    err = _error(lambda: NESTED_CASES[how]({"num_mem_tokens": "x"}))
    assert str(err) == "model.rmt.num_mem_tokens: expected an integer, got 'x'"


def test_model_from_dict_types_its_fields_like_the_run_config():
    assert str(_error(lambda: ModelConfig.from_dict({"n_layer": "2"}))) == \
        "model.n_layer: expected an integer, got '2'"
    assert str(_error(lambda: ModelConfig.from_dict({"cutoffs": [10, "a"],
                                                     "vocab_size": 100}))) == \
        "model.cutoffs[1]: expected an integer, got 'a'"
    assert str(_error(lambda: ModelConfig.from_dict({"lamemo": 3}))) == \
        "model.lamemo: expected a mapping of fields, got 3"
    # YAML ints for float fields, and PyYAML's string for 1e-4, are numbers.
    cfg = ModelConfig.from_dict({"mechanism": "lamemo", "dropout": 0, "lamemo": {"eps": "1e-4"}})
    assert cfg.dropout == 0.0 and isinstance(cfg.dropout, float) and cfg.lamemo.eps == 1e-4


def test_the_model_section_is_built_like_every_other_section():
    # The same messages for `model.<x>` and `data.<x>`: no special path for the model.
    for section in ("model", "data", "optim"):
        err = _error(lambda s=section: load_config("quickstart", [f"{s}.colour=red"]))
        assert err.field == f"{section}.colour"
        assert str(err).startswith(f"{section}.colour: unknown field; known fields: ")
        err = _error(lambda s=section: load_config("quickstart", [f"{s}=3"]))
        assert str(err) == f"{section}: expected a mapping of fields, got 3"


def test_an_empty_section_is_its_defaults():
    # `rmt:` with every line commented out reads as None: the defaults, as for any section.
    cfg = build_dataclass(ModelConfig, {"rmt": None, "lamemo": None}, "model")
    assert cfg.rmt == RMTOptions() and cfg.lamemo == LaMemoOptions()
    run = from_dict({"data": {"path": "d"}, "model": None, "bptt": None})
    assert run.model == ModelConfig() and run.bptt == type(run.bptt)()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_round_trips_through_the_builder(path):
    cfg = load_shipped(path)
    back = from_dict(cfg.to_dict())
    assert back == cfg and isinstance(back.model.rmt, RMTOptions)


def test_model_imports_neither_train_nor_cluster_and_cluster_takes_no_error_from_model():
    done = subprocess.run([sys.executable, "-c", "import sys, model, model.typed; "
                           "print(sorted(m for m in sys.modules "
                           "if m.split('.')[0] in ('train', 'cluster')))"],
                          capture_output=True, text=True, timeout=120, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    for source in (PROJECT_ROOT / "cluster").glob("*.py"):
        assert "from model" not in source.read_text(), source
    import cluster.sbatch
    import train.config
    assert cluster.sbatch.ConfigError is train.config.ConfigError is ConfigError


# ----------------------------------------------------------------------------- submit flags
OPTION_FIELDS = dataclasses.fields(SubmitOptions)
# Flags of `memtrain submit` that are not job options: the run and what to do with it.
NOT_OPTIONS = {"-h", "--help", "--config", "--sweep", "--dry-run"}
# A valid value unlike the default, for each string field.
STRINGS = {"time": "1-00:00:00", "partition": "gpu", "account": "lm", "qos": "high",
           "constraint": "a100&ib", "mem": "64G", "gpu_type": "v100", "job_name": "j1",
           "python": "/opt/venv/bin/python"}


def _non_defaults() -> tuple[list[str], dict]:
    """A command line setting every option to a non-default value, and those values."""
    hints = typing.get_type_hints(SubmitOptions)
    default = SubmitOptions()
    argv, want = [], {}
    for f in OPTION_FIELDS:
        tp = hints[f.name]
        if tp is bool:
            argv.append(flag(f.name))
            want[f.name] = True
        elif tp is int:
            want[f.name] = getattr(default, f.name) + 1
            argv += [flag(f.name), str(want[f.name])]
        elif typing.get_origin(tp) is list:
            want[f.name] = ["module load cuda/12.1", "echo ready"]
            for item in want[f.name]:
                argv += [flag(f.name), item]
        elif f.name == "launcher":
            want[f.name] = next(c for c in LAUNCHERS if c != default.launcher)
            argv += [flag(f.name), want[f.name]]
        else:
            want[f.name] = STRINGS[f.name]  # a new string field needs a sample here
            argv += [flag(f.name), want[f.name]]
        assert want[f.name] != getattr(default, f.name), f.name
    return argv, want


def test_a_submit_flag_exists_for_every_option_field_and_nowhere_else():
    parser = _parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert flags - NOT_OPTIONS == {flag(f.name) for f in OPTION_FIELDS}
    for f in OPTION_FIELDS:
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert flag(f.name) in parser.format_help()
    # submit.py spells out no option: no flag literal, no `args.<field>` read by hand.
    tree = ast.parse((PROJECT_ROOT / "cluster" / "submit.py").read_text())
    names = {f.name for f in OPTION_FIELDS}
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "args"}
    assert not literals & {flag(n) for n in names} and not attributes & names


def test_every_option_flag_reaches_its_field():
    argv, want = _non_defaults()
    args = _parser().parse_args(["--config", "quickstart", *argv])
    assert from_args(args) == SubmitOptions(**want)
    assert from_args(_parser().parse_args(["--config", "quickstart"])) == SubmitOptions()


def test_options_not_given_take_the_runs_name_and_this_interpreter(capsys):
    assert main_submit(["--config", "quickstart", "--gpus-per-node", "0", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --job-name=quickstart" in script
    assert f"srun --kill-on-bad-exit=1 {sys.executable} -m train" in script
    assert main_submit(["--config", "quickstart", "--job-name", "mine", "--dry-run"]) == 0
    assert "#SBATCH --job-name=mine" in capsys.readouterr().out


def test_a_bad_option_names_its_flag(capsys):
    assert main_submit(["--config", "quickstart", "--cpus-per-task", "0", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "memtrain submit: --cpus-per-task: must be >= 1"
    with pytest.raises(SystemExit) as done:
        main_submit(["--config", "quickstart", "--launcher", "mpirun"])
    assert done.value.code == 2
    assert "argument --launcher: invalid choice: 'mpirun'" in capsys.readouterr().err
