"""The module paths of 0.2.0 keep working for a release after the library moved into data/, training/, serving/ and
tools/: the same module objects, with a warning naming the new path."""

import importlib
import sys

import pytest

from hf_deep_nmt._moved import MOVED, MOVED_NAMES


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old):
    sys.modules.pop(f"hf_deep_nmt.{old}", None)
    new = importlib.import_module(f"hf_deep_nmt.{MOVED[old]}")
    with pytest.warns(FutureWarning, match=rf"`hf_deep_nmt\.{old}` moved to `hf_deep_nmt\.{MOVED[old]}`"):
        module = importlib.import_module(f"hf_deep_nmt.{old}")
    assert module is new
    assert module.__name__ == f"hf_deep_nmt.{MOVED[old]}"  # patching the old path patches the code that runs


def test_an_old_module_is_an_attribute_of_the_package():
    import hf_deep_nmt
    from hf_deep_nmt.serving import translate

    assert hf_deep_nmt.translate is translate


@pytest.mark.parametrize(("package", "name"), [("data", "check_corpus_file"), ("training", "prepare")])
def test_names_of_the_old_data_and_training_modules_come_from_where_they_moved(package, name):
    module = importlib.import_module(f"hf_deep_nmt.{package}")
    vars(module).pop(name, None)
    new = importlib.import_module(f"hf_deep_nmt.{MOVED_NAMES[package]}")
    with pytest.warns(FutureWarning, match=rf"`hf_deep_nmt\.{package}\.{name}` moved"):
        value = getattr(module, name)
    assert value is getattr(new, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018
