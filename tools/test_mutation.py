"""mutation.py's exclusions: what it leaves unmutated is an error message's words and nothing else.

The mutation run itself is a habit, not a test (an hour and more: mutation.py's docstring);
these tests hold the two functions that decide which mutants are never made, on small
sources whose every line is known. Each has its negative control: a parameter or local
that the code reads outside a message is mutated.
"""

import json
import os
import textwrap

import pytest

import mutation

SOURCE = textwrap.dedent('''
    def check(where, name, value, minimum=0):
        if value < minimum:
            raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
        return value

    def outer(where, steps):
        return check(where, "steps", steps, 1)

    def logic(where, name):
        if where:
            raise ValueError(f"{where}: {name}")
        return name

    def local(count, values):
        what = {2: "two"}.get(count, f"{count} ints")
        if len(values) != count:
            raise ValueError(f"need {what}, got {values}")
        size = len(values)
        if size > 9:
            raise ValueError(f"{size} is too many")
        return size
''')


def line_of(text: str) -> int:
    [number] = [i for i, line in enumerate(SOURCE.splitlines(), 1) if text in line]
    return number


def test_a_parameter_is_wording_only_where_nothing_but_a_message_reads_it():
    found = mutation.wording_parameters(SOURCE)
    # check: where and name only in the raise; value and minimum in the test as well
    assert found["check"] == {"where": (0, False), "name": (1, False)}
    # outer hands its where on to check's where: wording too, to the fixed point
    assert found["outer"] == {"where": (0, False)}
    # logic reads where in its if and returns name: neither is wording (the control)
    assert "logic" not in found and "local" not in found


def test_a_parameter_handed_to_an_imported_helpers_words_is_wording_too(tmp_path):
    """imported_wording: a function imported by name from another module of the project
    (a file in the folder) keeps its wording parameters here, under the name it is
    imported as, its own imports read in turn; a hand-on to it makes a parameter here
    wording. The controls: a module that is not the project's is not read, a parameter
    this module also reads is not wording, and without the import nothing here is."""
    (tmp_path / "base.py").write_text(textwrap.dedent('''
        def fail(where, what):
            raise ValueError(f"{where}: {what}")
    '''))
    (tmp_path / "helper.py").write_text(textwrap.dedent('''
        from base import fail

        def check(where, value):
            if value < 0:
                fail(where, "negative")
            return value
    '''))
    user = textwrap.dedent('''
        import numpy as np
        from helper import check as checked
        from numpy import asarray

        def run(v, where):
            return checked(where, v) + 1

        def read(v, where):
            print(where)
            return checked(where, v)
    ''')
    imported = mutation.imported_wording(user, tmp_path)
    assert imported == {"checked": {"where": (0, False)}}, imported
    assert mutation.wording_parameters(user, imported) == {"run": {"where": (1, False)}}
    assert mutation.wording_parameters(user) == {}


def test_message_lines_are_a_raises_words_and_the_locals_only_they_read():
    lines = mutation.message_lines(SOURCE)
    assert line_of('raise ValueError(f"{where}: {name} must be') in lines
    assert line_of('what = {2: "two"}') in lines  # what: read by a message alone
    # size is read by the return and the test: its assignment is code (the control), as is
    # every line that holds code besides the message
    assert line_of("size = len(values)") not in lines
    assert line_of("if value < minimum") not in lines and line_of("return check(") not in lines
    # a raise in logic is a message even though where is not wording there
    assert line_of('raise ValueError(f"{where}: {name}")') in lines


def test_a_part_of_a_set_mutates_only_its_modules_and_runs_only_their_test_files():
    """``mutation.py pure arithmetic.py model.py``: the set's folder is configured for those
    two modules and their own test files, nothing else; the whole set, for all of them."""
    def section(cfg, key):
        lines = cfg.splitlines()
        start = lines.index(f"{key} =")
        out = []
        for line in lines[start + 1:]:
            if not line.startswith("    "):
                break
            out.append(line.strip())
        return out

    part = mutation.mutmut_config("pure", ["arithmetic.py", "model.py"])
    assert section(part, "only_mutate") == ["arithmetic.py", "model.py"]
    assert section(part, "pytest_add_cli_args_test_selection") == ["test_arithmetic.py", "test_model.py"]
    whole = mutation.mutmut_config("pure")
    assert section(whole, "only_mutate") == list(mutation.SETS["pure"])
    assert section(whole, "pytest_add_cli_args_test_selection") == mutation.test_files("pure")
    assert len(mutation.test_files("pure")) == len(mutation.SETS["pure"])


def test_a_traced_modules_mutants_run_every_test_of_its_own_files_fastest_first():
    """mutmut's statistics miss a test that only calls a cached jit program (it reaches no
    function): a TRACED module's mutants run every test of its own files that the statistics
    ran; any other module's, the tests that reached the function; another file's tests never."""
    durations = {"test_model.py::slow": 2.0, "test_model.py::cached_only": 0.5, "test_model.py::fast": 0.1,
                 "test_plan.py::a": 0.3, "test_equivalence.py::b": 0.2, "test_equivalence.py::c": 0.05}
    mapping = {"model.x_loss": {"test_model.py::slow", "test_equivalence.py::b"},
               "plan.x_epoch_plan": {"test_plan.py::a", "test_model.py::fast"}}
    got = mutation.own_tests("pure", mapping, durations)
    assert mutation.TRACED == {"model.py"}
    assert got["model.x_loss"] == ["test_model.py::fast", "test_model.py::cached_only", "test_model.py::slow"]
    assert got["plan.x_epoch_plan"] == ["test_plan.py::a"]  # not TRACED: the reaching tests, own files only


def test_a_folder_holds_one_part_and_a_run_of_another_is_refused_naming_both(tmp_path, monkeypatch):
    """mutmut keeps one state a folder: a run of another part there is refused before anything
    is written, naming what the folder holds and what was asked; the same part is not."""
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    folder = tmp_path / ".mutation" / "pure"
    (folder / "mutants").mkdir(parents=True)
    (folder / "part.txt").write_text("arithmetic.py model.py\n")
    assert mutation.part_of("pure") == ["arithmetic.py", "model.py"]
    with pytest.raises(SystemExit, match=r"holds a run of arithmetic.py model.py; this is equivalence.py"):
        mutation.mutmut("pure", ["run"], ["equivalence.py"])
    with pytest.raises(SystemExit, match=r"holds a run of arithmetic.py model.py; this is arithmetic.py "
                                         r"cifar_mnist.py conformance.py"):
        mutation.mutmut("pure", ["run"], None)
    assert sorted(p.name for p in folder.iterdir()) == ["mutants", "part.txt"]  # nothing written
    (folder / "part.txt").write_text("\n")  # the whole set's run
    assert mutation.part_of("pure") is None
    with pytest.raises(SystemExit, match=r"holds a run of plan.py arithmetic.py .*; this is model.py"):
        mutation.mutmut("pure", ["run"], ["model.py"])


def test_every_module_and_test_file_a_set_names_exists():
    # A renamed or merged test file left in SETS would judge its module by fewer tests, silently.
    for name, modules in mutation.SETS.items():
        for module, files in modules.items():
            for path in (module, *files):
                assert (mutation.ROOT / path).is_file(), (name, path)


PARSER = textwrap.dedent('''
    import argparse
    def build():
        parser = argparse.ArgumentParser(description="what it does")
        parser.add_argument("--epochs", type=int, default=5, metavar="N", help="epochs (default: %(default)s)")
        parser.add_argument("--last", choices=("fill", "drop"), default="fill", help="fill " "or drop")
        group = parser.add_argument_group("the title", "the words")
        group.add_argument("--seed", default=3)
        return parser
''')


def test_a_help_text_is_left_out_and_a_default_a_choice_or_a_type_is_not(monkeypatch):
    """On mutmut's own generator (the one a run uses): with the exclusions, no mutant of
    PARSER touches a help, metavar or description argument, or an argument group's title
    and description given by position (its words, made None, or left out); every mutant of a default, a choice, a type or an option's name is still made
    (the control), and without the exclusions the help texts' mutants are made too."""
    mutmut = pytest.importorskip("mutmut", reason="requirements-mutation.txt")
    import libcst as cst
    from mutmut import configuration
    from mutmut.mutation import file_mutation
    visitor = file_mutation.MutationVisitor
    monkeypatch.setattr(file_mutation, "create_mutations", file_mutation.create_mutations)
    for attribute in ("on_visit", "_skip_node_and_children", "_create_mutations"):
        monkeypatch.setattr(visitor, attribute, getattr(visitor, attribute))
    config = configuration.Config.__new__(configuration.Config)
    config.do_not_mutate_patterns = []
    monkeypatch.setattr(configuration, "_config", config)

    def mutants() -> set[str]:
        _, found, *_ = file_mutation.create_mutations("parser.py", PARSER)
        return {cst.Module([]).code_for_node(m.mutated_node) for m in found}

    every = mutants()
    mutation._exclude_wording_arguments()
    kept = mutants()
    wording = ('"XXepochs', 'help=None', 'metavar=None', '"XXNXX"', 'description=None', '"XXwhat', '"XXor drop',
               '"WHAT IT DOES"', '"OR DROP"', '"n"', '"XXthe titleXX"', '"THE WORDS"', 'add_argument_group(None',
               'add_argument_group("the words")', 'add_argument_group("the title", )')
    assert all(any(w in m for m in every) for w in wording), mutmut.__version__
    assert not any(w in m for m in kept for w in wording)
    # a help or metavar left out: the call with every other argument as it was
    assert not any("default=5" in m and 'help="epochs' in m and "metavar" not in m for m in kept)
    assert not any('default="fill"' in m and "help" not in m and 'choices=("fill"' in m for m in kept)
    code = ["6", '"XXfillXX"', '"XXdropXX"', "type=None", "choices=None", "default=None", '"XX--epochsXX"']
    assert all(any(c == m or c in m for m in kept) for c in code), sorted(kept)
    assert any("type=" not in m and "default=5" in m for m in kept)  # type=int left out: code
    # description: None, XX, upper case (3); --epochs: metavar and help each None, left out,
    # XX, changed case (8); --last: help None, left out, and both its strings XX and upper (6);
    # the group's title and description by position: each XX and upper (4), each None (2),
    # each left out (2: the title's moves the description into its place, wording too)
    assert len(every) - len(kept) == 25
    assert any("--seed" in m for m in kept) and any("default=None" in m and "--seed" in m for m in kept)


def test_a_function_no_test_reaches_in_process_takes_the_tests_that_reach_it_in_a_child():
    """refimpl's connect runs only in the processes a test starts: its mutants run the own
    tests that reached it there; a function reached in process keeps those tests alone
    (the control: its child tests would cost minutes a mutant), and another file's tests
    never count."""
    durations = {"test_refimpl.py::fast": 0.1, "test_multiprocess.py::peers": 20.0,
                 "test_refimpl.py::child": 9.0, "test_loaders.py::other": 1.0}
    mapping = {"refimpl.x_main": {"test_refimpl.py::fast"}}
    children = {"refimpl.x_main": ["test_refimpl.py::child"],
                "refimpl.x_connect": ["test_multiprocess.py::peers", "test_refimpl.py::child",
                                      "test_loaders.py::other"]}
    got = mutation.own_tests("vendor", mapping, durations, children)
    # connect: every test of the files whose children reached it (a module fixture's
    # children report to the first test that asked for it): test_refimpl.py's fast one too
    assert got == {"refimpl.x_main": ["test_refimpl.py::fast"],
                   "refimpl.x_connect": ["test_refimpl.py::fast", "test_refimpl.py::child",
                                         "test_multiprocess.py::peers"]}
    assert mutation.own_tests("vendor", mapping, durations) == {"refimpl.x_main": ["test_refimpl.py::fast"]}
    # start_jax's work shows only in a process that starts JAX: its child tests come after
    mapping["refimpl.x_start_jax"] = {"test_refimpl.py::fast"}
    children["refimpl.x_start_jax"] = ["test_multiprocess.py::peers", "test_refimpl.py::child", "test_refimpl.py::fast"]
    assert "refimpl.x_start_jax" in mutation.IN_CHILDREN_TOO
    assert mutation.own_tests("vendor", mapping, durations, children)["refimpl.x_start_jax"] == [
        "test_refimpl.py::fast", "test_refimpl.py::child", "test_multiprocess.py::peers"]


@pytest.mark.parametrize("mode, seen", [("stats", "stats"),
                                        ("refimpl.x_connect__mutmut_2", "__main__.x_connect__mutmut_2"),
                                        ("plan.x_shard_bounds__mutmut_1", "plan.x_shard_bounds__mutmut_1")])
def test_a_child_process_reports_what_it_reached_and_runs_its_scripts_mutants(tmp_path, mode, seen):
    """CHILD_HOOK, as the sitecustomize of a child Python under mutmut, in a process that
    runs refimpl.py as its script (its functions are module __main__ there): in the
    statistics run the functions its trampolines recorded are written at its exit, one
    file a process, __main__'s under the script's name; a mutant of the script is named
    for __main__, so that mutmut activates it in the script's own functions, and a
    mutant of another module is left as it is (the controls: nothing is written under
    a mutant)."""
    pytest.importorskip("mutmut", reason="requirements-mutation.txt")
    import subprocess
    import sys
    hook, hits = tmp_path / "hook", tmp_path / "hits"
    hook.mkdir()
    hits.mkdir()
    (hook / "sitecustomize.py").write_text(mutation.CHILD_HOOK)
    script = tmp_path / "refimpl.py"
    script.write_text("import os\nfrom mutmut.state import state\n"
                      "state()._stats.update({'__main__.x_connect', 'plan.x_epoch_plan'})\n"
                      "print(os.environ['MUTANT_UNDER_TEST'])\n")
    env = dict(os.environ, PYTHONPATH=str(hook), MUTANT_UNDER_TEST=mode, MUTATION_CHILD_HITS=str(hits),
               JAX_PLATFORMS="cpu")  # the child imports no JAX; were it to, CPU only
    out = subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60, capture_output=True,
                         text=True).stdout
    assert out.strip() == seen
    written = sorted(hits.iterdir())
    if mode == "stats":
        [path] = written
        assert path.name.endswith(".json") and json.loads(path.read_text()) == ["plan.x_epoch_plan", "refimpl.x_connect"]
    else:
        assert written == []


def test_fresh_caches_makes_the_next_call_reach_every_cached_builder_and_trace_again():
    """Before each test of the statistics run: every functools cache of the project's
    modules is emptied (strategies' compiled steps and programs) and JAX traces a
    jitted function again, so its trampolines are reached by that test too; the control:
    without it the second call is served from the caches."""
    import jax
    import strategies

    traced = []

    @jax.jit
    def f(x):
        traced.append(1)
        return x + 1

    update = lambda g, s, p=None: strategies.sgd_update(g, s, p)  # noqa: E731
    strategies.update_program(update)
    f(1.0)
    f(2.0)
    assert len(traced) == 1 and strategies.update_program.cache_info().currsize >= 1  # the control
    mutation.fresh_caches()
    assert strategies.update_program.cache_info().currsize == 0
    f(3.0)
    assert len(traced) == 2
