"""Building a job's parts from its config — the only place that calls Hydra's ``instantiate``
on the model, dataset and task groups: the dataset's splits + augmentation, the model with
``model.weights`` loaded, the task. Wrapping and placement belong to the strategy."""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ddplab.config import ConfigError, InputError
from ddplab.data import (
    BatchAugment,
    ShardedGlobalSampler,
    Splits,
    TensorData,
    TrainLoader,
    on_device,
    to_device,
)
from ddplab.data.streams import StreamLoader, is_stream
from ddplab.runtime import collectives, signals


def dataset(cfg: DictConfig) -> tuple[Splits, BatchAugment | None]:
    """The dataset factory's splits, and the augmentation its config asks for.

    ``augment`` is applied by the loader, batched on the device; the factory never sees it.
    A factory may return :class:`Splits`, a ``(train, val)`` pair of map-style datasets, or a
    dict with ``train``, ``val`` and optionally ``collate_fn``.
    """
    spec = _spec(cfg, "dataset")
    aug = spec.pop("augment", None)
    return splits_of(_make(spec, "dataset"), spec.get("_target_")), (BatchAugment(**aug) if aug else None)


def splits_of(made: Any, target: Any) -> Splits:
    if isinstance(made, Splits):
        return made
    if isinstance(made, dict) and {"train", "val"} <= made.keys():
        return Splits(made["train"], made["val"], made.get("num_classes"), made.get("collate_fn"))
    if isinstance(made, (tuple, list)) and len(made) == 2:
        return Splits(made[0], made[1])
    raise TypeError(
        f"dataset._target_={target} returned {type(made).__name__}; a dataset factory returns "
        "(train, val) map-style datasets, a dict with 'train', 'val' (and 'collate_fn'), or "
        "ddplab.data.Splits. Fix: return (train_dataset, val_dataset)"
    )


def task(cfg: DictConfig) -> Any:
    """The task object ``cfg.task`` names (a ``_target_`` class and its keyword arguments)."""
    spec = _spec(cfg, "task")
    made = _make(spec, "task")
    if not callable(made):
        raise TypeError(
            f"task._target_={spec.get('_target_')} made a {type(made).__name__}, which cannot be "
            "called on (model, batch). Fix: point it at a Task class (see ddplab.task)"
        )
    return made


def model(cfg: DictConfig, num_classes: int | None = None) -> nn.Module:
    """The model factory's module, with ``model.weights`` (a local file) loaded into it. ``num_classes``: the
    dataset's count, for a ``model.num_classes`` left null (dataset=imagefolder counts its class folders)."""
    spec = _spec(cfg, "model")
    if "num_classes" in spec and spec["num_classes"] is None:
        if num_classes is None:
            raise ConfigError(
                f"model.num_classes=None: dataset._target_={cfg.dataset.get('_target_')!r} does not "
                "say how many classes it has. Fix: set dataset.num_classes (or model.num_classes)"
            )
        spec["num_classes"] = num_classes
    if isinstance(spec.get("vocab_size"), int) and num_classes and spec["vocab_size"] < num_classes:
        raise ConfigError(
            f"model.vocab_size={spec['vocab_size']}, but the data's ids go up to {num_classes - 1} "
            f"(dataset.vocab_size={cfg.dataset.get('vocab_size', num_classes)}): those ids would have "
            "no embedding. Fix: model.vocab_size=${dataset.vocab_size} (model=gpt's default)"
        )
    weights = spec.pop("weights", None)
    module = _make(spec, "model")
    if num_classes and str(cfg.task.get("_target_", "")).endswith("LanguageModelTask"):
        _check_vocabulary(module, num_classes, cfg)
    if weights:
        from ddplab.models.weights import load_weights

        load_weights(module, weights)
    return module


def _check_vocabulary(module: nn.Module, ids: int, cfg: DictConfig) -> None:
    """Every model kind, not only those with a ``model.vocab_size`` key: an LM whose input embedding has fewer
    rows than the data has ids fails at step 1 with an IndexError (a device-side assert on GPU)."""
    hf = getattr(module, "hf", None)
    emb = (
        hf.get_input_embeddings()
        if hf is not None
        else next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    )
    if emb is None or emb.num_embeddings >= ids:
        return
    configured = hf is not None and not cfg.model.get("pretrained")
    where = (
        "model.config.vocab_size"
        if configured
        else f"model.pretrained={cfg.model.get('pretrained')}'s vocab_size"
        if hf is not None
        else "the model's embedding"
    )
    fix = "model.config.vocab_size=${dataset.vocab_size}" if configured else "or a tokenizer whose ids fit it"
    raise ConfigError(
        f"{where}={emb.num_embeddings}, but the data's ids go up to {ids - 1} (dataset.vocab_size="
        f"{cfg.dataset.get('vocab_size', ids)}): those ids would have no embedding. Fix: a model with "
        f"a vocabulary of at least {ids} ({fix})"
    )


def callbacks(cfg: DictConfig, evaluating: bool = False) -> dict[str, Any]:
    """name -> the callback ``cfg.callbacks.<name>`` makes (entries set to null are left out; ``evaluating``:
    mode=eval, which leaves out those that only serve training)."""
    spec = _spec(cfg, "callbacks") if cfg.get("callbacks") else {}
    made = {}
    for name, node in spec.items():
        if node is None:
            continue
        if not isinstance(node, dict) or "_target_" not in node:
            raise TypeError(
                f"callbacks.{name}={node!r}: a callback entry needs a _target_ (a class) and its "
                f"arguments. Fix: callbacks.{name}._target_=mypkg.MyCallback, or drop it"
            )
        made[name] = _make(node, f"callbacks.{name}")
    return {name: cb for name, cb in made.items() if not (evaluating and getattr(cb, "training_only", False))}


def _spec(cfg: DictConfig, key: str) -> dict[str, Any]:
    """``cfg.<key>`` as a plain dict (validate() has checked that it resolves)."""
    return OmegaConf.to_container(cfg[key], resolve=True, enum_to_str=True)  # type: ignore[return-value]


_NAMES_A_KEY = re.compile(r"^(model|dataset|task|callbacks|optimizer|scheduler)\.[\w.]+[=:]")


def _make(spec: dict[str, Any], key: str) -> Any:
    """``instantiate(spec)``; what is the config's fault becomes a one-line :class:`ConfigError`: a
    ``_target_`` that does not import, a factory's own refusal of a value (an error whose message
    starts with the key it refuses, ``model.n_embd=...: ...``, as ddplab's factories write them), and of
    the input its config names (an :class:`InputError`: a token file the config does not describe). Any
    other error is a failure of the code, with its traceback."""
    try:
        return instantiate(spec, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__
        if isinstance(cause, (ConfigError, InputError)) or (
            isinstance(cause, (ValueError, KeyError, TypeError))
            and _NAMES_A_KEY.match(str(cause.args[0]) if cause.args else "")
        ):
            raise ConfigError(str(cause.args[0])) from None
        if str(e).startswith("Error locating target"):
            # Hydra's: "Error loading 'x.Y':\nModuleNotFoundError(...)"
            why = " ".join(str(cause).split("\n")[:2])
            raise ConfigError(
                f"{key}._target_={spec.get('_target_')!r}: cannot be imported ({why}). Fix: a dotted "
                "path to a class or function importable here (is its package on PYTHONPATH?)"
            ) from None
        raise


class TrainData(NamedTuple):
    data: Splits
    sampler: ShardedGlobalSampler
    loader: TrainLoader | StreamLoader
    steps_per_epoch: int


def train_data(cfg: DictConfig, dist: Any, global_batch: int, accum: int) -> TrainData:
    """The dataset on its device (the fast path where it fits), this rank's sampler and loader,
    and the optimizer steps per epoch (``limit_train_steps``, ``overfit_batches`` applied)."""
    data, augment = dataset(cfg)
    per_step = global_batch * accum  # samples per optimizer step (ddplab.train.batch_size)
    if is_stream(data.train):
        return _stream_data(cfg, dist, data, augment, global_batch, accum)
    if cfg.overfit_batches:
        keep = min(len(data.train), cfg.overfit_batches * per_step)
        data.train = _head(data.train, keep)
        data.val = data.train  # learning at all shows first on the very batches it trains on
    indexed = on_device(data.train, dist.device, cfg.perf.data_on_device)
    if indexed:
        data.train = to_device(data.train, dist.device)
        if isinstance(data.val, TensorData):
            data.val = to_device(data.val, dist.device)
    sampler = ShardedGlobalSampler(
        len(data.train),
        global_batch,
        dist.world_size,
        dist.rank,
        cfg.seed,
        accum,
        order=getattr(data.train, "sample_order", "permutation"),
    )
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"batch_size={cfg.batch_size} x grad_accum_steps={accum} needs {per_step} samples per "
            f"optimizer step, but the training set has {len(data.train)}. Fix: lower batch_size or "
            "grad_accum_steps."
        )
    shield = signals.WorkerShield()  # a preemption signal is the rank's, not its loader workers'
    loader = TrainLoader(
        data.train,
        sampler,
        dist.device,
        augment,
        cfg.perf.num_workers,
        cfg.perf.pin_memory,
        indexed=indexed,
        collate_fn=data.collate_fn,
        prefetch_factor=cfg.perf.prefetch_factor,
        worker_init_fn=shield,
        starting_workers=shield.starting,
    )
    steps = min(sampler.steps_per_epoch, cfg.limit_train_steps or sampler.steps_per_epoch)
    return TrainData(data, sampler, loader, steps)


def _stream_data(
    cfg: DictConfig, dist: Any, data: Splits, augment: Any, global_batch: int, accum: int
) -> TrainData:
    """An IterableDataset: one global stream every rank reads (ddplab.data.streams); what it cannot do,
    refused."""
    name = f"dataset._target_={cfg.dataset.get('_target_')!r}"
    for part, ds in (("training", data.train), ("validation", data.val)):
        # a Hugging Face IterableDataset after split_dataset_by_node
        split = getattr(ds, "_distributed", None)
        if split is not None:
            raise ConfigError(
                f"{name}: its {part} stream is already split by node (split_dataset_by_node: rank "
                f"{split.rank} of {split.world_size}); ddplab cuts one global stream into the ranks' "
                "slices itself, so it would keep a slice of a slice. Fix: return the dataset before "
                "split_dataset_by_node"
            )
        try:
            len(ds)
        except TypeError:
            raise ConfigError(
                f"{name}: its {part} IterableDataset has no __len__. Fix: give it __len__ (the samples "
                "one epoch yields): the lr schedule and every rank's step count come from it"
            ) from None
    for key, on in (
        ("overfit_batches", cfg.overfit_batches),
        ("dataset.augment", augment is not None and augment.enabled),
    ):
        if on:
            raise ConfigError(
                f"{key}: not for an IterableDataset ({name}). Fix: drop {key}, or augment inside the dataset"
            )
    sampler = ShardedGlobalSampler(len(data.train), global_batch, dist.world_size, dist.rank, cfg.seed, accum)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"batch_size={cfg.batch_size} x grad_accum_steps={accum}: one optimizer step needs "
            f"{global_batch * accum} samples, but {name} yields {len(data.train)} an epoch. Fix: lower "
            "batch_size or grad_accum_steps"
        )
    rows = functools.partial(collectives.all_ranks_rows, dist=dist) if dist.world_size > 1 else None
    shield = signals.WorkerShield()
    loader = StreamLoader(
        data.train,
        sampler,
        dist.device,
        cfg.perf.num_workers,
        cfg.perf.pin_memory,
        data.collate_fn,
        cfg.perf.prefetch_factor,
        shield,
        rows,
        name,
        shield.starting,
    )
    steps = min(sampler.steps_per_epoch, cfg.limit_train_steps or sampler.steps_per_epoch)
    return TrainData(data, sampler, loader, steps)


def _head(ds: Any, n: int) -> Any:
    if isinstance(ds, TensorData):
        return TensorData(ds.x[:n], ds.y[:n])
    from torch.utils.data import Subset

    return Subset(ds, range(n))


# torch's words for a model/input shape mismatch (conv kernels, matmuls, reshapes).
_SHAPE_ERROR = re.compile(r"size|shape|kernel|mat1|dimension", re.IGNORECASE)


def shape_mismatch(cfg: DictConfig, e: RuntimeError) -> ConfigError | None:
    """The first step's RuntimeError as the config's fault, when it is a model that cannot take the
    dataset's samples (said with the sizes and the fix); None for any other error."""
    if not _SHAPE_ERROR.search(str(e)):
        return None
    ds, name = cfg.dataset, cfg.model.get("_target_", "the model")
    sizes = ", ".join(f"dataset.{k}={ds[k]}" for k in ("in_channels", "image_size", "num_classes") if k in ds)
    return ConfigError(
        f"{name} cannot train on {ds.get('_target_', 'the dataset')}'s samples ({sizes}): "
        f"{str(e).splitlines()[0]}. Fix: choose dataset sizes this model accepts (a larger "
        "dataset.image_size for convolution stacks), or a model made for them (model=mlp takes any)"
    )
