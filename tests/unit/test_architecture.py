"""House rules of docs/architecture.md, checked on the source: sizes, no import cycles,
one owner for the strategy, the launcher environment and the checkpoint policy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ddplab"
MODULES = sorted(SRC.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {module_name(p): p for p in MODULES}


def test_the_rules_look_at_every_module():
    assert len(MODULES) >= 30 and "ddplab.train.loop" in NAMES and "ddplab.strategy.base" in NAMES
    sized = {str(p.relative_to(ROOT)) for p in SCRIPTS + TESTS}  # the size rules' scripts and test modules
    assert {
        "train.py",
        "scripts/soak.py",
        "tests/toy.py",
        "tests/conftest.py",
        "tests/helpers/jobs.py",
        "tests/workers/count_worker.py",
        "tests/unit/test_architecture.py",
    } <= sized, sorted(sized)


ROOT = SRC.parents[1]
SCRIPTS = [ROOT / "train.py", *sorted((ROOT / "scripts").glob("*.py"))]  # the house rules hold there too
TESTS = sorted((ROOT / "tests").rglob("*.py"))  # and in the tests: helpers/, workers/, the toys


@pytest.mark.parametrize("path", MODULES + SCRIPTS + TESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.name}: over 400 lines"
    long = [
        f"{n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for n in ast.walk(ast.parse(text))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60
    ]
    assert not long, f"{path.name}: functions over 60 lines: {long}"


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``: an import a type checker alone reads is no edge."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(path: Path) -> set[str]:
    """ddplab modules ``path`` imports, at module level or inside functions (a lazy import is still an edge;
    one under ``if TYPE_CHECKING:`` is not)."""
    me = module_name(path)
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else ".".join(me.split(".")[: -node.level] + [node.module])
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in NAMES else base)
    return {m for m in out if m in NAMES and m != me}


def test_no_import_cycles():
    graph = {m: imports_of(p) for m, p in NAMES.items()}
    # Importing a submodule runs its parent packages' __init__; those edges are implicit, not design.
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
    assert "ddplab.job" not in graph["ddplab.runtime.launch"]  # self-launch takes an entry callable


def room(module: str) -> str:
    """A module's place in the house: its top-level subpackage (``train``, ``data``, ...) or itself."""
    return module.split(".")[1] if "." in module else module


def test_every_import_runs_down_a_floor():
    """The rooms (top-level modules and subpackages) import each other without a loop: each can stand on a
    floor above all it imports, so no import runs from a lower room up to a higher one (the hook protocol,
    resuming and reporting live in ``train/``, which the shipped callbacks and the jobs stand on)."""
    edges = {(room(m), room(n)) for m, p in NAMES.items() if m != "ddplab" for n in imports_of(p)}
    edges = {(a, b) for a, b in edges if a != b and b != "ddplab"}  # the package face hands names on

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return a == b or any(x == a and y not in seen and reaches(y, b, seen | {y}) for x, y in edges)

    looped = sorted(f"{a} -> {b}" for a, b in edges if reaches(b, a, {b}))  # an arrow inside a loop of rooms
    assert looped == [], looped
    floor: dict[str, int] = {}
    for _ in range(len(edges)):  # each room one floor above the highest it imports
        floor = {a: 1 + max((floor.get(y, 0) for x, y in edges if x == a), default=0) for a, _ in edges}
    assert floor["cli"] > floor["train"] > floor["checkpoint"] > floor["runtime"] > floor["config"]


def test_type_checking_imports_are_no_edges():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
        "def f():\n    import c\n"
    )
    seen = {a.name for n in _runtime_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert seen == {"b", "c"}


def _outside(*owners: str) -> list[Path]:
    return [p for p in MODULES if not any(str(p.relative_to(SRC)).startswith(o) for o in owners)]


STRATEGY_WORDS = re.compile(
    r"DistributedDataParallel|DataParallel|fully_shard|full_tensor|(?<!strategy\.)no_sync\(|"
    r"set_requires_gradient_sync|\bDTensor|strategy\)*\s*(==|!=|in\b)|\"(ddp|dp|fsdp)\""
)


def test_only_the_strategy_branches_on_the_strategy():
    hits = [
        f"{p.relative_to(SRC)}:{i}: {line.strip()}"
        for p in _outside("strategy/", "config/")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if STRATEGY_WORDS.search(line)
    ]
    assert hits == []
    assert STRATEGY_WORDS.search((SRC / "strategy" / "ddp.py").read_text())  # the pattern does find them


def test_only_the_env_module_reads_the_launcher_environment():
    pattern = re.compile(r"os\.environ|getenv|\"(RANK|WORLD_SIZE|LOCAL_RANK|SLURM_\w*|TORCHELASTIC_\w*)\"")
    hits = [
        f"{p.relative_to(SRC)}: {line.strip()}"
        for p in _outside("runtime/env.py")
        for line in p.read_text().splitlines()
        if pattern.search(line)
    ]
    # keras_convnet sets KERAS_BACKEND before importing keras: a library switch, not launcher state.
    keras = 'models/keras_convnet.py: os.environ.setdefault("KERAS_BACKEND", "torch")'
    assert [h.split("  #")[0] for h in hits] == [keras]


def test_only_the_checkpoint_manager_names_and_times_checkpoints():
    pattern = re.compile(r"torch\.save\(|last\.pt|best\.pt|step-[{*]|\bevery_n_steps|keep_last")
    hits = [
        f"{p.relative_to(SRC)}:{i}"
        for p in _outside("checkpoint/", "config/")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []


def test_the_readme_is_a_front_door_and_every_docs_page_is_in_the_site():
    """The README: what ddplab is, the two commands, the common commands, links (<= 200 lines); the manual
    lives in docs/, every page of it in mkdocs.yml's nav (`mkdocs build --strict` in .ci/run checks links)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    nav = (ROOT / "mkdocs.yml").read_text()
    assert pages and [p for p in pages if f" {p}" not in nav] == []
    # linked from the front door
    assert [p for p in pages if f"(docs/{p})" not in readme and p != "index.md"] == []


def test_the_architecture_page_names_every_script():
    layout = (
        (ROOT / "docs" / "architecture.md")
        .read_text()
        .split("## Repository layout", 1)[1]
        .split("\n## ", 1)[0]
    )
    missing = [
        p.name
        for p in sorted((ROOT / "scripts").iterdir())
        if p.suffix in (".py", ".sh") and p.name not in layout
    ]
    assert missing == [], f"docs/architecture.md's layout does not name: {missing}"


def test_no_module_outside_the_trainer_reads_trainer_attributes():
    """Callbacks, reporting and resuming see the job's State (ddplab.train.state), not the Trainer: only
    job.py makes one, and it asks only fit() and evaluate_checkpoint(). No function elsewhere takes a
    trainer (``trainer``, or ``t: Any`` as reporting and resuming did)."""
    named, takes = [], []
    for p in MODULES:
        if p == SRC / "train" / "loop.py":
            continue
        tree = ast.parse(p.read_text())
        named += [
            f"{p.relative_to(SRC)}:{n.lineno}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id == "Trainer"
        ]
        takes += [
            f"{p.relative_to(SRC)}:{n.lineno} {n.name}({a.arg})"
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in n.args.args
            if a.arg == "trainer"
            or (a.arg == "t" and a.annotation is not None and ast.unparse(a.annotation) == "Any")
        ]
    assert {h.split(":")[0] for h in named} <= {"job.py"} and takes == [], (named, takes)
    job = ast.parse((SRC / "job.py").read_text())
    used = {
        n.attr
        for n in ast.walk(job)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "trainer"
    }
    assert used == {"fit", "evaluate_checkpoint"}, used


def test_a_state_is_complete_when_build_state_returns_it():
    """Every field of the State is given to its constructor in build_state, and no module assigns one later
    (the loop's own records, ``loop`` and ``results``, change inside; ``request_stop`` sets
    ``stop_reason``)."""
    from dataclasses import fields

    from ddplab.train.state import State

    names = {f.name for f in fields(State)}
    assemble = ast.parse((SRC / "train" / "assemble.py").read_text())
    made = [n for n in ast.walk(assemble) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "State"]
    given = {k.arg for k in made[0].keywords if k.arg}
    # The model's fields come as one group, built together in the order of their draws (assemble._Model).
    splats = [ast.unparse(k.value) for k in made[0].keywords if k.arg is None]
    if splats == ["m._asdict()"]:
        from ddplab.train.assemble import _Model

        given |= set(_Model._fields)
    assert len(made) == 1 and len(splats) <= 1 and names - {"stop_reason"} == given, names

    def assigned(tree: ast.AST) -> list[str]:
        return [
            f"{n.lineno} {ast.unparse(t)}"
            for n in ast.walk(tree)
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)
            and t.attr in names
            and ast.unparse(t.value) in ("s", "state", "self.state")
        ]

    assert assigned(ast.parse("s.writer = make_writer()\nself.state.checkpoints = m")) == [
        "1 s.writer",
        "2 self.state.checkpoints",
    ]
    later = {str(p.relative_to(SRC)): assigned(ast.parse(p.read_text())) for p in MODULES}
    assert {k: v for k, v in later.items() if v} == {}


def test_one_table_decides_the_mode():
    """Only ddplab.modes reads ``cfg.mode`` (the schema checks its values): the CLI, ddplab.run and the
    Trainer ask no one else."""
    reads = re.compile(r"""cfg\.mode\b|\.get\(["']mode["']""")
    hits = [
        f"{p.relative_to(SRC)}:{i}"
        for p in _outside("modes.py", "config/")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert hits == []
    assert reads.search((SRC / "modes.py").read_text())  # the pattern does find them
    from ddplab.config.schema import Mode
    from ddplab.modes import MODES

    assert set(MODES) == {m.name for m in Mode}


def test_train_step_reads_in_one_screen():
    """Trainer.train_step: at most 30 lines, and its body shows one optimizer step in order: autocast,
    backward (no_sync while accumulating), unscale, clip, step, zero_grad, schedule."""
    tree = ast.parse((SRC / "train" / "loop.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    assert fn.end_lineno - fn.lineno + 1 <= 30, fn.end_lineno - fn.lineno + 1
    body = ast.unparse(fn)
    order = [
        "no_sync(",
        "autocast()",
        "backward(",
        "unscale(",
        "clip_grad_norm_(",
        "precision.step(",
        "zero_grad(",
        "scheduler.step()",
    ]
    at = [body.find(w) for w in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))
    # Only the step: how long it waited for data and where a stall is are the interval's StepProbe's, the
    # first step's checks FirstStep's (a wrapper, not attributes swapped), when to evaluate the Validation's.
    assert not re.findall(r"perf_counter|time\.|watch|phase|data_time|step_fn|after_backward|check_", body), (
        body
    )


def test_the_trainer_only_loops():
    """The Trainer is the loop over a State, about 200 lines; what it used to carry has owners of its own."""
    tree = ast.parse((SRC / "train" / "loop.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 200, trainer.end_lineno - trainer.lineno + 1
    methods = {n.name for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert not methods & {
        "_first_step",
        "_checked_step",
        "_first_backward",
        "_eval_due",
        "_evaluate_all",
        "_evaluate_and_record",
        "_seed_epoch",
        "_hurry_writer",
    }, methods


def test_private_apis_of_other_packages_are_named_in_compat_alone():
    """A leading-underscore name of torch, Hydra, Optuna or Python's own modules — imported, or reached as an
    attribute of such a module — appears only in ``ddplab.compat``, where each has a test
    (tests/integration/test_compat.py)."""

    def private(dotted: str) -> bool:
        return not dotted.startswith("ddplab") and any(
            p.startswith("_") and not p.startswith("__") for p in dotted.split(".")
        )

    hits = []
    for p in _outside("compat.py"):
        tree = ast.parse(p.read_text())
        names = {}  # local name -> the module it stands for
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names |= {
                    (a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0])
                    for a in n.names
                }
                hits += [
                    f"{p.relative_to(SRC)}:{n.lineno} import {a.name}" for a in n.names if private(a.name)
                ]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                hits += [
                    f"{p.relative_to(SRC)}:{n.lineno} from {n.module} import {a.name}"
                    for a in n.names
                    if private(f"{n.module}.{a.name}")
                ]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                root = n.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (
                    isinstance(root, ast.Name)
                    and root.id in names
                    and not names[root.id].startswith("ddplab")
                ):
                    hits.append(f"{p.relative_to(SRC)}:{n.lineno} {ast.unparse(n)}")
    documented = ("os._exit",)  # public despite the underscore (the docs of os)
    assert [h for h in hits if h.rsplit(" ", 1)[-1] not in documented] == [], hits
