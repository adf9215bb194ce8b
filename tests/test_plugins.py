"""Import-path loading (megatron_rl/plugins.py): each way a path can be wrong gives one line
naming the key, the path and the fix."""

import textwrap

import pytest

from megatron_rl.plugins import PluginError, check_callable, is_async, is_import_path, load_object


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    """A package ``userpkg_plugins`` on sys.path with a few good and bad modules."""
    pkg = tmp_path / "userpkg_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(textwrap.dedent("""
        def score(completion, target):
            return float(completion == target)

        async def ascore(completion, target):
            return 1.0

        def one_arg(completion):
            return 0.0

        class Holder:
            @staticmethod
            def score(completion, target):
                return 1.0

        NOT_CALLABLE = 3
    """))
    (pkg / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (pkg / "needs_dep.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userpkg_plugins"


def _one_line(err: PluginError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_loads_function_and_dotted_attribute(user_pkg):
    fn = load_object(f"{user_pkg}.good:score", "reward.fn")
    assert fn("a", "a") == 1.0
    assert load_object(f"{user_pkg}.good:Holder.score", "reward.fn")("x", "y") == 1.0
    assert is_async(load_object(f"{user_pkg}.good:ascore", "reward.fn"))
    assert not is_async(fn)


@pytest.mark.parametrize("spec", ["nocolon", "pkg.mod:", ":attr", "pkg..mod:x", "pkg.mod:a:b", "pkg mod:x"])
def test_malformed_path(spec):
    with pytest.raises(PluginError, match=r"reward\.fn=.*is not an import path; write it as package\.module:name"):
        load_object(spec, "reward.fn")


def test_missing_module(user_pkg):
    with pytest.raises(PluginError) as err:
        load_object(f"{user_pkg}.nope:score", "reward.fn")
    assert "module 'userpkg_plugins.nope' is not importable" in _one_line(err.value)
    assert "PYTHONPATH" in str(err.value)
    with pytest.raises(PluginError, match="module 'no_such_top_pkg' is not importable"):
        load_object("no_such_top_pkg.mod:score", "rollout.workflow")


def test_module_that_fails_to_import(user_pkg):
    with pytest.raises(PluginError) as err:
        load_object(f"{user_pkg}.broken:score", "reward.fn")
    assert "raised RuntimeError: boom at import" in _one_line(err.value)
    with pytest.raises(PluginError) as err:
        load_object(f"{user_pkg}.needs_dep:score", "reward.fn")
    assert "it imports 'not_a_real_dependency_xyz', which is not installed" in _one_line(err.value)


def test_missing_attribute_lists_what_is_there(user_pkg):
    with pytest.raises(PluginError) as err:
        load_object(f"{user_pkg}.good:scroe", "reward.fn")
    line = _one_line(err.value)
    assert "has no attribute 'scroe'" in line and "score" in line and line.startswith("reward.fn=")
    with pytest.raises(PluginError, match="'userpkg_plugins.good:Holder' has no attribute 'nope'"):
        load_object(f"{user_pkg}.good:Holder.nope", "reward.fn")


def test_check_callable_signature(user_pkg):
    spec = f"{user_pkg}.good:one_arg"
    with pytest.raises(PluginError) as err:
        check_callable(load_object(spec, "reward.fn"), spec, "reward.fn", ("completion", "target"))
    line = _one_line(err.value)
    assert "one_arg(completion) cannot be called as one_arg(completion, target)" in line
    with pytest.raises(PluginError, match="is a int, not a function"):
        check_callable(load_object(f"{user_pkg}.good:NOT_CALLABLE", "reward.fn"), "x:y", "reward.fn", ("a",))
    fn = load_object(f"{user_pkg}.good:score", "reward.fn")
    assert check_callable(fn, "p:q", "reward.fn", ("completion", "target")) is fn


def test_is_import_path():
    assert is_import_path("a.b:c") and not is_import_path("gsm8k") and not is_import_path(None)
