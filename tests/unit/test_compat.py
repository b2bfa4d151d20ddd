"""ddplab.compat's private torch, Optuna and Hydra APIs called for real in this process (stores, CPU features,
the agent's store factory, lerp, Optuna's trials, the rank server's fallback, Hydra's mode lookup, batch
norm's base class): when an upgrade renames or drops one, the test of that entry fails and names it (rather
than a run failing, or silently degrading, somewhere later)."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ddplab import compat


def test_default_store_is_the_groups_key_value_store(tmp_path):
    assert compat.default_store() is None  # no group yet
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        store = compat.default_store()
        store.set("ddplab/compat", "here")
        assert store.get("ddplab/compat") == b"here" and store.check(["ddplab/compat"])
    finally:
        dist.destroy_process_group()


def test_cpu_capability_lists_this_cpus_features():
    caps = compat.cpu_capability()
    assert caps and all(k == k.lower() for k in caps)
    flags = next(
        (line.split(":")[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), []
    )
    if "avx2" in flags:
        assert "avx2" in caps  # the two views of the same CPU agree


def test_agent_store_servers_replaces_the_agents_store_factory_and_restores_it():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler = dr.DynamicRendezvousHandler
    assert compat.has_agent_store_hook(), (
        "torch's agent no longer builds its store via _create_tcp_store_server"
    )
    original = handler.__dict__["_create_tcp_store_server"]
    assert list(inspect.signature(original).parameters) == ["self", "master_addr", "master_port"]
    made = []
    with compat.agent_store_servers(lambda host, port: made.append((host, port)) or "store"):
        assert handler._create_tcp_store_server(object(), "127.0.0.1", 29999) == "store"
    assert made == [("127.0.0.1", 29999)] and handler.__dict__["_create_tcp_store_server"] is original


def test_lerp_all_moves_every_tensor_toward_its_end():
    a, b = [torch.zeros(3), torch.ones(2)], [torch.full((3,), 4.0), torch.full((2,), 3.0)]
    compat.lerp_all_(a, b, 0.25)
    assert torch.equal(a[0], torch.full((3,), 1.0)) and torch.equal(a[1], torch.full((2,), 1.5))


def test_optuna_trial_is_the_live_trial_of_that_number():
    import optuna

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="maximize")
    study.ask(), study.ask()
    trial = compat.optuna_trial(study, 1)
    trial.report(0.5, 3)
    assert trial.number == 1 and study.get_trials()[1].intermediate_values == {3: 0.5}
    assert study.get_trials()[0].intermediate_values == {}


def test_frozen_trial_reads_what_another_handle_wrote_since():
    import optuna

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    mine = study.ask()
    compat.optuna_trial(study, 0).set_user_attr("ddplab:owner", {"pid": 7})  # another worker's handle
    record = compat.frozen_trial(mine)
    assert record.number == 0 and record.user_attrs == {"ddplab:owner": {"pid": 7}}


def test_rank_server_that_cannot_start_gives_spawn_and_leaves_this_processs_signals_as_they_were(monkeypatch):
    """Its socket lives in TMPDIR: too long a path and it cannot start. The launch then spawns its ranks, and
    the stop signals the launcher ignored and blocked while the server started are its own again."""
    import signal
    from multiprocessing import forkserver

    def cannot(*_):
        raise OSError("AF_UNIX path too long")

    monkeypatch.setattr(forkserver, "ensure_running", cannot)
    mine = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        with compat.rank_server(["colorsys"], (signal.SIGUSR1,)) as method:
            assert method == "spawn"
            assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN
            assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGUSR1, mine)


def test_answer_hydra_mode_answers_unset_without_composing_only_where_nothing_can_set_it(monkeypatch):
    """Hydra's ``Hydra.get_mode(self, config_name, overrides)``: the shortcut stands in for it where the
    predicate says nothing can set ``hydra.mode`` (None: unset), and calls it otherwise; installed once."""
    from hydra._internal.hydra import Hydra

    assert list(inspect.signature(Hydra.get_mode).parameters) == ["self", "config_name", "overrides"]
    composed: list[list[str]] = []
    monkeypatch.setattr(
        Hydra, "get_mode", lambda self, name, overrides: composed.append(overrides) or "MULTIRUN"
    )
    compat.answer_hydra_mode(lambda overrides: "hydra.mode=MULTIRUN" in overrides)
    assert Hydra.get_mode(None, "train", ["model=mlp"]) is None and composed == []
    assert Hydra.get_mode(None, "train", ["hydra.mode=MULTIRUN"]) == "MULTIRUN"
    assert composed == [["hydra.mode=MULTIRUN"]]
    compat.answer_hydra_mode(lambda overrides: False)  # a second install keeps the first
    assert Hydra.get_mode(None, "train", ["hydra.mode=MULTIRUN"]) == "MULTIRUN"


def test_batch_norm_base_is_what_every_batch_norm_subclasses():
    for kind in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm):
        assert issubclass(kind, compat.BatchNormBase), kind
    assert not issubclass(torch.nn.LayerNorm, compat.BatchNormBase)
