"""The documentation a clone carries (issue 26 item 11): every relative link resolves inside
the repository (README linked ../shared/DESIGN.md, a file outside it), and the architecture
is the repository's own docs/architecture.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "operator" / "README.md",
        *sorted((REPO / "charts").glob("*/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_relative_links_stay_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for target in LINK.findall(text):
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
    ReadWriteMany PVC gpt-2-7b-ckpt only its comments named."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## On Kubernetes"):]
    quick = quick[:quick.index("kubectl apply -f examples/gpt-2.7b-cluster-a.yaml")]
    assert "PersistentVolumeClaim" in quick and "gpt-2-7b-ckpt" in quick


def test_sample_outputs_are_labelled_as_examples() -> None:
    """Sample outputs drift from what the commands print (issue 26 item 12): each `console`
    block of the README says it is an example, whose figures vary by machine."""
    readme = (REPO / "README.md").read_text()
    starts = [m.start() for m in re.finditer(r"```console\n\$ cephalo (run|plan) ", readme)]
    assert len(starts) >= 2
    for start in starts:
        assert "Example output" in readme[max(0, start - 300):start], readme[start:start + 80]


def test_the_cost_table_has_a_row_pair_per_case_the_bench_plans() -> None:
    """The README walk: bench/cost_plans.py printed Cluster A's gpt-1.3b rows, which the
    README's table (otherwise as printed) lacked."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cost_plans_bench",
                                                  REPO / "bench" / "cost_plans.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    readme = (REPO / "README.md").read_text()
    for cluster, _, model, batch in bench.CASES:
        for objective in ("throughput", "cost (>= 50% of it)"):
            row = f"| {cluster} | {model} | {batch} | {objective} |"
            assert row in readme, f"README's cost table has no row {row}"
