"""What an export cut short leaves behind (a fit killed inside HFExport, an interrupted copy or download) is
named by a clear error, and the resume of the run that wrote it redoes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, GPT2Config

from lit_rlhf.models import ModelSpec
from lit_rlhf.models.folders import load_pretrained
from lit_rlhf.models.tokenizer import load_tokenizer


def test_a_folder_without_tokenizer_files_is_refused_by_name(tokenizer_dir, tmp_path):
    """transformers builds a tokenizer of special tokens only from a folder with a config.json and no tokenizer
    files; it encoded every text to no ids, and the errors that followed pointed elsewhere."""
    folder = tmp_path / "half_export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 322}))
    with pytest.raises(OSError, match=r"half_export.*no vocabulary besides its special tokens"):
        load_tokenizer(str(folder))
    assert load_tokenizer(tokenizer_dir)("a b")["input_ids"]


def test_a_truncated_safetensors_file_is_named_by_its_folder(tmp_path):
    """Before: safetensors' 'incomplete metadata' naming no file, under a jsonargparse traceback in the CLI."""
    folder = tmp_path / "cut_export"
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=322, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(OSError, match=r"cut_export.*truncated or corrupt"):
        load_pretrained(AutoModelForCausalLM, ModelSpec(name_or_path=str(folder)))


KILL_IN_EXPORT = """
import os, signal, sys
import lit_rlhf.models.loading as loading
loading._restore_source_dropout = lambda path: os.kill(os.getpid(), signal.SIGKILL)  # after the weights
from lit_rlhf.cli import main
sys.argv = ["lit-rlhf", *sys.argv[1:]]
main()
"""


def test_an_export_killed_midway_is_redone_by_the_runs_resume(tmp_path, tiny_data_dir):
    """Killed after the weights, before the tokenizer and the marker: the same run resumed with --ckpt_path last
    rewrites the export (before: refused, 'files that HFExport did not write')."""
    config = tmp_path / "sft.yaml"
    config.write_text(textwrap.dedent(f"""
        seed_everything: 0
        trainer:
          max_epochs: 1
          limit_train_batches: 2
          limit_val_batches: 0
          logger: false
          enable_progress_bar: false
          callbacks:
            - class_path: lit_rlhf.callbacks.HFExport
              init_args: {{dirpath: {tmp_path}/export}}
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {{dirpath: {tmp_path}/ckpt, save_last: true}}
        model:
          class_path: lit_rlhf.modules.SFTModule
          init_args:
            model:
              config: {{model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 64}}
              tokenizer: {tiny_data_dir}/tokenizer
              seed: 0
        data:
          class_path: lit_rlhf.data.SFTDataModule
          init_args: {{tokenizer: {tiny_data_dir}/tokenizer, train_path: {tiny_data_dir}/sft.jsonl, max_length: 48,
                       max_prompt_length: 16, batch_size: 8}}
    """))
    (tmp_path / "kill_in_export.py").write_text(KILL_IN_EXPORT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.run([sys.executable, str(tmp_path / "kill_in_export.py"), "fit", "--config", str(config)],
                           env=env, cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    export = tmp_path / "export"
    assert (export / "model.safetensors").exists() and not (export / "tokenizer.json").exists()
    assert json.loads((export / "lit_rlhf_export.json").read_text())["complete"] is False
    with pytest.raises(OSError, match="no vocabulary"):
        load_tokenizer(str(export))
    resumed = subprocess.run([sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(config), "--ckpt_path", "last"],
                             env=env, cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert load_tokenizer(str(export))("a b")["input_ids"]
    assert "complete" not in json.loads((export / "lit_rlhf_export.json").read_text())
