"""Mutation testing of this project with mutmut (tools/requirements-mutation.txt): a developer's
tool, not part of the reference. Run it from the project's folder:

    nice python tools/mutation.py pure      # plan, arithmetic, cifar_mnist, conformance, encoding, equivalence, model
    nice python tools/mutation.py vendor    # loaders, strategies, dali_loader, rocal_loader, rocal_api, refimpl

Each plants every single-line bug mutmut knows in those modules and runs, for each
mutant, only the tests that reached the function it sits in (mutmut's call statistics,
taken once by running the set's test files); then prints a table of the scores.
``python tools/mutation.py SET table`` prints it again, ``survivors`` lists each
survivor with its diff, ``rerun`` tests the survivors again (after new tests: mutmut
keeps a verdict until asked), and any other word goes to mutmut as it is, run where the
set lives (``python tools/mutation.py pure show plan.x_shard_bounds__mutmut_3``, ``... results``,
``... run 'plan.*'``, ``... browse``). Module names pick a part of the set
(``python tools/mutation.py pure arithmetic.py model.py``: those modules, their own test files);
a folder holds one part, and a run of another part there is refused (``mutmut`` below).

Why this file, and not a bare ``mutmut run`` with a [mutmut] section in setup.cfg:

* Two sets, two test selections. mutmut reads one configuration from the folder it runs
  in and keeps everything in that folder's ``mutants/``; the pure modules are judged by
  their own test files (an hour on 2 cores), the vendor modules and refimpl by theirs
  (longer). So each set runs in a folder of its own, .mutation/SET/ (ignored by git):
  symbolic links to the project's files, the setup.cfg written below, mutmut's mutants/.
* JAX cannot be forked. mutmut forks a process per mutant; a process in which JAX has
  started its backend deadlocks in a forked child (its thread pools do not survive
  os.fork), and conftest.py starts it at import. ``process_isolation = forkserver`` with
  ``forkserver_warmup = import`` forks every mutant from a server that has imported
  jax, numpy, pytest and hypothesis (the slow imports) and nothing that starts a backend;
  each mutant's process then imports conftest and starts its own backend.
* A fresh process per mutant also means no jit cache or lru_cache from another mutant:
  mutmut's trampolines choose the mutant at call time, and a cached trace would hide it.
  The XLA compilation cache (JAX_COMPILATION_CACHE_DIR, .mutation/SET/xla-cache) is shared
  by all mutants: it is keyed by the compiled program, so a mutant that changes the
  program compiles anew and one that does not reuses the unmutated compilation.
* mutmut skips every decorated function (but for staticmethod and classmethod). Here that
  would leave out arithmetic.keyed_table (the normalisation table itself, under
  functools.lru_cache) and jax.jit functions. Both
  decorators only wrap a function that the trampoline can sit under, so
  ``_mutate_decorated`` below lets mutmut mutate functions whose decorators are all in
  DECORATORS_TO_MUTATE_UNDER; properties stay skipped (mutmut's trampoline cannot wrap one).
* mutmut's call statistics see a function only where its trampoline runs in the test
  process, once per cache: ``child_statistics`` empties the caches before each test of
  the statistics run (``fresh_caches``) and collects what the child processes a test
  starts reach (``CHILD_HOOK``), and ``own_tests`` gives a function reached only in a
  child the tests that reach it there.
* Equivalent mutants: mutation-equivalent.txt, one line each (the mutant, the line it
  plants, why no test can tell it from the code). ``table`` counts them apart and says
  when a line no longer matches its mutant (the code changed: argue it again).

Error messages: a mutant that changes only the wording of an error message is not made:
``message_lines`` finds the lines that hold nothing but the string literals given to
``raise SomeError(...)`` or ``parser.error(...)``, and ``_exclude_messages`` hands them to
mutmut with the lines its ``do_not_mutate_patterns`` would match (a regex per line could
not tell a message's second line from any other string). ``python tools/mutation.py SET
excluded`` counts what that leaves out, per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project; this file lives in tools/

# The modules each set mutates, each with the test files that judge it: a mutant of a
# module is tested by the tests of its own files that reach its function (see
# ``_own_tests_fastest_first``), so that a module's score is what its own tests hold.
SETS = {
    "pure": {
        "plan.py": ["test_plan.py"],
        "arithmetic.py": ["test_arithmetic.py"],
        "cifar_mnist.py": ["test_cifar_mnist.py"],
        "conformance.py": ["test_conformance.py"],
        "encoding.py": ["test_encoding.py"],
        "equivalence.py": ["test_equivalence.py"],
        "model.py": ["test_model.py"],
    },
    "vendor": {
        "loaders.py": ["test_loaders.py"],
        "strategies.py": ["test_strategies.py", "test_equivalence.py"],
        "dali_loader.py": ["test_dali.py"],
        "rocal_loader.py": ["test_rocal.py"],
        "rocal_api.py": ["test_rocal.py"],
        "refimpl.py": ["test_refimpl.py", "test_multiprocess.py"],
    },
}


def test_files(name: str, modules=None) -> list[str]:
    return sorted({f for m, files in SETS[name].items() if modules is None or m in modules for f in files})


# Every project file a test may import or read; each set's folder links to all of them.
PROJECT_FILES = ["*.py", "pytest.ini", "README.md"]

# Imported by the fork server before it forks a mutant's process, so that no mutant pays
# for them: the slow third-party imports, then the project's modules (mutated: megabytes
# of source each). None of them starts a JAX backend or a thread at import (a backend or
# thread in the server would deadlock the forked processes); conftest.py does, so it is
# imported by each mutant's process.
PRELOAD = ["numpy", "jax", "jax.numpy", "jax.sharding", "hypothesis", "pytest", "xdist",
           "pytest_timeout", "plan", "arithmetic", "cifar_mnist", "conformance", "encoding", "model",
           "strategies", "equivalence", "loaders", "dali_loader", "rocal_api", "rocal_loader",
           "refimpl"]

DECORATORS_TO_MUTATE_UNDER = {"functools.lru_cache", "functools.cache", "jax.jit"}

def mutmut_config(name: str, modules=None) -> str:
    """The setup.cfg of a set's folder; ``modules``: only these of the set (and their test files)."""
    s = [m for m in SETS[name] if modules is None or m in modules]
    lines = ["# Written by mutation.py; edit mutation.py instead.", "[mutmut]"]

    def option(key, values):
        lines.append(f"{key} =" + "".join(f"\n    {v}" for v in values))

    option("source_paths", sorted(p.name for pattern in PROJECT_FILES for p in ROOT.glob(pattern)
                                  if p.suffix == ".py" and p.name != "mutation.py"
                                  and not p.name.startswith("test_") and p.name != "conftest.py"))
    option("only_mutate", list(s))
    option("also_copy", ["conftest.py", "pytest.ini", "README.md"])
    # -n 0: pytest.ini's xdist workers off (mutmut runs pytest in its own process);
    # no cache provider: nothing written next to the mutants. A negative control that patches
    # a function (monkeypatch.setattr) another module imported by name cannot reach what
    # mutmut's trampolines call, fails on the unmutated code, and makes mutmut refuse the run
    # ("failed to collect stats"): such a test needs a --deselect here.
    option("pytest_add_cli_args", ["-n", "0", "-p", "no:cacheprovider"])
    option("pytest_add_cli_args_test_selection", test_files(name, modules))
    lines += [
        "process_isolation = forkserver",
        "forkserver_warmup = import",
        "preload_modules_file = preload.txt",
        # The first test of a file pays for its module's compilations in its set-up, which
        # mutmut's estimate (call time only) does not see: room for it before "timeout".
        "timeout_constant = 10.0",
        # mutmut gives a mutant (estimate + constant) x multiplier of wall time: its default
        # 15 left a mutant that makes dataset_digest read a row at a time running 150 s or
        # more, two of them holding both cores (9 mutants a minute over plan.py). 3 stops
        # such a mutant after (estimate + 10 s) x 3, a "timeout" (counted as killed): a
        # mutant three times slower than the code is a bug the suite's watchdog would see.
        "timeout_multiplier = 3.0",
        # Git's view of the project's root would only warn from inside .mutation/SET.
        "use_git_change_detection = false",
    ]
    return "\n".join(lines) + "\n"


def prepare(name: str, modules=None) -> Path:
    """.mutation/NAME: links to the project's files, its setup.cfg and preload.txt."""
    folder = ROOT / ".mutation" / name
    folder.mkdir(parents=True, exist_ok=True)
    for pattern in PROJECT_FILES:
        for path in ROOT.glob(pattern):
            if path.name == "mutation.py":
                continue
            link = folder / path.name
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(path, folder))
    for link in folder.iterdir():  # a file the project no longer has
        if link.is_symlink() and not link.exists():
            link.unlink()
    (folder / "setup.cfg").write_text(mutmut_config(name, modules))
    (folder / "preload.txt").write_text("\n".join(PRELOAD) + "\n")
    return folder


def _message_nodes(tree) -> tuple[set[int], list]:
    """(the ids of every node inside a ``raise``'s (or ``parser.error``'s) f-string message or inside the value of
    an assignment to a local that only such messages read, those assignments)."""
    import ast
    messages = set()
    for node in ast.walk(tree):
        call = node.exc if isinstance(node, ast.Raise) else node
        if isinstance(call, ast.Call) and (isinstance(node, ast.Raise) or (
                isinstance(call.func, ast.Attribute) and call.func.attr == "error")):
            messages |= {id(n) for a in call.args if isinstance(a, ast.JoinedStr) for n in ast.walk(a)}
    words = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigns = [n for n in ast.walk(function) if isinstance(n, ast.Assign) and len(n.targets) == 1
                   and isinstance(n.targets[0], ast.Name)]
        for name in {a.targets[0].id for a in assigns}:
            reads = [n for n in ast.walk(function) if isinstance(n, ast.Name) and n.id == name
                     and isinstance(n.ctx, ast.Load)]
            if reads and all(id(n) in messages for n in reads):
                words += [a for a in assigns if a.targets[0].id == name]
    for a in words:
        messages |= set(map(id, ast.walk(a.value)))
    return messages, words


def message_lines(source: str) -> set[int]:
    """The lines that hold nothing but an error message's words: the string literals
    (plain or f-strings) given to ``raise SomeError(...)`` or ``parser.error(...)``, and the
    assignments to a local that only such an f-string reads, where every expression that
    starts on the line is part of that message (or the raise itself)."""
    import ast
    tree = ast.parse(source)
    starts: dict[int, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.expr):
            starts.setdefault(node.lineno, []).append(node)
    allowed, lines = set(), set()
    for node in ast.walk(tree):
        call = node.exc if isinstance(node, ast.Raise) else node
        if not isinstance(call, ast.Call):
            continue
        if not (isinstance(node, ast.Raise) or (isinstance(call.func, ast.Attribute)
                                                and call.func.attr == "error")):
            continue
        messages = [a for a in call.args if isinstance(a, (ast.Constant, ast.JoinedStr))
                    and not (isinstance(a, ast.Constant) and not isinstance(a.value, str))]
        if not messages:
            continue
        allowed |= {id(call), *map(id, ast.walk(call.func))}
        if isinstance(node, ast.Raise) and node.cause is not None:
            allowed |= set(map(id, ast.walk(node.cause)))
        for message in messages:
            allowed |= set(map(id, ast.walk(message)))
            lines |= set(range(message.lineno, message.end_lineno + 1))
    # A local that only a message reads (``what = ... ; raise ValueError(f"... {what}")``):
    # its assignments are the message's words too.
    for a in _message_nodes(tree)[1]:
        lines |= set(range(a.lineno, a.end_lineno + 1))
        allowed |= set(map(id, ast.walk(a)))
    return {line for line in lines if all(id(n) in allowed for n in starts.get(line, []))}


def wording_parameters(source: str, imported: dict | None = None) -> dict[str, dict]:
    """{function: {parameter: (position or None, has a default)}} for the module-level
    functions of ``source`` whose parameter is only an error message's words: every use of
    it in the body is inside a ``raise``'s message (or a local only such a message reads:
    ``_message_nodes``), or is handed on
    whole to another such parameter (``_check_int(where, "epoch", epoch)`` hands ``where``
    to ``_check_int``'s ``where``). Found to a fixed point, so a helper that passes its
    ``where`` to a helper that only prints it counts; a parameter used anywhere else (a
    test, an index, a return, a call that is not such a hand-on) is not wording.
    ``imported``: the wording parameters of functions that ``source`` imports by name
    (``imported_wording``), which a hand-on may reach too; the result is of ``source``'s own
    functions."""
    import ast
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    in_message = _message_nodes(tree)[0]
    imported = {name: words for name, words in (imported or {}).items() if name not in functions}

    def parameters(f):
        a = f.args
        positional = a.posonlyargs + a.args
        defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
        out = {p.arg: (i, d) for i, (p, d) in enumerate(zip(positional, defaults))}
        out.update({p.arg: (None, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)})
        return out

    wording: dict[str, dict] = {**imported, **{name: {} for name in functions}}
    changed = True
    while changed:
        changed = False
        for name, f in functions.items():
            handed_on: set[int] = set()
            for call in ast.walk(f):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                        and call.func.id in wording:
                    words = wording[call.func.id]
                    spots = {i for i, _ in words.values() if i is not None}
                    handed_on |= {id(a) for i, a in enumerate(call.args) if i in spots}
                    handed_on |= {id(k.value) for k in call.keywords if k.arg in words}
            for param, spot in parameters(f).items():
                if param in wording[name]:
                    continue
                uses = [n for n in ast.walk(f) if isinstance(n, ast.Name) and n.id == param]
                if uses and all(id(n) in in_message or id(n) in handed_on for n in uses):
                    wording[name][param] = spot
                    changed = True
    return {name: words for name, words in wording.items() if words and name in functions}


def imported_wording(source: str, folder: Path = ROOT, _seen: frozenset = frozenset()) -> dict[str, dict]:
    """{name in ``source``: its wording parameters} for the project's functions that
    ``source`` imports by name at module level (``from rocal_api import _call`` or ``...
    import _call as call``): a helper of another module whose ``where`` only an error
    message reads is wording there as it is in its own module (rocal_loader hands its
    places to rocal_api's ``_call`` and ``device_images``, and plan's ``check_seed``). A
    project module is ``<name>.py`` in ``folder``, read with its own imports in turn;
    any other module (NumPy, JAX) is not read."""
    import ast
    out = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ImportFrom) and not node.level and node.module):
            continue
        path = folder / f"{node.module}.py"
        if not path.is_file() or node.module in _seen:
            continue
        theirs = path.read_text()
        words = wording_parameters(theirs, imported_wording(theirs, folder, _seen | {node.module}))
        out.update({alias.asname or alias.name: words[alias.name] for alias in node.names if alias.name in words})
    return out


def _exclude_messages() -> None:
    """Makes mutmut leave out the lines of ``message_lines`` (as it leaves out the lines
    its ``do_not_mutate_patterns`` match): a mutant there only rewords an error message."""
    from mutmut.mutation import pragma_handling
    by_pattern = pragma_handling.get_lines_ignored_by_pattern
    pragma_handling.get_lines_ignored_by_pattern = lambda source: by_pattern(source) | message_lines(source)


# argparse's words for a person reading --help: what these keywords of these calls hold is
# prose that no program reads back (a help text, a metavar, a parser's description), like a
# raise's message, and a test that killed its mutants would assert a line's text. Left out
# as wording (``_exclude_wording_arguments``); the call's other arguments (a default, the
# choices, a type, an action) are code and stay mutated.
HELP_CALLS = {"ArgumentParser", "add_argument", "add_argument_group", "add_mutually_exclusive_group",
              "add_parser"}
HELP_KEYWORDS = {"help", "metavar", "description", "epilog", "title"}
# The same words handed by position: add_argument_group(title, description).
HELP_POSITIONS = {"add_argument_group": ("title", "description")}


def _exclude_wording_arguments(help_texts: bool = True) -> None:
    """Makes mutmut leave out the mutants that only change what a call hands to a
    ``wording_parameters`` parameter of a function of the same module, or of one it imports
    by name from another of the project's (``imported_wording``): the argument's own
    mutants (``"epoch"`` made ``"XXepochXX"``), the call's with that argument made None, and
    the call's without it where the parameter has a default and each positional argument
    after it is wording too. Any other mutant of the call (another argument None or gone) stays. With
    ``help_texts``, the same for a HELP_KEYWORDS argument of a call to a method (or
    ``argparse.``) named in HELP_CALLS, or one in a HELP_POSITIONS place: its words, made
    None, or left out."""
    import libcst as cst
    from mutmut.mutation import file_mutation
    visitor = file_mutation.MutationVisitor
    create, visit, skip, add = (file_mutation.create_mutations, visitor.on_visit,
                                visitor._skip_node_and_children, visitor._create_mutations)
    current: dict[str, dict] = {}
    skipped: set[int] = set()

    def create_mutations(filename, code, *args, **kwargs):
        current.clear()
        imported = imported_wording(code)
        current.update({**imported, **wording_parameters(code, imported)})
        skipped.clear()
        return create(filename, code, *args, **kwargs)

    def spots(call, words):
        """For each argument of ``call``: is it handed to a wording parameter?"""
        positional = {i for i, _ in words.values() if i is not None}
        out, i = [], 0
        for arg in call.args:
            if arg.keyword is not None:
                out.append(arg.keyword.value in words)
            else:
                out.append(not arg.star and i in positional)
                i += 1
        return out

    def same(a, b) -> bool:
        return (a.star == b.star and a.value.deep_equals(b.value)
                and (a.keyword is None) == (b.keyword is None)
                and (a.keyword is None or a.keyword.value == b.keyword.value))

    def wording_only(call, mutated, words) -> bool:
        if not (isinstance(mutated, cst.Call) and mutated.func.deep_equals(call.func)):
            return False
        A, M, at = list(call.args), list(mutated.args), spots(call, words)
        if len(M) == len(A):
            return all(same(a, m) or at[j] for j, (a, m) in enumerate(zip(A, M)))
        if len(M) != len(A) - 1:
            return False
        for i in range(len(A)):
            if at[i] and all(same(a, m) for a, m in zip(A[:i] + A[i + 1:], M)):
                keyword = A[i].keyword
                param = keyword.value if keyword is not None else next(
                    p for p, (j, _) in words.items() if j == sum(a.keyword is None for a in A[:i]))
                # A positional argument left out moves the ones after it: wording only if
                # each of those lands on wording too.
                later_code = any(a.keyword is None and not at[j] for j, a in enumerate(A) if j > i)
                return words[param][1] and (keyword is not None or not later_code)
        return False

    def words_of(node):
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            return current.get(node.func.value)
        if (help_texts and isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)
                and node.func.attr.value in HELP_CALLS):
            words = {keyword: (None, True) for keyword in HELP_KEYWORDS}
            words.update({k: (i, True) for i, k in enumerate(HELP_POSITIONS.get(node.func.attr.value, ()))})
            return words
        return None

    def on_visit(self, node):
        words = words_of(node)
        if words:
            skipped.update(id(a) for a, w in zip(node.args, spots(node, words)) if w)
        return visit(self, node)

    def skip_wording(self, node):
        return id(node) in skipped or skip(self, node)

    def create_mutations_of(self, node):
        before = len(self.mutations)
        add(self, node)
        words = words_of(node)
        if words:
            self.mutations[before:] = [m for m in self.mutations[before:]
                                       if not wording_only(node, m.mutated_node, words)]

    file_mutation.create_mutations = create_mutations
    visitor.on_visit, visitor._skip_node_and_children = on_visit, skip_wording
    visitor._create_mutations = create_mutations_of


def _mutate_decorated() -> None:
    """Lets mutmut mutate a function whose decorators are all in DECORATORS_TO_MUTATE_UNDER
    (mutmut 3.8's MutationVisitor skips every decorated function but static and class
    methods). Its trampoline goes under those decorators: lru_cache(trampoline) and
    jit(trampoline) choose the mutant at their first call, in a process that runs one."""
    import libcst as cst
    from mutmut.mutation import file_mutation

    def dotted(node) -> str:
        if isinstance(node, cst.Call):
            node = node.func
        if isinstance(node, cst.Attribute):
            return f"{dotted(node.value)}.{node.attr.value}"
        return node.value if isinstance(node, cst.Name) else ""

    skip = file_mutation.MutationVisitor._skip_node_and_children

    def skip_unless_allowed(self, node):
        if (isinstance(node, cst.FunctionDef) and node.decorators
                and all(dotted(d.decorator) in DECORATORS_TO_MUTATE_UNDER for d in node.decorators)):
            return skip(self, node.with_changes(decorators=[]))
        return skip(self, node)

    file_mutation.MutationVisitor._skip_node_and_children = skip_unless_allowed


# Modules whose functions run traced under jit or pmap behind a cache (model.update_parallel's
# lru_cache of one pmap, test_model.py's module-level ``jax.jit(model.loss)``): mutmut's call
# statistics see such a function called while it is traced, by the first test that traces
# it, and not by a later test that reuses the cached program, so those tests would never be
# run on its mutants (model._update_parallel's count at 1 real sample, model.loss's
# max(count, 1) at one real sample: each killed by its test, survivors in the run). A test
# that only calls cached programs reaches no function at all in those statistics, so for
# these modules a mutant is run against every test of the module's own files (the third
# run took only the tests that reached some function of the module, and missed these).
# Not equivalence.py: its file would make each survivor cost minutes (docs/guarantees.md).
TRACED = {"model.py"}


def _own_tests_fastest_first(name: str) -> None:
    """After mutmut has loaded its call statistics (which tests reached which function),
    keeps for each function only the tests in its module's own files (SETS), and hands
    them out fastest first: mutmut stops at the first failing test (-x), so a mutant that
    a quick test kills costs that test, not the slow ones (mutmut's order is a set's)."""
    import mutmut.__main__ as main
    from mutmut.state import state
    collect = main.collect_or_load_stats

    def collect_then_filter(*args, **kwargs):
        collect(*args, **kwargs)
        durations = state().duration_by_test

        class FastestFirst(set):
            def __iter__(self):
                return iter(sorted(set.__iter__(self), key=lambda t: (durations.get(t, 0.0), t)))

        mapping = state().tests_by_mangled_function_name
        saved = ROOT / ".mutation" / name / "mutants" / "mutation-child-stats.json"
        children = json.loads(saved.read_text()) if saved.exists() else {}
        for key, tests in own_tests(name, mapping, durations, children).items():
            mapping[key] = FastestFirst(tests)

    main.collect_or_load_stats = collect_then_filter


# Functions whose work a test process cannot see, their mutants also run the tests that
# reach them in a child process, after those in process: refimpl.start_jax configures JAX
# before its first use, and in a test process JAX has started already (an update of the
# platform or the CPU device count to a wrong value changes nothing there); set_up's
# lines for several processes (every process's devices, "in N processes") run only in
# test_multiprocess's children.
IN_CHILDREN_TOO = {"refimpl.x_start_jax", "refimpl.x_set_up"}


def own_tests(name: str, mapping: dict, durations: dict, children: dict | None = None) -> dict[str, list[str]]:
    """{mangled function: the tests its mutants run, fastest first}: of the tests mutmut saw
    reach the function (``mapping``), those in its module's own files (SETS[name]); for a
    module in TRACED, every test of its own files that the statistics ran (``durations``).
    A function that no test of its own files reaches in the test process takes those that
    reach it in a child process (``children``: ``child_statistics``): refimpl's
    ``connect`` and ``launch_local`` run only in the processes a test starts; one in
    IN_CHILDREN_TOO takes those after its tests in process."""
    out = {}
    for key in set(mapping) | set(children or {}):
        module = key.split(".")[0] + ".py"
        own = SETS[name].get(module, [])
        pool = durations if module in TRACED else mapping.get(key, ())
        tests = [t for t in pool if t.split("::")[0] in own]
        child = [t for t in (children or {}).get(key, ()) if t.split("::")[0] in own and t not in tests]
        by_time = lambda t: (durations.get(t, 0.0), t)  # noqa: E731
        if not tests:
            # A child started by a module fixture reports to the test that first asked for
            # the fixture, which need not be the one that checks that child's output: a
            # function reached only in children takes every test of those files.
            files = {t.split("::")[0] for t in child}
            out[key] = sorted({t for t in durations if t.split("::")[0] in files} | set(child), key=by_time)
        elif key in IN_CHILDREN_TOO:
            out[key] = sorted(tests, key=by_time) + sorted(child, key=by_time)
        else:
            out[key] = sorted(tests, key=by_time)
    return out


# Run in every Python process a test starts under mutmut (its folder is put first on
# PYTHONPATH): in the statistics run (MUTANT_UNDER_TEST=stats) the process writes the
# functions it reached, at its exit, for the test that started it (``child_statistics``).
CHILD_HOOK = """\
# Written by mutation.py: a child process's mutmut call statistics, saved at its exit, and
# the mutant made active in the functions of the script it runs.
import atexit
import json
import os
import sys

# A script's own functions are module __main__ in its process (python refimpl.py), and
# mutmut's trampolines activate a mutant only in a module of its name ("refimpl."):
# named so, the mutant runs in the script too (and in the same script's children).
_SCRIPT = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
_ACTIVE = os.environ.get("MUTANT_UNDER_TEST", "")
if _SCRIPT and _ACTIVE.startswith(_SCRIPT + "."):
    os.environ["MUTANT_UNDER_TEST"] = "__main__." + _ACTIVE[len(_SCRIPT) + 1:]


def _save():
    try:
        from mutmut.state import state
    except ImportError:
        return
    hits = sorted(_SCRIPT + name[len("__main__"):] if name.startswith("__main__.") else name
                  for name in state()._stats)
    if hits:
        path = os.path.join(os.environ["MUTATION_CHILD_HITS"], f"{os.getpid()}.json")
        with open(path + ".part", "w") as f:
            json.dump(hits, f)
        os.replace(path + ".part", path)


if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MUTATION_CHILD_HITS"):
    atexit.register(_save)
"""


def fresh_caches() -> None:
    """Empties every functools cache of the project's modules (the compiled steps and
    programs that strategies.py and model.py build once per key, the normalisation tables)
    and JAX's compilation caches, so that the test about to run reaches, through mutmut's
    trampolines, every function it uses, not only those no earlier test had cached. Run
    before each test of the statistics run (``child_statistics``): without it a cached
    builder (strategies.pmap_step, update_program) was mapped to the first test that
    built it alone, and the donation and divisor tests that use it later never ran on its
    mutants. The mutants' own runs need none of this: each runs in a fresh process."""
    import jax
    for name in {p.stem for p in ROOT.glob("*.py")}:
        module = sys.modules.get(name)
        for value in list(vars(module).values()) if module else ():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    jax.clear_caches()


def child_statistics(folder: Path) -> Path:
    """Makes mutmut's statistics run see every function a test reaches: before each test
    the caches are emptied (``fresh_caches``), and the functions a test reaches in the
    child processes it starts (refimpl.py runs, jax.distributed peers) are collected: every
    child writes them at its exit (CHILD_HOOK, as sitecustomize), and each test's teardown,
    before mutmut's, files them under that test in
    .mutation/SET/mutants/mutation-child-stats.json (merged with what an earlier
    statistics run found), which ``own_tests`` reads. The file's path."""
    import pytest
    from mutmut.runners import harness

    hook, hits = folder / "children", folder / "children" / "hits"
    hits.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(CHILD_HOOK)
    os.environ["MUTATION_CHILD_HITS"] = str(hits)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    saved = folder / "mutants" / "mutation-child-stats.json"

    class ChildHits:
        def __init__(self):
            self.found: dict[str, set] = {}

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self, item):
            fresh_caches()

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_teardown(self, item, nextitem):
            for path in sorted(hits.glob("*.json")):
                for function in json.loads(path.read_text()):
                    self.found.setdefault(function, set()).add(item.nodeid.removeprefix("mutants/"))
                path.unlink()

    run_stats = harness.PytestRunner.run_stats

    def run_stats_with_children(self, *, tests):
        plugin, execute = ChildHits(), self.execute_pytest
        self.execute_pytest = lambda params, **kwargs: execute(
            params, **{**kwargs, "plugins": [plugin, *kwargs.get("plugins", [])]})
        try:
            return run_stats(self, tests=tests)
        finally:
            del self.execute_pytest
            old = json.loads(saved.read_text()) if saved.exists() else {}
            for function, found in plugin.found.items():
                old[function] = sorted(set(old.get(function, [])) | found)
            saved.write_text(json.dumps(old, indent=1, sort_keys=True))

    harness.PytestRunner.run_stats = run_stats_with_children
    return saved


def part_of(name: str) -> list[str] | None:
    """The modules the set's folder was last run on (None: the whole set, or no run yet)."""
    recorded = ROOT / ".mutation" / name / "part.txt"
    return (recorded.read_text().split() or None) if recorded.exists() else None


def mutmut(name: str, args: list[str], modules=None) -> None:
    """mutmut's command line, run in the set's folder (in this process: the patch above);
    ``modules``: mutate only these of the set, with their own test files.

    mutmut keeps one state a folder (its call statistics, the mutated copies, the
    verdicts), made for the modules and test files of the run that made it: a run of
    another part there would read the statistics of the first and copy its own modules
    plain over the first's mutated ones. So a folder holds one part (part.txt), and a run
    of another part is refused, naming both, before anything is written."""
    folder = ROOT / ".mutation" / name
    want, held = sorted(modules or SETS[name]), part_of(name)
    if (folder / "mutants").exists() and sorted(held or SETS[name]) != want:
        sys.exit(f"mutation.py {name}: .mutation/{name} holds a run of {' '.join(held or SETS[name])}; "
                 f"this is {' '.join(want)}. A part is judged in a folder of its own: remove "
                 f".mutation/{name} (its verdicts go with it), or name the same modules.")
    prepare(name, modules)
    (folder / "part.txt").write_text(" ".join(modules or []) + "\n")
    os.chdir(folder)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(folder / "xla-cache"),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    # ci (derandomised: the same examples every run) without shrinking (conftest.py)
    os.environ.setdefault("HYPOTHESIS_PROFILE", "mutation")
    # The mutants run on the 8 virtual CPU devices, as on a laptop, on any host: several
    # mutant processes at once would otherwise each take a GPU (and its memory) on a GPU host.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Bytecode on (a PYTHONDONTWRITEBYTECODE=1 environment has it off): a mutated module is
    # megabytes of source, compiled once instead of once per mutant (6 of a mutant's 7 s).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    _mutate_decorated()
    _exclude_messages()
    _exclude_wording_arguments()
    child_statistics(folder)
    _own_tests_fastest_first(name)
    from mutmut.__main__ import cli
    try:
        cli.main(args, prog_name=f"mutation.py {name}", standalone_mode=False)
    except SystemExit as e:
        if e.code:
            raise


def equivalents() -> dict[str, tuple[str, str]]:
    """mutation-equivalent.txt: {mutant: (the line it plants, why)}."""
    found = {}
    path = Path(__file__).resolve().parent / "mutation-equivalent.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip() and not line.startswith("#"):
            mutant, planted, why = (part.strip() for part in line.split(" | ", 2))
            found[mutant] = (planted, why)
    return found


def verdicts(name: str) -> dict[str, dict[str, str]]:
    """{module: {mutant: status}} from mutmut's records in the set's folder."""
    from mutmut.stats import status_by_exit_code
    out = {}
    for module in SETS[name]:
        meta = ROOT / ".mutation" / name / "mutants" / (module + ".meta")
        if meta.exists():
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            # 255: mutmut's worker caught an exception from the test run itself (exit -1), as
            # when a mutant breaks a test file's import; mutmut reports it as a timeout.
            out[module] = {k: "crashed" if v == 255 else status_by_exit_code[v] for k, v in codes.items()}
    return out


def diff(name: str, mutant: str) -> str:
    folder = ROOT / ".mutation" / name
    return subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=folder,
                          capture_output=True, text=True).stdout


def planted_line(text: str) -> str:
    return " ".join(line[1:].strip() for line in text.splitlines()
                    if line.startswith("+") and not line.startswith("+++"))


def table(name: str) -> None:
    """The per-module score, from mutmut's verdicts: survivors argued equivalent
    (mutation-equivalent.txt) are counted apart, each checked against its mutant's diff.
    Score: (killed + timeout + crashed) / (checked - equivalent); "no tests" counts against
    it (no test of the module's own files reaches that function). "crashed": the test run
    itself failed (a mutant that breaks a test file's import), which mutmut counts as a
    timeout."""
    known = equivalents()
    rows, stale = [], []
    prepare(name, part_of(name))  # the folder's own setup.cfg: `mutmut show` reads its mutants
    found = verdicts(name)
    argued = [m for by_mutant in found.values() for m, s in by_mutant.items() if s == "survived" and m in known]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:  # each `mutmut show` reads a mutated module: seconds
        planted = dict(zip(argued, pool.map(lambda m: planted_line(diff(name, m)), argued)))
    for module, by_mutant in found.items():
        count = Counter(by_mutant.values())
        equivalent = 0
        for mutant, status in by_mutant.items():
            if status == "survived" and mutant in known:
                if planted[mutant] == known[mutant][0]:
                    equivalent += 1
                else:
                    stale.append(mutant)
        count["survived"] -= equivalent
        detected = count["killed"] + count["timeout"] + count["crashed"]
        judged = sum(count.values()) - count["not checked"]
        score = f"{100 * detected / judged:.1f}%" if judged else "-"
        rest = ", ".join(f"{v} {k}" for k, v in sorted(count.items())
                         if v and k not in ("killed", "survived", "not checked"))
        rows.append((module, sum(count.values()) + equivalent, count["killed"], equivalent,
                     count["survived"], rest or "-", count["not checked"] or "-", score))
    print("| module | mutants | killed | equivalent | survived | other | not checked yet | score |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print(f"\n`nice python tools/mutation.py {name}`, mutmut 3.8.1, {date.today().isoformat()}; score = "
          f"(killed + timeout + crashed) / (checked - equivalent)")
    for mutant in stale:
        print(f"mutation-equivalent.txt: {mutant} no longer plants {known[mutant][0]!r}: argue it again")


def survivors(name: str) -> None:
    known = equivalents()
    prepare(name, part_of(name))
    for module, by_mutant in verdicts(name).items():
        for mutant, status in by_mutant.items():
            if status not in ("killed", "crashed") and mutant not in known:
                print(f"# {status}\n{diff(name, mutant)}\n")


def excluded(name: str) -> None:
    """How many mutants each exclusion leaves out, per module (mutmut's own generator,
    the mutants inside functions: the ones mutmut tests): a ``raise``'s own words
    (``message_lines``), then the words handed to a helper (``wording_parameters``), then
    argparse's help texts (HELP_KEYWORDS)."""
    _mutate_decorated()
    from mutmut import configuration
    from mutmut.mutation import file_mutation, pragma_handling
    configuration._config = configuration.Config.__new__(configuration.Config)
    configuration._config.do_not_mutate_patterns = []
    by_pattern = pragma_handling.get_lines_ignored_by_pattern

    def count(module, code, messages):
        extra = message_lines if messages else (lambda source: set())
        pragma_handling.get_lines_ignored_by_pattern = lambda source: by_pattern(source) | extra(source)
        return sum(1 for m in file_mutation.create_mutations(module, code)[1]
                   if m.contained_by_top_level_function)

    codes = {module: (ROOT / module).read_text() for module in SETS[name]}
    counts = {module: [count(module, code, False), count(module, code, True)]
              for module, code in codes.items()}
    _exclude_wording_arguments(help_texts=False)
    for module, code in codes.items():
        counts[module].append(count(module, code, True))
    _exclude_wording_arguments()  # over the first: both filters, the help texts' added
    for module, code in codes.items():
        counts[module].append(count(module, code, True))
    for module, counts in counts.items():
        print(f"{module}: {counts[3]} mutants; left out: {counts[0] - counts[1]} that reword a raise's "
              f"message, {counts[1] - counts[2]} that change the words handed to a helper, "
              f"{counts[2] - counts[3]} that change a --help text")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in SETS:
        sys.exit(__doc__)
    name, rest = argv[0], argv[1:]
    # Module names of the set pick a part of it: ``pure arithmetic.py model.py`` mutates
    # those two and runs their own test files only, in a folder that holds that part alone.
    modules = [w for w in rest if w in SETS[name]] or None
    rest = [w for w in rest if w not in SETS[name]]
    if os.nice(0) < 10:  # a habit on a shared machine: every mutant's process inherits it
        os.nice(10 - os.nice(0))
    if not rest:
        mutmut(name, ["run", "--max-children", str(os.cpu_count() or 2)], modules)
        table(name)
    elif rest == ["table"]:
        table(name)
    elif rest == ["survivors"]:
        survivors(name)
    elif rest == ["excluded"]:
        excluded(name)
    elif rest == ["rerun"]:
        again = [m for module, by_mutant in verdicts(name).items() for m, s in by_mutant.items()
                 if s not in ("killed", "crashed", "timeout") and m not in equivalents()
                 and (modules is None or module in modules)]
        mutmut(name, ["run", "--max-children", str(os.cpu_count() or 2), *again], modules)
        table(name)
    else:
        mutmut(name, rest, modules)


if __name__ == "__main__":
    main(sys.argv[1:])
