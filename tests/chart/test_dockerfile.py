"""Static checks of the Dockerfile (no Docker engine here): stages, pins, users, labels,
what each image installs, and that the entry points it names exist and import."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from chart_helpers import CHART_DIR, ROOT, load_yaml, pyproject
from packaging.requirements import Requirement

from cephalo.operator.config import OperatorConfig

DOCKERFILE = ROOT / "Dockerfile"
FINAL_STAGES = ("operator", "trainer")
OCI_LABELS = ("title", "description", "version", "revision", "source", "licenses")
BUILD_TOOLS = re.compile(r"\b(apt-get|apk|yum|dnf|gcc|g\+\+|make|build-essential|pip install)\b")


@dataclass
class Stage:
    name: str
    base: str  # FROM with build args resolved
    instructions: list[tuple[str, str]] = field(default_factory=list)
    # Build args visible inside the stage: only those it declares (a global ARG reaches a
    # stage's instructions only when the stage re-declares it, taking the global default).
    args: dict[str, str] = field(default_factory=dict)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2),
                                                             m.group(0)), text)


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name) from Dockerfile text."""
    logical: list[str] = []
    buffer = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not buffer:
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        if (buffer + line).strip():
            logical.append(buffer + line)
        buffer = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, arg = line.strip().partition(" ")
        keyword, arg = keyword.upper(), " ".join(arg.split())
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", arg, flags=re.IGNORECASE)
            assert m, f"every stage must be named: FROM {arg}"
            current = Stage(m.group(2), _expand(m.group(1), global_args))
            stages[current.name] = current
        elif current is None:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = arg.partition("=")
            global_args[name] = default
        else:
            current.instructions.append((keyword, arg))
            if keyword == "ARG":
                name, has_default, default = arg.partition("=")
                current.args[name] = default if has_default else global_args.get(name, "")
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """A stage and every stage it copies from or builds on."""
    stage = stages[name]
    chain = [stage]
    for copy in stage.all("COPY"):
        if m := re.search(r"--from=(\S+)", copy):
            chain += _chain(stages, m.group(1))
    if stage.base in stages:
        chain += _chain(stages, stage.base)
    return chain


def _extras(stages: dict[str, Stage], image: str) -> list[str]:
    """The project's extras an image installs (`pip install ... ".[a,b]"`)."""
    found = [m.group(1) for s in _chain(stages, image) for r in s.all("RUN")
             for m in re.finditer(r'"\.\[([a-z,]+)\]"', r)]
    assert len(found) == 1, f"{image}: one project install expected, found {found}"
    return found[0].split(",")


def _exec_form(stage: Stage, keyword: str) -> list[str]:
    values = stage.all(keyword)
    return json.loads(values[-1]) if values else []


def test_parser_reads_continuations_and_args() -> None:
    args, stages = parse_dockerfile(
        'ARG IMG=python:3.11-slim\nFROM ${IMG} AS a\nRUN echo 1 \\\n # note\n && echo 2\n')
    assert args == {"IMG": "python:3.11-slim"} and stages["a"].base == "python:3.11-slim"
    assert stages["a"].all("RUN") == ["echo 1 && echo 2"]


def test_parser_scopes_global_args_to_from_lines() -> None:
    """A global ARG is not visible in a stage that does not re-declare it (Docker and
    buildah expand it to an empty string there)."""
    _, stages = parse_dockerfile("ARG IMG=python:3.11-slim\nARG UID=1000\n"
                                 "FROM ${IMG} AS a\nARG UID\nLABEL base=${IMG}\nUSER ${UID}\n")
    assert stages["a"].args == {"UID": "1000"}
    assert _expand(stages["a"].all("LABEL")[0], stages["a"].args) == "base=${IMG}"


def test_targets_exist_with_pinned_bases(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    assert set(FINAL_STAGES) <= set(stages)
    for stage in stages.values():
        image = stage.base
        assert "$" not in image, f"stage {stage.name}: unresolved base {image}"
        if image in stages:
            continue  # built on an earlier stage of this file
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert (tag and tag != "latest") or "@sha256:" in image, \
            f"stage {stage.name}: base image {image} is not pinned by tag or digest"


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_final_stages_are_non_root_labelled_and_tool_free(dockerfile, name: str) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    stage = stages[name]
    user = _expand(stage.all("USER")[-1], stage.args)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"{name}: USER {user} must be a numeric non-root uid"
    labels = " ".join(stage.all("LABEL"))
    for label in OCI_LABELS:
        assert f"org.opencontainers.image.{label}=" in labels, f"{name}: no OCI label {label}"
    for run in stage.all("RUN"):
        assert not BUILD_TOOLS.search(run), f"{name}: installs tools in the final image: {run}"
    # The final image only receives the built virtual environment from its build stage.
    copies = stage.all("COPY")
    assert copies and all("--from=" in c for c in copies), f"{name}: copies sources: {copies}"


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_base_name_label_names_the_stage_base(dockerfile, name: str) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    stage = stages[name]
    labels = _expand(" ".join(stage.all("LABEL")), stage.args)
    m = re.search(r'org\.opencontainers\.image\.base\.name="([^"]*)"', labels)
    assert m and m.group(1) == stage.base, \
        f"{name}: base.name label is {m and m.group(1)!r}, not {stage.base!r} " \
        "(re-declare the global ARG in the stage)"


def test_no_frontend_image_is_pulled() -> None:
    first = DOCKERFILE.read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first), \
        f"{first}: makes BuildKit pull a frontend image; the built-in frontend suffices"


def test_trainer_works_in_a_folder_its_user_owns(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """`cephalo run job.yaml` creates runs/ in the working directory: as uid 1000 in the
    base's root-owned /workspace it fails with Permission denied."""
    _, stages = dockerfile
    stage = stages["trainer"]
    workdirs = stage.all("WORKDIR")
    assert workdirs, "trainer: no WORKDIR (inherits the base's root-owned /workspace)"
    workdir = workdirs[-1]
    index = [kw for kw, _ in stage.instructions].index  # WORKDIR itself creates it root-owned
    runs = " ".join(_expand(r, stage.args) for r in stage.all("RUN"))
    uid = stage.args["UID"]
    assert re.search(rf"chown (-\S+ )*{uid}(:{uid})? {re.escape(workdir)}(\s|$)", runs), \
        f"trainer: WORKDIR {workdir} is not chowned to uid {uid}"
    assert index("RUN") < index("WORKDIR")


def _build_runs(stages: dict[str, Stage]) -> list[tuple[str, str]]:
    return [(s.name, r) for s in stages.values() for r in s.all("RUN") if "pip" in r]


def test_pip_can_use_a_mirror_and_an_extra_ca_without_edits(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    for name, run in _build_runs(stages):
        if "install" not in run:
            continue
        assert "PIP_INDEX_URL" in stages[name].args, f"{name}: no PIP_INDEX_URL build arg"
        assert "--mount=type=secret,id=pip-ca" in run and "PIP_CERT=/run/secrets/pip-ca" in run, \
            f"{name}: pip cannot be given an extra CA bundle (secret pip-ca)"


def test_installs_are_locked(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """Every Python package an image installs is pinned by constraints/<image>.txt (PIP_CONSTRAINT
    also reaches pip's isolated build environment, --constraint does not)."""
    _, stages = dockerfile
    project = pyproject()
    for image in FINAL_STAGES:
        lock = ROOT / "constraints" / f"{image}.txt"
        assert lock.exists(), f"no {lock.relative_to(ROOT)}: run scripts/lock-deps.sh"
        pins = {Requirement(line).name.lower().replace("_", "-"): Requirement(line)
                for line in lock.read_text().splitlines() if line and not line.startswith("#")}
        assert all(str(r.specifier).startswith("==") for r in pins.values())
        runs = [r for s in _chain(stages, image) for r in s.all("RUN") if "pip" in r]
        assert any(f"PIP_CONSTRAINT=/src/constraints/{image}.txt" in r or
                   f'PIP_CONSTRAINT="/src/constraints/{image}.txt' in r for r in runs), \
            f"{image}: the pip install does not use constraints/{image}.txt"
        extras = project["project"]["optional-dependencies"]
        wanted = [Requirement(r) for r in project["project"]["dependencies"] +
                  [r for extra in _extras(stages, image) for r in extras[extra]] +
                  project["build-system"]["requires"]]
        for req in wanted:
            name = req.name.lower().replace("_", "-")
            if name == "torch":
                continue  # the trainer's torch is the base image's (constrained to itself)
            assert name in pins, f"constraints/{image}.txt does not pin {name}: rerun " \
                "scripts/lock-deps.sh"
            version = str(pins[name].specifier).removeprefix("==")
            assert req.specifier.contains(version, prereleases=True), \
                f"constraints/{image}.txt: {name}=={version} is outside pyproject's {req}: " \
                "rerun scripts/lock-deps.sh"


@pytest.mark.parametrize("name", FINAL_STAGES)
def test_dependencies_are_a_layer_a_code_change_reuses(dockerfile, name: str) -> None:  # type: ignore[no-untyped-def]
    """The image's locked dependencies are installed in a stage that copies only the lock,
    and the project's sources come after it: a code change rebuilds the project's layer
    alone (the layer cache of docker and buildah --layers; scripts/build-images.sh counts
    the steps it reused). Exactly the lock, --no-deps: resolving the trainer's torch made pip
    fetch torch's own CUDA wheels (1.3 GB, unlocked) into the venv. The lock less the build
    backend, which only builds the wheel and must not be in the venv."""
    _, stages = dockerfile
    build = stages[f"{name}-build"]
    deps = stages[f"{name}-deps"]
    assert build.base == deps.name, f"{name}-build is not built on {name}-deps"
    assert deps.all("COPY") == ["constraints/ constraints/"], \
        f"{name}-deps copies more than the lock: {deps.all('COPY')}"
    (install,) = [r for r in deps.all("RUN") if "pip" in r]
    assert "--no-deps" in install and "-r /tmp/deps.txt" in install
    m = re.search(r"grep -v -E '\^\(([^)]*)\)==' constraints/" + name + r"\.txt > /tmp/deps\.txt",
                  install)
    assert m, f"{name}-deps: the lock is not filtered into /tmp/deps.txt"
    backend = {Requirement(r).name.lower() for r in pyproject()["build-system"]["requires"]}
    assert set(m.group(1).split("|")) == backend, \
        f"{name}-deps leaves out {m.group(1)}, not the build backend {sorted(backend)}"
    (project,) = [r for r in build.all("RUN") if "pip" in r and "install" in r]
    assert f'--no-deps ".[{",".join(_extras(stages, name))}]"' in project
    assert any(c.startswith("src/") for c in build.all("COPY"))


def test_no_pip_or_setuptools_left_in_the_venvs(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """A 3.11 venv seeds pip and an old setuptools (scanners flag it); in a venv over the
    base's site packages uninstalling pip does nothing (the base's pip stays importable).
    So the venvs are made without pip and filled by the base's pip."""
    _, stages = dockerfile
    for name, run in _build_runs(stages):
        if " venv " not in run:
            continue
        assert "--without-pip" in run, f"{name}: the venv seeds pip and setuptools"
        assert "pip uninstall" not in run, f"{name}: a pip uninstall that leaves the base's pip"


def test_images_run_as_the_uid_the_chart_and_operator_expect(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    uid = {n: int(_expand(stages[n].all("USER")[-1], stages[n].args).split(":")[0])
           for n in FINAL_STAGES}
    values = load_yaml(CHART_DIR / "values.yaml")
    deployment = (CHART_DIR / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {uid['operator']}" in deployment
    assert uid["trainer"] == values["operator"]["trainerRunAsUser"] == OperatorConfig().run_as_user


def test_operator_image_installs_no_torch(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    chain = _chain(stages, "operator")
    text = " ".join(f"{s.base} {' '.join(a for _, a in s.instructions)}" for s in chain)
    assert "torch" not in text.replace("find_spec('torch')", ""), \
        "the operator image's stages mention torch"
    assert _extras(stages, "operator") == ["operator"]
    # The trainer image carries the light experiment-tracking clients (spec.tracking:
    # mlflow-skinny, tensorboard): a job that asks for them is tracked in the released image.
    assert _extras(stages, "trainer") == ["trainer", "tracking"]
    # …and nothing the operator extra depends on pulls torch in (installed metadata, recursive).
    project = pyproject()["project"]
    todo = [Requirement(r) for r in project["dependencies"] +
            project["optional-dependencies"]["operator"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        assert name != "torch", "the operator extra depends on torch"
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional platform dependency not installed here
        todo += [Requirement(r) for r in requires]
    assert {"kopf", "kubernetes", "prometheus-client"} <= seen


def test_entry_points_exist_and_import(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    operator_cmd = _exec_form(stages["operator"], "ENTRYPOINT") + \
        _exec_form(stages["operator"], "CMD")
    assert operator_cmd[:2] == ["kopf", "run"]
    assert importlib.metadata.entry_points(group="console_scripts", name="kopf"), \
        "kopf's console script is not installed by its distribution"
    module = next(a.split("=", 1)[1] for a in operator_cmd if a.startswith("--module="))
    # The operator module imports without torch (a fresh interpreter: nothing preloaded).
    check = (f"import sys, {module}; "
             "assert 'torch' not in sys.modules, 'importing the operator imported torch'")
    subprocess.run([sys.executable, "-c", check], check=True, timeout=600)
    trainer_cmd = _exec_form(stages["trainer"], "ENTRYPOINT") + _exec_form(stages["trainer"], "CMD")
    assert trainer_cmd[:2] == ["python", "-m"]
    assert importlib.util.find_spec(trainer_cmd[2] + ".__main__") is not None, \
        f"python -m {trainer_cmd[2]} needs a __main__ module"
    subprocess.run([sys.executable, "-c", f"import {trainer_cmd[2]}"], check=True, timeout=600)


def test_exposed_ports_are_the_configured_defaults(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    values = load_yaml(CHART_DIR / "values.yaml")
    exposed = {n: {int(p) for e in stages[n].all("EXPOSE") for p in e.split()}
               for n in FINAL_STAGES}
    assert exposed["operator"] == {values["metrics"]["port"], values["health"]["port"]}
    config = OperatorConfig()
    assert exposed["trainer"] == {config.master_port, config.trainer_metrics_port}


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics (last matching pattern wins; `!` re-includes)."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.removeprefix("**/"))
               for p in prefixes):
            ignored = not negate
    return ignored


def test_build_context_holds_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    sources = {src for s in stages.values() for copy in s.all("COPY") if "--from" not in copy
               for src in copy.split()[:-1]}
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such path"
        assert not _ignored(src.rstrip("/") + ("/__init__.py" if src.endswith("/") else ""),
                            patterns), f".dockerignore excludes {src}, which the build copies"
    # Everything setuptools packages is copied (package-dir roots and the readme).
    setuptools = pyproject()["tool"]["setuptools"]
    roots = {d.split("/")[0] + "/" for d in setuptools["package-dir"].values()}
    assert roots | {"pyproject.toml", "README.md"} <= sources
    for unwanted in (".venv/bin/python", "runs/x/metrics.jsonl", ".mypy_cache/x",
                     ".ruff_cache/x", ".pytest_cache/x", "tests/unit/__init__.py", ".git/HEAD",
                     "tests/chart/test_dockerfile.py",
                     "src/cephalo/__pycache__/x.pyc", "charts/cephalo-operator/Chart.yaml"):
        assert _ignored(unwanted, patterns), f".dockerignore lets {unwanted} into the context"
    package_dir: dict[str, str] = setuptools["package-dir"]
    for package in setuptools["packages"]:  # every listed package has sources in the context
        prefix = max((p for p in package_dir if package == p or package.startswith(p + ".")),
                     key=len)
        rest = package.removeprefix(prefix).strip(".")
        folder = Path(package_dir[prefix], *(rest.split(".") if rest else []))
        assert (ROOT / folder / "__init__.py").exists(), f"{package}: no {folder}/__init__.py"
        assert not _ignored(f"{folder}/__init__.py", patterns)


def test_every_subpackage_is_packaged() -> None:
    """The images use a normal (not editable) install: an unlisted package would be missing."""
    setuptools = pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts])
            assert name in listed, (f"{name} ({init.parent.relative_to(ROOT)}) is not in "
                                    "[tool.setuptools] packages: `pip install .` drops it")


def test_build_stage_pythons_ignore_the_source_folder(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """Build stages copy `operator/` into their WORKDIR; a `python` that puts the working
    directory on sys.path would import it instead of the stdlib `operator` and crash, so
    every interpreter started there runs isolated (-I)."""
    _, stages = dockerfile
    for stage in stages.values():
        if not any("operator/" in c for c in stage.all("COPY")):
            continue
        for run in stage.all("RUN"):
            # `pip --python VENV/bin/python` re-runs pip from pip's own folder (its sys.path[0]),
            # never from the working directory.
            run = re.sub(r"--python[= ]\S+", "", run)
            for m in re.finditer(r"(?:^|[\s/])python3?\s+(\S+)", run):
                assert m.group(1) == "-I", f"stage {stage.name}: `{m.group(0).strip()} …` " \
                    "without -I sees /src/operator as the stdlib module"
