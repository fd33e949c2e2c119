"""Reward functions named in a config: import errors name the argument and module; bad outputs are named."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from lit_rlhf.reward_fns import import_reward_fn, reward_scores


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """Write ``<name>.py`` with ``source`` into an importable folder; returns the module name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        sys.modules.pop(name, None)
        return name

    return write


def test_a_module_that_raises_while_importing_is_named(reward_module):
    name = reward_module("broken_rewards", "import math\nraise RuntimeError('no GPU here')\ndef f(p, r): return r\n")
    with pytest.raises(ValueError) as err:
        import_reward_fn(f"{name}:f", argument="monitor_reward_fn")
    msg = str(err.value)
    assert "monitor_reward_fn 'broken_rewards:f'" in msg and "importing module 'broken_rewards' raised RuntimeError: no GPU here" in msg


def test_a_module_calling_sys_exit_is_named(reward_module):
    name = reward_module("exiting_rewards", "import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match="importing module 'exiting_rewards' raised SystemExit: 3"):
        import_reward_fn(f"{name}:f")


@pytest.mark.parametrize(
    "path, problem",
    [
        ("no_colon", "must look like 'package.module:function'"),
        ("surely_missing_module_xyz:f", "module 'surely_missing_module_xyz' not found"),
        ("math:no_such", "module 'math' has no attribute 'no_such'"),
        ("math:pi", "is not callable (a float)"),
    ],
)
def test_import_errors_name_the_argument(path, problem):
    with pytest.raises(ValueError, match=r"^reward_fn .*" + problem.replace("(", r"\(").replace(")", r"\)")):
        import_reward_fn(path)


def test_a_module_not_found_names_the_directories_searched(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        import_reward_fn("surely_missing_module_xyz:f")
    message = str(err.value)
    assert "module 'surely_missing_module_xyz' not found" in message and "searched the directories of sys.path" in message
    assert str(tmp_path) in message and "the working directory" in message
    # a module that is there but imports a missing one is named as such
    (tmp_path / "needs_missing_xyz.py").write_text("import surely_missing_dependency_xyz\n")
    with pytest.raises(ValueError, match="importing module 'needs_missing_xyz' raised ModuleNotFoundError: No module "
                                         "named 'surely_missing_dependency_xyz'"):  # fmt: skip
        import_reward_fn("needs_missing_xyz:f")


def test_import_returns_the_function(reward_module):
    name = reward_module("good_rewards", "def f(prompts, responses):\n    return [len(r) for r in responses]\n")
    assert import_reward_fn(f"{name}:f")(["p"], ["abc"]) == [3]


@pytest.mark.parametrize(
    "scores, kind, problem",
    [
        (["1.0", 2.0], TypeError, "rf returned a str at position 0: '1.0'"),
        ([1.0, None], TypeError, "rf returned a NoneType at position 1: None"),
        ([True, 1.0], TypeError, "rf returned a bool at position 0"),
        ("0.5 0.5", TypeError, "rf must return a list of 2 numbers, got str"),
        (None, TypeError, "rf must return a list of 2 numbers, got NoneType"),
        ([1.0], ValueError, "rf returned 1 scores for 2 responses"),
        ([[1.0], [2.0]], TypeError, "rf returned a list at position 0"),
        ([1.0, 1e39], ValueError, "rf returned 1e+39 at position 1, beyond float32's range"),  # not "non-finite"
        ([-(10**400), 1.0], ValueError, "at position 0, beyond float32's range"),
    ],
)
def test_bad_reward_outputs_are_named(scores, kind, problem):
    with pytest.raises(kind) as err:
        reward_scores("rf", scores, 2)
    assert problem in str(err.value)


def test_numbers_of_any_kind_become_float32_and_nonfinite_passes():
    out = reward_scores("rf", [1, np.float64(2.5), float("nan"), -math.inf], 4)
    assert out.dtype == torch.float32 and out[:2].tolist() == [1.0, 2.5] and math.isnan(out[2]) and out[3] == -math.inf
    assert reward_scores("rf", np.array([1.0, 2.0]), 2).tolist() == [1.0, 2.0]
    assert reward_scores("rf", torch.tensor([3.0]), 1).tolist() == [3.0]
