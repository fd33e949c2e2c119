"""How the ``lit-rlhf`` command reports errors: the project's own messages as one ``error:`` line (exit 2),
missing shipped exports named with the config that writes them, and parse errors about the online
modules' old flat arguments rewritten to name their new place."""

from __future__ import annotations

import ast
import os
import re
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import yaml

from lit_rlhf.modules.online_migration import moved_hint

# Set to 1 for the full traceback instead of one ``error:`` line.
DEBUG_ENV = "LIT_RLHF_DEBUG"
USER_ERROR_TYPES = (ValueError, TypeError, OSError)
PROJECT_DIR = Path(__file__).resolve().parent
# Hooks that run before the first step of a subcommand: project errors from them are setup errors.
SETUP_HOOKS = frozenset(
    {
        "setup", "prepare_data", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
        "configure_model", "configure_optimizers", "on_fit_start", "on_train_start", "on_validation_start",
        "on_test_start", "on_predict_start", "on_load_checkpoint", "load_state_dict",
    }
)  # fmt: skip


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from (``__cause__``, else unsuppressed ``__context__``)."""
    found: list[BaseException] = []
    while err is not None and all(err is not e for e in found):
        found.append(err)
        err = err.__cause__ if err.__cause__ is not None else (None if err.__suppress_context__ else err.__context__)
    return found


def _raised_in_project(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return PROJECT_DIR in Path(tb.tb_frame.f_code.co_filename).resolve().parents


def project_error(err: BaseException) -> BaseException | None:
    """The outermost exception of ``err``'s chain that lit_rlhf code raised with its own message
    (``ValueError``, ``TypeError`` or ``OSError``), or None: the error is not the project's."""
    return next((e for e in _chain(err) if isinstance(e, USER_ERROR_TYPES) and _raised_in_project(e)), None)


def in_setup_hook(err: BaseException) -> bool:
    """Whether ``err`` (or one it was raised from) passed through a hook of :data:`SETUP_HOOKS`."""
    return any(frame.name in SETUP_HOOKS for e in _chain(err) for frame in traceback.extract_tb(e.__traceback__))


def config_folders() -> list[Path]:
    """Where shipped configs are looked for: ``configs/`` of the working directory and of the checkout."""
    folders = [Path.cwd() / "configs", PROJECT_DIR.parent / "configs"]
    return list(dict.fromkeys(f.resolve() for f in folders if f.is_dir()))


def config_writing(folder: str) -> Path | None:
    """The shipped config whose ``HFExport`` writes ``folder`` or a folder holding it (top-level configs
    first), or None."""
    target = os.path.normpath(folder)
    for root in config_folders():
        for path in sorted(root.rglob("*.yaml"), key=lambda p: (len(p.relative_to(root).parts), str(p))):
            try:
                config = yaml.safe_load(path.read_text()) or {}
                callbacks = (config.get("trainer") or {}).get("callbacks") or []
            except (OSError, yaml.YAMLError, AttributeError):
                continue
            for entry in callbacks if isinstance(callbacks, list) else [callbacks]:
                if not isinstance(entry, Mapping) or not str(entry.get("class_path", "")).endswith("HFExport"):
                    continue
                dirpath = (entry.get("init_args") or {}).get("dirpath")
                written = os.path.normpath(str(dirpath)) if dirpath is not None else None
                if written is not None and (target == written or target.startswith(written + os.sep)):
                    return path  # the folder itself or one inside it (PPO's export/actor)
    return None


def missing_folder_hints(message: str) -> str:
    """Hints for quoted relative paths in ``message`` that do not exist but a shipped config writes."""
    hints = []
    for quoted in dict.fromkeys(re.findall(r"'([^'\s]+)'", message)):
        if os.path.isabs(quoted) or os.path.exists(quoted) or "/" not in quoted:
            continue
        writer = config_writing(quoted)
        if writer is not None:
            shown = os.path.relpath(writer) if not os.path.relpath(writer).startswith("..") else str(writer)
            hints.append(f"{quoted} is written by the HFExport of {shown}: run `lit-rlhf fit --config {shown}` first")
    return "".join(f" ({hint})" for hint in hints)


def fail(message: str, debug_hint: bool = False) -> NoReturn:
    """End the command with one ``error:`` line (exit status 2, as for a bad option)."""
    sys.stderr.write(f"error: {message}\n" + (f"(set {DEBUG_ENV}=1 for the traceback)\n" if debug_hint else ""))
    sys.stderr.flush()
    raise SystemExit(2)


def fail_on_project_error(err: BaseException) -> None:
    """``fail`` with the message of the project's error in ``err``'s chain; returns when there is none
    (or ``LIT_RLHF_DEBUG`` is set), so the caller re-raises ``err``."""
    found = project_error(err)
    if found is None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return
    message = str(found) or type(found).__name__
    if isinstance(found, OSError) and not isinstance(found, FileNotFoundError) and found.filename is not None:
        message = f"{found.strerror or message}: {found.filename}"
    fail(message + missing_folder_hints(message), debug_hint=True)


MOVED_MARKER = "the online modules' flat arguments moved into settings groups:"
# where jsonargparse's messages name a key it does not accept (config file, command line)
_UNKNOWN_KEY_PATTERNS = (
    r"Option '([\w.]+)' is not accepted", r"NestedArg\(key='([\w.]+)'", r"Key '([\w.]+)' is not expected",
    r"unrecognized arguments: --([\w.]+)",
)  # fmt: skip


def moved_keys_message(message: str) -> str | None:
    """For a parse error about keys of the earlier flat layout of the online modules, one message that
    names each key's new place (None when the error is about something else)."""
    patterns = (*_UNKNOWN_KEY_PATTERNS, r"'(\w+)' is now")  # (the latter: a nested parser's rewritten error)
    if not re.search(r"is not accepted|is not expected|unrecognized arguments|' is now", message):
        return None  # e.g. a group field's value of the wrong type: its NestedArg names a key that exists
    keys = list(dict.fromkeys(k for pattern in patterns for k in re.findall(pattern, message)))
    keys = [k.removeprefix("model.init_args.").removeprefix("model.") for k in keys]
    module = re.search(r"class_path '[\w.]*\.(\w+)'", message)
    module = module.group(1) if module else None
    if not any(moved_hint(k, module) for k in keys):
        return None
    given = re.search(r"Given value: (\{.*\})\s*$", message, flags=re.M)
    try:  # every flat key of the config's init_args, not only the first one jsonargparse names
        init_args = ast.literal_eval(given.group(1)).get("init_args", {}) if given else {}
        keys = list(dict.fromkeys([*keys, *init_args]))
    except (ValueError, SyntaxError, AttributeError):
        pass
    hints = [h for h in (moved_hint(k, module) for k in keys) if h]
    return (
        f"{MOVED_MARKER} " + "; ".join(hints)
        + " (in YAML e.g. `update: {epochs: 2}`, on the command line `--model.init_args.update.epochs 2`)"
    )


_NOISE = ("Does not validate", "Subtypes:", "Errors:", "Problem with given class_path", "Given value type:",
          "Expected a <class 'NoneType'>")  # fmt: skip


def nested_field_message(message: str) -> str | None:
    """For jsonargparse's nested error about one field of a module's or data module's argument (a settings
    group's ``generation.max_new_tokens abc``), one line: ``model.init_args.<group>.<field>: <problem>``.
    None when the error names no field below ``model`` / ``data``."""
    lines = message.splitlines()
    found = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r'Parser key "([\w.]+)"', line))]
    if len(found) < 2 or found[0][1] not in ("model", "data"):
        return None
    last, _ = found[-1]
    depth = len(lines[last]) - len(lines[last].lstrip())
    block = []
    for line in lines[last + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            break
        block.append(line.strip(" -"))
    given = next((line.split(":", 1)[1].strip() for line in block if line.startswith("Given value:")), None)
    problems = [line for line in block if line and not line.startswith(_NOISE) and not line.startswith("Given value:")]
    path = ".".join(key for _, key in found)
    path = path.replace("model.", "model.init_args.", 1).replace("data.", "data.init_args.", 1)
    expected = [m.group(1) for line in problems if (m := re.match(r"Expected a <class '([\w.]+)'>", line))]
    literal = r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$"
    choice = next((m for line in problems if (m := re.match(literal, line))), None)
    if choice:  # the wording of the settings groups' own checks
        return f"{path} must be one of [{choice.group(1)}], got {choice.group(2)!r}"
    if expected:
        got = re.search(r"Got value: (.*)$", " ".join(problems))
        got = got.group(1) if got else given
        allowed = " or ".join([*expected, *(["None"] if "Expected a <class 'NoneType'>" in block else [])])
        problem = f"expected {allowed}, got {got!r}"
    elif problems:
        problem = problems[0]
    else:
        return None
    return f"{path}: {problem}"


def lightning_misconfiguration_message(message: str) -> str:
    """Lightning's refusal of a Trainer setting, as one line, with where the online modules have it."""
    line = " ".join(message.split())
    if "manual optimization" in line:
        line += (
            " (the online modules optimise manually: they clip with update.max_grad_norm, and each minibatch's "
            "step accumulates micro-batches of scoring.forward_batch_size rows)"
        )
    return line
