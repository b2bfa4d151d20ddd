"""The schema and conf/, composed in-process: every group has its documented options, keys are typed, each
default lives in the schema alone, a config from plain data is typed by it; bad input (a misspelt key, a batch
that does not split over ranks, too long a socket path) fails while composing or validating, naming the
key."""

import importlib.util
from pathlib import Path

import pytest
from helpers.config import options
from helpers.jobs import CONF, compose_cfg

from ddplab.config import ConfigError, validate
from ddplab.train.batch_size import global_batch_size


def test_every_group_has_its_documented_options():
    assert options("model") == [
        "convnet",
        "gpt",
        "hf",
        "keras_convnet",
        "mlp",
        "resnet18",
        "resnet34",
        "resnet50",
        "vae",
        "vit",
    ]
    assert options("dataset") == [
        "cifar10",
        "cifar100",
        "diabetes",
        "digits",
        "fashion_mnist",
        "hf",
        "imagefolder",
        "mnist",
        "synthetic",
        "text",
        "token_shards",
        "tokens",
    ]
    assert options("task") == ["classification", "lm", "regression", "vae"]
    assert options("optimizer") == ["adamw", "sgd"]
    assert options("scheduler") == ["constant", "cosine", "step"]
    assert options("distributed") == ["ddp", "dp", "fsdp", "none"]


def test_distributed_and_top_level_keys_are_typed():
    cfg = compose_cfg(
        [
            "distributed.find_unused_parameters=true",
            "distributed.sync_batchnorm=true",
            "distributed.bucket_cap_mb=50",
            "distributed.timeout_s=30",
            "amp=true",
            "grad_accum_steps=2",
            "grad_clip=1.0",
            "resume=auto",
            "batch_size_scope=per_rank",
        ]
    )
    validate(cfg)
    d = cfg.distributed
    assert d.find_unused_parameters is True and d.sync_batchnorm is True and cfg.amp is True
    # "50" on the command line, a float here
    assert type(d.bucket_cap_mb) is float and d.bucket_cap_mb == 50.0
    assert type(d.timeout_s) is float and type(cfg.grad_accum_steps) is int and cfg.grad_accum_steps == 2
    assert type(cfg.grad_clip) is float and cfg.resume == "auto" and cfg.batch_size_scope == "per_rank"


def test_resnet_state_dict_keys_match_torchvision_naming():
    from ddplab.models import resnet18, resnet50

    keys18 = set(resnet18(num_classes=10).state_dict())
    keys50 = set(resnet50(num_classes=10).state_dict())
    for k in [
        "conv1.weight",
        "bn1.running_mean",
        "layer1.0.conv1.weight",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.num_batches_tracked",
        "layer4.1.bn2.weight",
        "fc.weight",
        "fc.bias",
    ]:
        assert k in keys18
    assert "layer4.2.conv3.weight" in keys50 and "layer1.0.downsample.0.weight" in keys50
    # torchvision: 122 state_dict entries in resnet18, 320 in resnet50.
    assert len(keys18) == 122 and len(keys50) == 320
    # small_input changes conv1's kernel, not the keys.
    assert set(resnet18(num_classes=10, small_input=True).state_dict()) == keys18


def test_choice_fields_compare_and_print_as_their_option():
    cfg = compose_cfg(["distributed=fsdp", "amp_dtype=bf16", "perf.compile_mode=reduce-overhead"])
    d = cfg.distributed
    assert d.strategy == "fsdp" and f"{d.strategy}" == str(d.strategy) == "fsdp"
    assert cfg.amp_dtype == "bf16" and f"{cfg.perf.compile_mode}" == "reduce-overhead"
    assert {"fsdp": 1}[d.strategy] == 1  # hashes like the plain string


def test_global_batch_must_split_over_ranks():
    cfg = compose_cfg(["batch_size=64"])
    assert global_batch_size(cfg, 2) == 64
    with pytest.raises(ConfigError, match=r"batch_size=64 .* 3 ranks.*Fix: pass batch_size=63"):
        global_batch_size(cfg, 3)
    assert global_batch_size(compose_cfg(["batch_size=32", "batch_size_scope=per_rank"]), 3) == 96


def _repeats(values, schema_node, prefix=""):
    """Keys of a yaml body that merely repeat the schema's default."""
    out = []
    for k, v in values.items():  # a plain dict: interpolations stay unresolved strings
        if k in ("defaults", "_target_") or k not in schema_node:  # _target_ names the option itself
            continue
        if isinstance(v, dict):
            out += _repeats(v, schema_node[k], f"{prefix}{k}.")
        elif not (isinstance(v, str) and "${" in v) and v == schema_node[k]:
            out.append(f"{prefix}{k}={v}")
    return out


def test_defaults_live_in_one_place():
    """No yaml under conf/ repeats a value its schema already sets (the schema is the one place for
    defaults)."""
    from omegaconf import OmegaConf

    from ddplab.config.groups import GROUPS
    from ddplab.config.schema import DistributedConfig, TrainConfig

    schemas = {("distributed", "distributed"): DistributedConfig}
    schemas.update({(g, n): c for g, opts in GROUPS.items() for n, c in opts.items()})

    def load(f):
        return OmegaConf.to_container(OmegaConf.load(f), resolve=False)

    found = {"train.yaml": _repeats(load(CONF / "train.yaml"), OmegaConf.structured(TrainConfig))}
    for f in sorted(CONF.glob("*/*.yaml")):
        body = load(f)
        refs = [str(d) for d in body.get("defaults", []) if str(d).startswith("/schema/")]
        if refs:
            group, name = refs[0].split("@")[0].split("/")[2:4]
            found[str(f.relative_to(CONF))] = _repeats(body, OmegaConf.structured(schemas[(group, name)]))
    assert {k: v for k, v in found.items() if v} == {}
    assert len(found) >= 20  # every option file was looked at


@pytest.mark.parametrize(
    "override,key",
    [
        ("callbacks=[ema] callbacks.ema.decy=0.9", "callbacks.ema.decy"),
        ("task=vae task.betta=2", "task.betta"),
    ],
)
def test_a_misspelt_callback_or_task_key_fails_while_composing(override, key):
    """A typed callback or task node refuses a key it does not have (it used to reach the constructor)."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'"):
        compose_cfg(override.split())


def test_loader_workers_under_a_temp_dir_too_long_for_their_socket_are_one_config_line(monkeypatch, tmp_path):
    """Issue 45's soak found it: a loader worker hands batches over a unix socket under the temp dir; a long
    per-job TMPDIR made that path exceed 107 bytes, the worker failed and the job waited forever."""
    import tempfile

    from ddplab.config.validate import validate

    long = tmp_path / ("d" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with pytest.raises(
        ConfigError,
        match=r"perf.num_workers=2: loader workers pass batches over a unix socket .* "
        r"Fix: a shorter TMPDIR \(at most \d+ characters\), or perf.num_workers=0",
    ):
        validate(compose_cfg(["perf.num_workers=2"]))
    validate(compose_cfg(["perf.num_workers=0"]))  # no workers, no socket


def test_a_folder_named_like_an_extra_is_not_the_extra(tmp_path, monkeypatch):
    """A folder ``mlflow/`` in the working dir (MLflow's own data folder) where MLflow is not installed: a
    namespace package, which find_spec finds and Python imports, empty; it let the logger check pass on every
    rank, and rank 0 alone then failed."""

    from ddplab.config import schema

    (tmp_path / "ddplab_absent_extra").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("ddplab_absent_extra") is not None  # what the check was fooled by
    assert not schema._installed("ddplab_absent_extra")
    assert schema._installed("omegaconf")


def test_a_default_lives_in_the_schema_alone():
    """No use site restates a schema key's default (``cfg.get("key", default)``): every config arrives typed
    (``ddplab.config.typed``), so the schema's default is the one. The reads left are of other data that
    shares a key's name, each with its reason."""
    import ast
    import dataclasses

    from ddplab.config import schema

    keys = {
        f.name
        for obj in vars(schema).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj)
        for f in dataclasses.fields(obj)
    }
    src = Path(schema.__file__).parents[1]
    found = {
        f"{p.relative_to(src)}:{n.args[0].value}"
        for p in src.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "get"
        and len(n.args) == 2
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value in keys
    }
    assert found == {
        "rundir.py:params",  # a study trial's JSON record
        # a checkpoint's flat config,
        "train/resuming.py:batch_size_scope",
        "train/resuming.py:grad_accum_steps",
        "study/trials.py:seed",  # a sampler's spec                                  # maybe an older ddplab's
        "study/space.py:name",  # a search-space entry
    }, found


def test_a_config_from_plain_data_is_typed_by_the_schema(caplog):
    """A checkpoint's stored config, a rank's copy: a key it lacks gets the schema's default, a key the schema
    no longer has is dropped and named, a value of the wrong type is one ConfigError naming key and value."""
    from omegaconf import OmegaConf

    from ddplab.config.schema import PerfConfig
    from ddplab.config.typed import typed

    plain = OmegaConf.to_container(compose_cfg(["model=mlp"]), resolve=True, enum_to_str=True)
    del plain["perf"]["prefetch_factor"], plain["eval_every_n_steps"]  # stored by an older ddplab
    plain["perf"]["retired_key"] = 3
    with caplog.at_level("WARNING", logger="ddplab"):
        cfg = typed(plain, "resume=x.pt's stored config")
    assert OmegaConf.get_type(cfg.perf) is PerfConfig and cfg.perf.prefetch_factor == 2
    assert cfg.eval_every_n_steps == 0 and str(cfg.mode) == "train"
    assert (
        "resume=x.pt's stored config: keys this ddplab does not know, ignored: perf.retired_key"
        in caplog.text
    )
    plain["batch_size"] = "many"
    with pytest.raises(
        ConfigError, match=r"^resume=x.pt's stored config: batch_size='many': Value 'many' of type"
    ):
        typed(plain, "resume=x.pt's stored config")
