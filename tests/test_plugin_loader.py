import pytest

from plugins.loader import load_function


def test_loads_and_checks_signature():
    fn = load_function("os.path.join", "--x", params=["a", "b"])
    assert fn("a", "b") == "a/b"


@pytest.mark.parametrize("path,msg", [
    ("nodots", "expected an import path"),
    ("no_such_module_xyz.f", "cannot import module 'no_such_module_xyz'"),
    ("os.path.no_such_fn", "has no attribute 'no_such_fn'"),
    ("os.sep", "is not callable"),
])
def test_errors_name_flag_and_path(path, msg):
    with pytest.raises(ValueError, match=msg) as e:
        load_function(path, "--custom-rm-path")
    assert "--custom-rm-path" in str(e.value) and path in str(e.value)


def test_wrong_arity_and_async_are_rejected():
    with pytest.raises(ValueError, match="cannot be called as"):
        load_function("os.getcwd", "--custom-rm-path", params=["args", "sample"])
    with pytest.raises(ValueError, match="async"):
        load_function("os.path.join", "--custom-generate-function-path", is_async=True)
