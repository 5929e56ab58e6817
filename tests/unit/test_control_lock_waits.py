"""Every await the control path makes while holding its lock is timed, or the wedge check is wrong.

``ControlConsumer.wedged`` reads a cut queued on the lock, behind a holder that waits on nothing timed, as the
path wedged inside the worker — and the worker then exits. That is only sound while every broker wait a holder
can make is timed (a cut's commit and send in ``cut_waits``, a fold's dead letters in ``holder_waits``): an
untimed one would read a broker outage as a wedge and end every worker at once. This reads the source, so a
new await under the lock cannot slip in unnoticed.
"""

from __future__ import annotations

import ast
import inspect

from pipeline.worker import control

TIMED = {"cut_waits", "holder_waits"}


def _is_self_attr(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _timed_with(node: ast.With) -> bool:
    """``with self.<watch>.waiting(...)``: the awaits inside are timed."""
    for item in node.items:
        call = item.context_expr
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "waiting" \
                and any(_is_self_attr(call.func.value, watch) for watch in TIMED):
            return True
    return False


def untimed_awaits(methods: dict[str, ast.AsyncFunctionDef], body: list[ast.stmt], seen: set[str]) -> list[str]:
    """The awaits in ``body`` (and in the methods of ``self`` it awaits, transitively) outside a timed ``with``."""
    found: list[str] = []

    def visit(node: ast.AST, timed: bool) -> None:
        if isinstance(node, ast.With) and _timed_with(node):
            timed = True
        if isinstance(node, ast.Await) and not timed:
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" \
                    and call.func.attr in methods:
                name = call.func.attr
                if name not in seen:
                    seen.add(name)
                    found.extend(untimed_awaits(methods, methods[name].body, seen))
            else:
                found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        for child in ast.iter_child_nodes(node):
            visit(child, timed)

    for statement in body:
        visit(statement, False)
    return found


def lock_held_bodies(methods: dict[str, ast.AsyncFunctionDef]) -> list[list[ast.stmt]]:
    """What runs with the lock held: every ``async with self._lock`` block, and what follows an explicit
    ``await self._lock.acquire()`` in the same function (publish_partials)."""
    bodies = []
    for method in methods.values():
        for node in ast.walk(method):
            if isinstance(node, ast.AsyncWith) and any(_is_self_attr(i.context_expr, "_lock") for i in node.items):
                bodies.append(node.body)
            if isinstance(node, ast.Try) and any(
                    isinstance(s, ast.Expr) and "self._lock.release()" in ast.unparse(s) for s in node.finalbody):
                bodies.append(node.body)
    return bodies


def control_methods() -> dict[str, ast.AsyncFunctionDef]:
    tree = ast.parse(inspect.getsource(control))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ControlConsumer")
    return {n.name: n for n in cls.body if isinstance(n, (ast.AsyncFunctionDef, ast.FunctionDef))}


def test_every_await_under_the_control_lock_is_timed():
    methods = control_methods()
    bodies = lock_held_bodies(methods)
    assert len(bodies) >= 4, "handle, publish_partials, on_stop and on_revoked hold the lock"
    seen: set[str] = set()
    untimed = [found for body in bodies for found in untimed_awaits(methods, body, seen)]
    assert untimed == [], f"awaits under the control lock that no watch times: {untimed}"
    assert {"_fold", "_cut"} <= seen, "the fold and the cut are read through"


def test_the_check_finds_an_untimed_await():
    """The reader itself: an await outside the watches, under the lock, is reported."""
    source = '''
class ControlConsumer:
    async def handle(self):
        async with self._lock:
            await self._fold()

    async def _fold(self):
        with self.holder_waits.waiting("dead letters"):
            await send_all()
        await self.broker.something()
'''
    tree = ast.parse(source)
    methods = {n.name: n for n in tree.body[0].body}
    (body,) = lock_held_bodies(methods)
    assert untimed_awaits(methods, body, set()) == ["line 10: await self.broker.something()"]
