"""Programmatic dependent launch (kernels/sync.py, `LAUNCH` and `pdl_enter`): a kernel launched with `**sync.LAUNCH`
may start while its predecessor still runs, so its first statement must be `sync.pdl_enter()` or `sync.pdl_wait()`
(both wait for the predecessor; one that begins with `pdl_wait` must also call `sync.pdl_release()`, or the next
launch waits for its CTAs to exit), or `sync.pdl_start(X)` with `sync.pdl_finish(X)` as its last statement (a kernel
that reads nothing its predecessor writes waits for it at its end), or `sync.pdl_ahead()` (loads of what launches
before its predecessor wrote) followed by `sync.pdl_enter()` once on every path. Checked on the source: every launch
with `**sync.LAUNCH` (or `**sync.launch_options(...)`) in the package names a kernel whose body begins with such a
call (after its docstring), and every kernel that calls it is launched that way somewhere."""

import ast
from pathlib import Path

import weave_moe

PACKAGE = Path(weave_moe.__file__).parent


def _is_launch_option(keyword: ast.keyword) -> bool:
    """`**sync.LAUNCH` or `**sync.launch_options(...)`."""
    value = keyword.value
    if keyword.arg is not None:
        return False
    if isinstance(value, ast.Call):
        return ast.unparse(value.func) == "sync.launch_options"
    return (isinstance(value, ast.Attribute) and value.attr == "LAUNCH"
            and isinstance(value.value, ast.Name) and value.value.id == "sync")


def _launched_kernel(call: ast.Call) -> str | None:
    """`kernel[grid](...)` or `kernel.warmup(...)` -> "kernel"."""
    func = call.func
    if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):
        return func.value.id
    if isinstance(func, ast.Attribute) and func.attr == "warmup" and isinstance(func.value, ast.Name):
        return func.value.id
    return None


def _enters(function: ast.FunctionDef) -> bool:
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]   # the docstring
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)):
        return False
    name = ast.unparse(first.value.func)
    calls = {ast.unparse(n.func) for n in ast.walk(function) if isinstance(n, ast.Call)}
    if name == "sync.pdl_wait":
        return "sync.pdl_release" in calls
    if name == "sync.pdl_ahead":   # loads what earlier launches wrote, then waits (pdl_enter) on every path
        return _enters_on_every_path(body[1:])
    if name == "sync.pdl_start":   # waits first unless INDEPENDENT; then it must wait last
        last = body[-1]
        return (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                and ast.unparse(last.value.func) == "sync.pdl_finish"
                and [ast.unparse(a) for a in last.value.args] == [ast.unparse(a) for a in first.value.args])
    return name == "sync.pdl_enter"


def _enters_on_every_path(statements: list) -> bool:
    """Whether every path through `statements` calls `sync.pdl_enter()` exactly once, at its own level: a plain
    statement, or an if / elif / else (a constexpr one too) all of whose branches do; no call inside a loop."""
    entered = 0
    for statement in statements:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) \
                and ast.unparse(statement.value.func) == "sync.pdl_enter":
            entered += 1
        elif isinstance(statement, ast.If):
            branches = [_enters_on_every_path(statement.body), _enters_on_every_path(statement.orelse)]
            inside = [any(isinstance(n, ast.Call) and ast.unparse(n.func) == "sync.pdl_enter"
                          for s in branch for n in ast.walk(s)) for branch in (statement.body, statement.orelse)]
            if all(branches):
                entered += 1
            elif any(inside):
                return False
        elif any(isinstance(n, ast.Call) and ast.unparse(n.func) == "sync.pdl_enter" for n in ast.walk(statement)):
            return False   # inside a loop, a with, ...
    return entered == 1


def test_pdl_ahead_kernels_enter_once_on_every_path():
    """The kernels that load ahead of their wait (`sync.pdl_ahead`) call `sync.pdl_enter()` once on every path, and
    the rule catches a path without it or with two."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if body and ast.unparse(body[0]) == "sync.pdl_ahead()":
                    found.add(node.name)
                    assert _enters(node), node.name
    assert {"emit_kernel", "_gather_rows_kernel"} <= found, found
    bad = [
        "if a:\n    sync.pdl_enter()\nelse:\n    pass",                                # a path without
        "sync.pdl_enter()\nif a:\n    sync.pdl_enter()\nelse:\n    sync.pdl_enter()",  # two on one path
        "for i in range(3):\n    sync.pdl_enter()",                                   # in a loop
    ]
    good = ["x = 1\nif a:\n    y = 2\nsync.pdl_enter()\nz = 3",
            "if a:\n    sync.pdl_enter()\nelif b:\n    sync.pdl_enter()\nelse:\n    sync.pdl_enter()"]
    assert not any(_enters_on_every_path(ast.parse(code).body) for code in bad)
    assert all(_enters_on_every_path(ast.parse(code).body) for code in good)


def test_every_kernel_launched_with_pdl_waits_for_its_predecessor_first():
    kernels, entering, launched = {}, set(), {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                kernels[node.name] = path
                if _enters(node):
                    entering.add(node.name)
            if isinstance(node, ast.Call) and any(_is_launch_option(k) for k in node.keywords):
                name = _launched_kernel(node)
                if name is not None:
                    launched[name] = path
            if isinstance(node, ast.FunctionDef):   # a launch helper: returns (kernel, grid, args, kwargs) with the
                #                                     options in kwargs (grouped_gemm's _gemm0_launch, _gemm1_launch)
                options = any(isinstance(n, ast.Call) and ast.unparse(n.func) == "dict"
                              and any(_is_launch_option(k) for k in n.keywords) for n in ast.walk(node))
                for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and options):
                    if isinstance(ret.value, ast.Tuple) and isinstance(ret.value.elts[0], ast.Name):
                        launched[ret.value.elts[0].id] = path
    assert len(launched) >= 12, launched   # the resident call's kernels (pack, exchange, counts, plan, tables, ...)
    missing = {name: str(path) for name, path in launched.items() if name in kernels and name not in entering}
    assert not missing, (f"launched with sync.LAUNCH but not beginning with sync.pdl_enter() (or sync.pdl_wait() "
                         f"with a sync.pdl_release()): {missing}")
    assert all(name in kernels for name in launched), set(launched) - set(kernels)
    assert entering <= set(launched), f"call sync.pdl_enter() but are never launched with it: {entering - set(launched)}"


def test_grouped_gemms_launch_plainly_when_asked():
    """`pdl=False` (KernelConfig.grouped_pdl, the layer's default) launches a grouped GEMM without programmatic
    dependent launch; `pdl=True` as every other kernel (sync.LAUNCH)."""
    import torch

    from weave_moe.backends.weave.kernels import gemm_configs as gc
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.backends.weave.kernels import sync

    offsets = torch.tensor([0, 8, 16], dtype=torch.int32)
    for gemm in (0, 1):
        cfg = gc.analytical_configs(gemm)[0]
        tiles = gg.build_tile_table_torch(offsets, cfg.block_m, 128, cfg.split_tail)
        h = torch.empty(128, 64, dtype=torch.bfloat16)
        for pdl in (False, True):
            if gemm == 0:
                w13 = torch.empty(2, 128, 32, dtype=torch.bfloat16)
                _, _, _, kwargs = gg._gemm0_launch(torch.empty(128, 32, dtype=torch.bfloat16), w13, h, tiles, cfg,
                                                   num_sms=4, pdl=pdl)
            else:
                w2 = torch.empty(2, 32, 64, dtype=torch.bfloat16)
                _, _, _, kwargs = gg._gemm1_launch(h, w2, torch.empty(128, 32, dtype=torch.bfloat16), tiles, cfg,
                                                   num_sms=4, pdl=pdl)
            assert kwargs["launch_pdl"] is (sync.PDL and pdl), (gemm, pdl)
    assert sync.launch_options() == sync.LAUNCH
