"""The house's layers, checked from the code's own imports (docs/architecture.md "Layers").

    launch -> recipes -> controller -> executors -> modeling -> channels, algorithms -> common
    (each a package of `tidal`: tidal.launch, tidal.recipes, ...; no module imports them by their bare names)
    launch, bench -> planner (imports nothing else of the project: a model of the step, not a part of it)
    bench -> launch (jobs from Python, the config and memory estimate: bench stands where a user's script does)
Each package may import only the packages listed for it; a deferred import inside a function
counts too. The CLI and --dry-run load no model code.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "algorithms", "channels", "modeling", "executors", "controller", "recipes", "launch", "planner")

# what each package (and the folders users copy from) may import of the project
ALLOWED = {
    "common": set(),
    "algorithms": {"common"},
    "channels": {"common"},
    # the model library: below every executor, above nothing of the run (the channels' payload types only)
    "modeling": {"common", "channels"},
    "executors": {"common", "channels", "algorithms", "modeling"},
    "controller": {"common", "channels", "executors"},
    "recipes": {"common", "algorithms", "channels", "modeling", "executors", "controller"},
    "launch": {"common", "algorithms", "channels", "modeling", "executors", "controller", "recipes", "planner"},
    "planner": {"executors"},  # the engine registry only (NARROW): how an engine's decode slots are set
    "examples": {"common", "algorithms", "channels", "modeling", "executors", "controller", "recipes"},
    "bench": {"common", "algorithms", "channels", "modeling", "executors", "controller", "recipes", "launch",
              "planner"},
}
# executors and the model library reach channels for payload types only (docs/architecture.md), and only the trainer runs algorithms
NARROW = {
    ("executors", "channels"): {"channels.payloads"},
    ("modeling", "channels"): {"channels.payloads"},
    ("planner", "executors"): {"executors.generator.engines"},
}
ALGORITHM_USERS = ("tidal/executors/trainer/", "tidal/executors/critic/")
# executors talk through channels, never by importing each other (docs/architecture.md "Layers"): an executor's
# package may import the shared ones, and another executor's light config classes only
SHARED_EXECUTOR_PACKAGES = {"base", "data", "learner",  # learner: the trainer's and the critic's base
                            "environments"}  # a multi-turn rollout's, not an executor


def _executor_package(rel: str) -> str | None:
    parts = rel.split("/")
    return parts[2].removesuffix(".py") if parts[:2] == ["tidal", "executors"] and len(parts) > 2 else None


def _folder(layer: str) -> Path:
    """Where a layer's files are: the packages in tidal/, the folders users copy from at the root."""
    return ROOT / "tidal" / layer if layer in PACKAGES else ROOT / layer


def _files(layer: str):
    """(path from the root, e.g. `tidal/executors/trainer/models.py`; the path) of a layer's files."""
    for path in sorted(_folder(layer).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each absolute import; a project module without its `tidal.` (`executors.base`),
    one imported by its bare name with a `!` (`!common.spawn`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, module.removeprefix("tidal.") if module.startswith("tidal.") else
             f"!{module}" if module.split(".")[0] in PACKAGES else module) for line, module in out]


def _violations() -> list[str]:
    bad = []
    for layer, allowed in ALLOWED.items():
        for rel, path in _files(layer):
            for line, module in _imports(path):
                if module.startswith("!"):  # installed, `common` would be a user's own module of that name
                    bad.append(f"{rel}:{line} imports {module[1:]} by its bare name (write tidal.{module[1:]})")
                    continue
                top = module.split(".")[0]
                if top not in PACKAGES + ("tests",) or top == layer:
                    continue
                narrow = NARROW.get((layer, top))
                if top not in allowed:
                    bad.append(f"{rel}:{line} imports {module} ({layer} may not import {top})")
                elif narrow and module not in narrow:
                    bad.append(f"{rel}:{line} imports {module} ({layer} may import only {sorted(narrow)} of {top})")
                elif layer == "executors" and top == "algorithms" and not rel.startswith(ALGORITHM_USERS):
                    bad.append(f"{rel}:{line} imports {module} (only the trainer and the critic run algorithms)")
            if layer == "executors":
                bad += _cross_executor(rel, path)
    return bad


def _cross_executor(rel: str, path: Path) -> list[str]:
    mine, bad = _executor_package(rel), []
    for line, module in _imports(path):
        parts = module.split(".")
        if parts[0] != "executors" or len(parts) < 2:
            continue
        theirs = parts[1]
        if theirs in (mine, *SHARED_EXECUTOR_PACKAGES) or parts[2:] == ["config"]:
            continue
        bad.append(f"{rel}:{line} imports {module} (an executor imports no other executor; shared code "
                   f"goes to tidal/executors/learner or tidal/modeling/parallel)")
    return bad


def test_every_import_follows_the_layers():
    assert _violations() == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rules can fail: a channels module importing an executor, and an executor importing another
    executor's code (its config is allowed), are reported with their lines."""
    fake = tmp_path / "tidal" / "channels"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("import torch\n\nfrom tidal.executors.base import Executor\nfrom common.spawn import spawn\n")
    (tmp_path / "tidal" / "executors" / "critic").mkdir(parents=True)
    (tmp_path / "tidal" / "executors" / "critic" / "bad.py").write_text(
        "from tidal.executors.trainer.config import TrainerConfig\nfrom tidal.executors.trainer.models import TriModel\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations() == [
        "tidal/channels/bad.py:3 imports executors.base (channels may not import executors)",
        "tidal/channels/bad.py:4 imports common.spawn by its bare name (write tidal.common.spawn)",
        "tidal/executors/critic/bad.py:2 imports executors.trainer.models (an executor imports no other executor; shared "
        "code goes to tidal/executors/learner or tidal/modeling/parallel)"]


_PROBE = """
import contextlib, io, sys
from tidal.launch.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
heavy = [m for m in ("transformers", "torch.distributed.tensor", "tidal.executors.trainer.models",
                     "tidal.modeling.packed_attention") if m in sys.modules]
print(code, "phases" if "1. prompts" in out.getvalue() else "no-phases", heavy)
"""


@pytest.mark.parametrize("args", [["--algo", "grpo", "--dry-run"],
                                  ["--algo", "dapo", "--dry-run", "--set", "trainer.dp=2"],
                                  ["--algo", "ppo", "--dry-run", "--set", "reward.model.scale=2", "--set", "eval.every=2"]])
def test_cli_and_dry_run_load_no_model_code(args):
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.split("\n")[0] == "0 phases []", proc.stdout + proc.stderr


# ---- issue 27: ports by handle, choices by registry -------------------------------------------------
ENDPOINT_MAPS = {"inbound", "outbound"}
# the registries that may name an engine or a backend; the planner reads run configs as plain dicts and
# imports nothing of the project (the layers above), so it cannot consult them
REGISTRIES = {"tidal/executors/generator/engines.py", "tidal/executors/trainer/backends.py"}


def _choices() -> set[str]:
    """Every registered engine's and backend's name, read from the registries: a third one is covered too."""
    from tidal.executors.generator.engines import ENGINES
    from tidal.executors.trainer.backends import BACKENDS

    return set(ENGINES.names()) | set(BACKENDS.names())


CHOICES = _choices()
PRODUCT = ("common", "algorithms", "channels", "modeling", "executors", "controller", "recipes", "launch", "examples")


def _string_port_lookups(path: Path) -> list[int]:
    """Lines where `...inbound["x"]` / `...outbound["x"]` looks a port up by a string."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
            and node.value.attr in ENDPOINT_MAPS and isinstance(node.slice, ast.Constant)]


def _choice_comparisons(path: Path, choices: set[str] = CHOICES) -> list[int]:
    """Lines comparing an engine's or backend's name (==, !=, in and not in a literal tuple, list or set):
    what a feature needs of one is a capability its registry entry declares."""
    def names(node) -> list:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [c.value for c in items if isinstance(c, ast.Constant)]

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            if any(name in choices for c in [node.left, *node.comparators] for name in names(c)):
                out.append(node.lineno)
    return sorted(out)


def _product_files():
    for package in PRODUCT:
        yield from _files(package)


def test_executors_look_ports_up_by_handle_not_by_string():
    bad = [f"{rel}:{line}" for rel, path in _product_files() for line in _string_port_lookups(path)]
    assert bad == []


def test_engines_and_backends_are_chosen_in_their_registries_only():
    bad = [f"{rel}:{line}" for rel, path in _product_files() if rel not in REGISTRIES
           for line in _choice_comparisons(path)]
    assert bad == []


def test_the_port_and_choice_checkers_see_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('def step(self, ctx):\n    ctx.inbound["weights"]\n    return cfg.backend == "megatron"\n'
                   'ok = engine in ("native", "other")\n')
    assert (_string_port_lookups(bad), _choice_comparisons(bad)) == ([2], [3, 4])
    assert "torch" in CHOICES and "native" in CHOICES  # the registered names, not a list kept here
    assert _choice_comparisons(bad, choices={"other"}) == [4]  # a third engine's name is caught the same way


TRAINER = ("tidal/executors/trainer/executor.py", "tidal/executors/trainer/barrier.py",
           "tidal/executors/learner/learner.py")
PARALLELISM = ("pipeline", "stage", "tied", "tp_", "ep_mesh", "edp", "mesh", "fsdp")


def _members_reached(path: Path) -> dict[str, int]:
    """`self.models.<name>` in a file: name -> first line."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "models" \
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self":
            out.setdefault(node.attr, node.lineno)
    return out


def _declared() -> set[str]:
    from tidal.executors.trainer.interface import TrainerModels

    return {n for n in vars(TrainerModels) if not n.startswith("_")} | set(TrainerModels.__annotations__)


def test_the_trainer_reaches_its_backend_through_the_declared_interface_only():
    """The trainer, its barrier and the learner base call no member of their models that
    tidal/executors/trainer/interface.py does not declare, the interface names no parallelism, and both
    backends' model classes have every member it declares; the optimizer takes (what, group) reductions."""
    import inspect

    from tidal.executors.trainer.megatron_models import MegatronTriModel
    from tidal.executors.trainer.models import TriModel
    from tidal.modeling.optim import Optimizer

    declared = _declared()
    reached = {f"{rel}:{line} {name}" for rel in TRAINER for name, line in _members_reached(ROOT / rel).items()
               if name not in declared}
    assert reached == set()
    assert [n for n in declared if any(word in n for word in PARALLELISM)] == []
    for cls in (TriModel, MegatronTriModel):
        assert [n for n in declared if not hasattr(cls, n) and n not in cls.__dataclass_fields__] == [], cls
    assert set(inspect.signature(Optimizer).parameters) == {"model", "cfg", "total_steps", "passes", "layout",
                                                            "compute", "scaler"}


def test_the_interface_checker_sees_a_member_reached_around_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def step(self):\n    self.models.run(1)\n    if self.models.pipeline is None:\n        pass\n")
    assert {n: line for n, line in _members_reached(bad).items() if n not in _declared()} == {"pipeline": 3}


def _parameter_patches(path: Path) -> list[tuple[int, str]]:
    """Attributes set on a parameter inside a loop over `.parameters()` / `.named_parameters()` (beyond torch's own
    grad, data and requires_grad): a fact of a layout kept on the tensor, where no interface declares it."""
    out = []
    for loop in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.For)):
        it = loop.iter
        while isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "values"):
            it = it.func.value
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                and it.func.attr in ("parameters", "named_parameters")):
            continue
        names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for node in (n for statement in loop.body for n in ast.walk(statement)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            out += [(node.lineno, t.attr) for t in targets if isinstance(t, ast.Attribute) and
                    isinstance(t.value, ast.Name) and t.value.id in names and t.attr not in ("grad", "data", "requires_grad")]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id in names:
                out.append((node.lineno, "setattr"))
    return out


def test_no_attribute_is_patched_onto_parameters(tmp_path):
    assert [f"{rel}:{line} {attr}" for rel, path in _product_files() for line, attr in _parameter_patches(path)] == []
    bad = tmp_path / "bad.py"
    bad.write_text("for name, p in model.named_parameters():\n    p.grad = None\n    p.stage_copies = 2\n"
                   "for p in model.parameters():\n    setattr(p, 'x', 1)\n")
    assert _parameter_patches(bad) == [(3, "stage_copies"), (5, "setattr")]


def test_a_refusal_asks_for_a_capability_and_offers_every_entry_that_has_it(monkeypatch):
    """A third backend with fp16 and exact layers, and a third engine with exact decoding, registered
    beside the others: the checks take them (no "use torch" / "use native" written in), and a refusal
    names them with the built-in ones."""
    from dataclasses import replace

    from tidal.executors.generator.engines import ENGINES
    from tidal.executors.trainer.backends import BACKENDS
    from tidal.recipes.checks import check_numerics, check_trainer
    from tests.fixtures import small_config

    monkeypatch.setitem(BACKENDS._entries, "third", replace(BACKENDS.get("torch"), about="a test's"))
    monkeypatch.setitem(ENGINES._entries, "replay", replace(ENGINES.get("native")))
    fp16 = {"precision": "fp16"}
    check_trainer(small_config(trainer={**fp16, "backend": "third"}), dynamic_sampling=False)
    with pytest.raises(ValueError, match=r"trainer.precision=fp16 with trainer.backend=megatron: .*"
                                         r"use trainer.backend=third or torch$"):
        check_trainer(small_config(trainer={**fp16, "backend": "megatron"}), dynamic_sampling=False)
    exact = {"model": {"numerics": "exact"}}
    check_numerics(small_config(**exact, generator={"engine": "replay"}, trainer={"backend": "third"}))
    with pytest.raises(ValueError, match=r"generator.engine=vllm: .*use generator.engine=native or replay$"):
        check_numerics(small_config(**exact, generator={"engine": "vllm"}))
    monkeypatch.setitem(BACKENDS._entries, "third", replace(BACKENDS.get("torch"), exact=False))
    with pytest.raises(ValueError, match=r"trainer.backend=third: that backend's layers are not batch-invariant "
                                         r".*use trainer.backend=torch$"):
        check_numerics(small_config(**exact, trainer={"backend": "third"}))


def test_an_engine_in_a_file_of_its_own_runs_a_job(tmp_path):
    """generator.engine=module:attr names an EngineKind in a user's file (tests/engine_plugin.py), with no line
    added to the registry: RECORD (the native engine, saving each group) and REPLAY (no decoding at all: the
    saved groups) run the job; the replayed run trains on the same groups, so its weights end bit for bit the
    same. Their options section (generator.replay) is validated by their model. A name that is no EngineKind is
    refused in one line."""
    from tests.e2e import launch, metrics
    from tidal.launch.cli import parser, resolve

    (tmp_path / "groups").mkdir()
    replay = ["--algo", "grpo", "--set", "generator.engine=tests.engine_plugin:REPLAY"]
    with pytest.raises(ValueError, match=r"generator.replay.dri: unknown key; did you mean generator.replay.dir\?"):
        resolve(parser().parse_args([*replay, "--set", "generator.replay.dri=x"]))
    with pytest.raises(ValueError, match=r"generator.replay.dir: Field required"):
        resolve(parser().parse_args(replay))
    runs = {}
    for name in ("RECORD", "REPLAY"):
        runs[name] = launch(tmp_path / name, "--set", f"generator.engine=tests.engine_plugin:{name}",
                            "--set", f"generator.replay.dir={tmp_path / 'groups'}")
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    rows = {name: metrics(tmp_path / name) for name in runs}
    assert len(list((tmp_path / "groups").glob("*.pt"))) == sum(r["trainer/groups"] for r in rows["RECORD"]) > 0
    for key in ("trainer/rollout_digest", "trainer/logp_mismatch_max", "trainer/loss"):
        assert [r[key] for r in rows["REPLAY"]] == [r[key] for r in rows["RECORD"]], key
    assert (tmp_path / "REPLAY/final/model.safetensors").read_bytes() == \
        (tmp_path / "RECORD/final/model.safetensors").read_bytes()
    from tidal.executors.generator.engines import ENGINES

    with pytest.raises(ValueError, match=r"generator.engine: generator engine 'tests.engine_plugin:Replay': "
                                         r"tests.engine_plugin.Replay is of type type, where an object of type EngineKind is needed"):
        ENGINES.get("tests.engine_plugin:Replay")


# ---- issue 57: one import name ---------------------------------------------------------------------

def test_an_install_adds_one_name_and_import_tidal_offers_the_api():
    """pyproject's packages are tidal.*, every package of the tree among them; `import tidal` loads no
    torch, and each name of tidal.__all__ resolves."""
    import tomllib

    from setuptools import find_namespace_packages, find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = set(find_packages(str(ROOT), include=include))
    assert {name.split(".")[0] for name in installed} == {"tidal"}
    every = {p for p in find_namespace_packages(str(ROOT / "tidal"), exclude=["*__pycache__*"])
             if (ROOT / "tidal" / p.replace(".", "/") / "__init__.py").is_file()}
    assert {f"tidal.{p}" for p in every} <= installed
    probe = ("import sys, tidal; assert 'torch' not in sys.modules, 'import tidal loaded torch'; "
             "print(sorted(n for n in tidal.__all__ if getattr(tidal, n) is None))")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]


# ---- issue 57: sizes a reader takes in at once -----------------------------------------------------
MAX_FUNCTION_LINES, MAX_FILE_LINES = 50, 450


def _too_long(path: Path) -> list[str]:
    source = path.read_text()
    lines = len(source.splitlines())
    out = [f"{lines} lines (at most {MAX_FILE_LINES} a file)"] if lines > MAX_FILE_LINES else []
    return out + [f"{node.name}: {node.end_lineno - node.lineno + 1} lines (at most {MAX_FUNCTION_LINES} a function)"
                  for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_product_function_or_file_is_too_long_to_read_whole(tmp_path):
    bad = [f"{rel}: {what}" for package in PACKAGES for rel, path in _files(package) for what in _too_long(path)]
    assert bad == []
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 50)
    assert _too_long(long) == ["f: 51 lines (at most 50 a function)"]
