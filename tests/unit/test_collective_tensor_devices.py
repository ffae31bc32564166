"""No tensor reaches a torch.distributed collective from a factory without a device (issue 43,
item 1): NCCL has no CPU backend ("No backend type associated with device type cpu"), so a
`torch.tensor([...])` all-reduced on a GPU job's group fails there, while every CPU test
(gloo) passes. Static: every collective call in trainer/ (torch.distributed's, and the
engine's `UnevenCollectives` methods, which hand their tensor straight on) is followed back,
through local names, views, casts, `torch.cat` / `torch.stack` and conditionals, to the
factories that made its tensors; a factory without `device=` (or a `.cpu()`) is a finding.
A parameter or anything else not made in the function is the caller's to get right, and
the runtime guard (tests/trainer/test_collective_devices.py) follows those."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[2] / "trainer"

# torch.distributed's tensor collectives and UnevenCollectives' (trainer/collectives.py),
# called on whatever object: `dist.all_reduce`, `coll.all_gather`, `engine.comm.all_reduce_sum`.
COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "all_reduce_sum",
}
# torch functions that make a tensor on the default device unless given `device=`.
FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand",
    "randn", "randint", "randperm", "eye", "scalar_tensor", "from_numpy",
}
# torch functions whose result lives where their tensor arguments do.
COMBINERS = {"cat", "concat", "stack", "where", "maximum", "minimum", "outer"}
DTYPES = {"float16", "bfloat16", "float32", "float64", "float", "double", "half", "int32",
          "int64", "long", "int", "bool", "uint8", "int8"}
NOT_TENSORS = {"group", "op", "src", "dst", "async_op", "unit", "bounds", "consume",
               "wire_dtype", "dtype", "tag"}


def _is_torch(node: ast.expr, names: set[str]) -> str | None:
    """`torch.<name>` with name in `names` (the name), else None."""
    if isinstance(node, ast.Attribute) and node.attr in names and \
            isinstance(node.value, ast.Name) and node.value.id == "torch":
        return node.attr
    return None


class _Tracer:
    """Follows one expression back to where its tensors were made, in a chain of
    enclosing functions (innermost first)."""

    def __init__(self, scopes: list[ast.AST]) -> None:
        self.scopes = scopes
        self.seen: set[str] = set()

    def assignments(self, name: str) -> list[ast.expr]:
        for scope in self.scopes:
            params = {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)} if isinstance(
                scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else set()
            values = [n.value for n in ast.walk(scope)
                      if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None
                      and any(isinstance(t, ast.Name) and t.id == name
                              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
            if values or name in params:
                return values  # a parameter: the caller's
        return []

    def findings(self, node: ast.expr) -> list[str]:
        if isinstance(node, ast.Call):
            factory = _is_torch(node.func, FACTORIES)
            if factory is not None:
                device = [k for k in node.keywords if k.arg == "device"]
                if not device or (isinstance(device[0].value, ast.Constant)
                                  and device[0].value.value is None):
                    return [f"line {node.lineno}: torch.{factory}(...) without device="]
                return []
            if _is_torch(node.func, COMBINERS) is not None:
                return [f for a in node.args for f in self.findings(a)]
            if isinstance(node.func, ast.Attribute):
                method = node.func.attr
                if method == "cpu":
                    return [f"line {node.lineno}: .cpu()"]
                if method == "cuda":
                    return []
                if method == "to" and (any(k.arg == "device" for k in node.keywords) or any(
                        _is_torch(a, DTYPES) is None for a in node.args)):
                    return []  # moved to a device it names
                # A tensor method (cast, view, clone, ...): where its tensor is.
                return self.findings(node.func.value)
            return []  # another function's result: its own business
        if isinstance(node, ast.Name):
            if node.id in self.seen:
                return []
            self.seen.add(node.id)
            return [f for v in self.assignments(node.id) for f in self.findings(v)]
        if isinstance(node, ast.Subscript | ast.Starred):
            return self.findings(node.value)
        if isinstance(node, ast.List | ast.Tuple):
            return [f for e in node.elts for f in self.findings(e)]
        if isinstance(node, ast.IfExp):
            return self.findings(node.body) + self.findings(node.orelse)
        if isinstance(node, ast.BinOp):
            return self.findings(node.left) + self.findings(node.right)
        return []


def collective_device_findings(source: str) -> list[str]:
    """Every tensor handed to a collective in `source` that a factory made without a
    device: 'line N: <collective> gets <what>'."""
    tree = ast.parse(source)
    out: list[str] = []

    def visit(node: ast.AST, scopes: list[ast.AST]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            scopes = [node, *scopes]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in COLLECTIVES and scopes:
            args = [*node.args, *(k.value for k in node.keywords if k.arg not in NOT_TENSORS)]
            for arg in args:
                for finding in _Tracer(scopes).findings(arg):
                    out.append(f"line {node.lineno}: {node.func.attr} gets a tensor from "
                               f"{finding}")
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    visit(tree, [])
    return out


def test_no_tensor_reaches_a_collective_without_a_device() -> None:
    findings = {path.name: collective_device_findings(path.read_text())
                for path in sorted(TRAINER.glob("*.py"))}
    assert {name: f for name, f in findings.items() if f} == {}


def test_the_check_sees_the_forms_it_must() -> None:
    """The forms the profiler and the engine use, each with and without a device."""
    bad = '''
def f(coll, times, seconds, group, device):
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(torch.tensor(times).double(), group=group)
    coll.all_reduce_sum(torch.cat([torch.zeros(2), value[0:1]]))
    staged = torch.ones(3, device=device).cpu()
    dist.broadcast(staged if seconds else value, src=0)
    def inner():
        dist.all_reduce(value.to(torch.float32))
'''
    findings = collective_device_findings(bad)
    assert [f.split(":")[0] for f in findings] == [
        "line 4", "line 5", "line 6", "line 6", "line 8", "line 8", "line 10"], findings
    good = '''
def f(coll, times, seconds, group, device, shard):
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(torch.tensor(times).to(device), group=group)
    coll.all_reduce_sum(torch.cat([torch.zeros(2, device=device), value[0:1]]))
    coll.all_gather(shard, bounds, unit=0)
    def inner():
        dist.all_reduce(value.to(torch.float32))
'''
    assert collective_device_findings(good) == []
