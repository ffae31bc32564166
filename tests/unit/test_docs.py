"""The documentation a clone carries (issue 26 item 11): every relative link resolves inside
the repository (README linked ../shared/DESIGN.md, a file outside it), and the architecture
is the repository's own docs/architecture.md. Issue 37 made docs/ a site (mkdocs.yml) and the
README short: the checks of content that moved there follow it to its page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "operator" / "README.md",
        *sorted((REPO / "charts").glob("*/README.md"))]
SITE = REPO / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_stay_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    # Code is not a link (a regex such as `([a-z]*[a-z])?` in a generated page looks like one).
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc.name} links {target}, outside the repository"
        assert path.exists(), f"{doc.name} links {target}, which does not exist"
    assert "DESIGN.md" not in text, f"{doc.name} names DESIGN.md, which is not in a clone"


def test_no_file_points_outside_the_clone() -> None:
    """Code comments and docstrings named DESIGN.md and shared/reference/torch-notes.md too:
    neither is in a clone (the facts they pointed at are written where they are used)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    here = Path(__file__).resolve()
    for name in tracked:
        path = REPO / name
        if path == here or path.suffix not in {".py", ".md", ".toml", ".sh", ".yaml", ".txt"} \
                or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for outside in ("DESIGN.md", "shared/reference", "../shared/"):
            assert outside not in text, f"{name} names {outside}, which is not in a clone"


def test_readme_links_the_architecture() -> None:
    assert "](docs/architecture.md)" in (REPO / "README.md").read_text()


def _code_lines(doc: Path) -> list[str]:
    """The lines inside the document's fenced code blocks and inline code spans."""
    text = doc.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines()] + \
        re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_kopf_run_names_its_namespaces(doc: Path) -> None:
    """Issue 26 item 12: `kopf run -m cephalo.operator` as written warns 'FutureWarning:
    Absence of either namespaces or cluster-wide flag'."""
    for line in _code_lines(doc):
        if "kopf run" in line and "-m cephalo.operator" in line:
            assert re.search(r"(\s-A\b|--all-namespaces|\s-n\s|--namespace)", line), line


def test_pods_per_job_are_described_as_the_code_makes_them() -> None:
    """README said 'one pod per rank', the chart 'one trainer pod per GPU'; by default
    (ranksPerPod: 0) a job runs one pod per node of a pool."""
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        wrong = re.search(r"one (trainer )?pod per rank|trainer pod per GPU", text)
        assert wrong is None, f"{doc.relative_to(REPO)}: {wrong.group()!r}"


def test_the_kubernetes_quick_path_creates_the_examples_claim() -> None:
    """The README's quick path applied examples/gpt-2.7b-cluster-a.yaml, whose
    ReadWriteMany PVC gpt-2-7b-ckpt only its comments named (now on the first-job page)."""
    page = (SITE / "getting-started" / "first-job.md").read_text()
    quick = page[page.index("## The quick path"):]
    quick = quick[:quick.index("kubectl apply -f examples/gpt-2.7b-cluster-a.yaml")]
    assert "PersistentVolumeClaim" in quick and "gpt-2-7b-ckpt" in quick


def test_sample_outputs_are_labelled_as_examples() -> None:
    """Sample outputs drift from what the commands print (issue 26 item 12): each `console`
    block of `cephalo run` or `cephalo plan`, in the README or on a page, says it is an
    example, whose figures vary by machine."""
    starts = 0
    for doc in DOCS:
        if doc.name in {"readme-walk.md", "getting-started-walk.md"}:  # transcripts, as run
            continue
        text = doc.read_text()
        for match in re.finditer(r"```console\n\$ cephalo (run|plan) ", text):
            starts += 1
            before = text[max(0, match.start() - 300):match.start()]
            assert "Example output" in before, (doc.name, text[match.start():match.start() + 80])
    assert starts >= 3  # the README's plan, the local run, the planning page


def test_readme_is_short_and_keeps_the_two_set_up_commands() -> None:
    """Issue 37: a README of at most ~200 lines, whose two set-up commands (one runs the main
    job, one the tests) are the ones the local-run page gives, line for line."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, len(readme.splitlines())
    commands = ["scripts/venv.sh && .venv/bin/cephalo run examples/quickstart.yaml",
                "scripts/venv.sh && .venv/bin/ruff check . && .venv/bin/mypy && "
                ".venv/bin/pytest -q -n 2"]
    page = (SITE / "getting-started" / "local-run.md").read_text()
    for command in commands:
        assert command in readme.splitlines(), command
        assert command in page.splitlines(), command


def test_every_page_is_in_the_sites_navigation() -> None:
    """A page missing from mkdocs.yml's nav is built but reachable from nowhere (MkDocs only
    says so at INFO level, which the strict build lets through)."""

    class Loader(yaml.SafeLoader):
        pass
    # mkdocs.yml names a Python function (the mermaid fence's formatter) with a tag.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for v in node.values() for p in pages(v)]
        if isinstance(node, list):
            return [p for v in node for p in pages(v)]
        return []
    listed = set(pages(config["nav"]))
    on_disk = {p.relative_to(SITE).as_posix() for p in SITE.rglob("*.md")}
    assert sorted(listed - on_disk) == [], "mkdocs.yml lists pages that do not exist"
    assert sorted(on_disk - listed) == [], \
        "pages not in mkdocs.yml's nav: add them there (new user-guide pages: the marked spot)"


def test_the_cost_table_has_a_row_pair_per_case_the_bench_plans() -> None:
    """The README walk: bench/cost_plans.py printed Cluster A's gpt-1.3b rows, which the
    README's table (otherwise as printed) lacked; the table now lives on the cost page."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cost_plans_bench",
                                                  REPO / "bench" / "cost_plans.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    page = (SITE / "guide" / "elastic-and-cost.md").read_text()
    for cluster, _, model, batch in bench.CASES:
        for objective in ("throughput", "cost (>= 50% of it)"):
            row = f"| {cluster} | {model} | {batch} | {objective} |"
            assert row in page, f"the cost table (docs/guide/elastic-and-cost.md) has no row {row}"


def test_the_short_name_the_docs_give_is_the_crds() -> None:
    """The architecture said short name `cj` and the chart README "its short name `cj` is
    CronJob's" after the CRD's became `cjob` (`cj` is CronJob's: kubectl picks the built-in)."""
    crd = yaml.safe_load((REPO / "crds" / "cephalojob.yaml").read_text())
    short_names = crd["spec"]["names"]["shortNames"]
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for name in re.findall(r"short name `(\w+)`", text):
            assert name in short_names, f"{doc.relative_to(REPO)}: short name `{name}`"
